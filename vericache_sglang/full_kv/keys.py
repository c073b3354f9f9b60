"""Chunk keys: a chained hash of fixed-size token chunks, salted with model, layout and namespace.

Chunk ``i`` covers positions ``[i * size, (i + 1) * size)``; its hash digests every token before
its end, so a key names one exact token prefix of one model's KV layout in one tenant's
namespace. A shorter tail chunk hashes its own tokens the same way (its key changes as it grows).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

DIGEST_SIZE = 16
KEY_PREFIX = "vc1"


def salt_digest(model_id: str, layout_digest: str, namespace: str) -> bytes:
    return hashlib.blake2b(f"{model_id}\x00{layout_digest}\x00{namespace}".encode(), digest_size=DIGEST_SIZE).digest()


def chain(prev: bytes, tokens: Sequence[int]) -> bytes:
    payload = struct.pack(f"<{len(tokens)}I", *tokens)
    return hashlib.blake2b(prev + payload, digest_size=DIGEST_SIZE).digest()


@dataclass(frozen=True)
class ChunkRef:
    index: int
    start: int
    end: int
    digest: bytes  # digest of the token prefix [0, end), salted

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


def chunk_refs(tokens: Sequence[int], chunk_tokens: int, salt: bytes, upto: int | None = None) -> list[ChunkRef]:
    """Refs of the chunks covering ``tokens[:upto]``; the last one may be partial."""
    n = len(tokens) if upto is None else upto
    refs, prev = [], salt
    for i, start in enumerate(range(0, n, chunk_tokens)):
        end = min(start + chunk_tokens, n)
        prev = chain(prev, tokens[start:end])
        refs.append(ChunkRef(i, start, end, prev))
    return refs
