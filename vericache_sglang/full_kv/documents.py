"""The shared-document catalog: which token prefixes in the store are registered documents (RAG).

A document is the token ids of its rendered chat-template segment, cut to whole store chunks; its
full KV is the store's shared chunks of those tokens, written once by whoever registered it. The
catalog lets every server sharing the store find the documents, to keep a compressed copy of each
next to its own prefix index. A document is named by the digest of its last chunk (the chained
hash of all its tokens), so two servers agree on names without talking to each other.

Records: ``...:doc:<digest>`` (JSON: name, tokens, created) and one index record ``...:docs`` (JSON
list of digests). Registration is an administrative act; the index is read-modified-written and
re-read to confirm, which is enough for a few registering clients, not for a stampede.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

from remote_store.backends.base import StoreError
from vericache_sglang.full_kv.keys import KEY_PREFIX
from vericache_sglang.full_kv.store import FullKVStore

MAX_INDEX_RETRIES = 5


class DocumentError(ValueError):
    """A catalog record that is malformed or does not belong to this store's layout."""


@dataclass(frozen=True)
class Document:
    digest: str  # hex of the chained hash of its tokens (its last chunk's)
    name: str
    tokens: tuple[int, ...]
    created: float

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def to_json(self) -> dict[str, object]:
        return {"digest": self.digest, "name": self.name, "tokens": len(self.tokens), "created": self.created}


class DocumentCatalog:
    def __init__(self, store: FullKVStore):
        self.store = store
        self._base = f"{KEY_PREFIX}:{store.namespace}:{store.layout_digest}"

    @property
    def index_key(self) -> str:
        return f"{self._base}:docs"

    def record_key(self, digest: str) -> str:
        return f"{self._base}:doc:{digest}"

    def digest(self, tokens: Sequence[int]) -> str:
        """The name of a document of ``tokens`` (whole chunks)."""
        n = len(tokens)
        if n == 0 or n % self.store.chunk_tokens:
            raise DocumentError(f"a document is whole chunks of {self.store.chunk_tokens} tokens, got {n}")
        return self.store.refs(tokens)[-1].digest.hex()

    def boundary_digests(self, tokens: Sequence[int]) -> list[tuple[int, str]]:
        """``(length, digest)`` of every whole-chunk prefix of ``tokens``: a document that ``tokens``
        starts with is one of them."""
        c = self.store.chunk_tokens
        return [(r.end, r.digest.hex()) for r in self.store.refs(tokens) if r.num_tokens == c]

    # reading
    def digests(self) -> list[str]:
        raw = self.store.backend.get_many([self.index_key])[0]
        if raw is None:
            return []
        try:
            index = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise DocumentError(f"the document index {self.index_key} is not JSON: {e}") from None
        if not isinstance(index, list) or not all(isinstance(d, str) for d in index):
            raise DocumentError(f"the document index {self.index_key} is not a list of digests")
        return index

    def get(self, digest: str) -> Document | None:
        raw = self.store.backend.get_many([self.record_key(digest)])[0]
        return None if raw is None else self._parse(digest, raw)

    def documents(self) -> list[Document]:
        """Every listed document whose record is present (a record deleted under the index is skipped)."""
        digests = self.digests()
        raws = self.store.backend.get_many([self.record_key(d) for d in digests]) if digests else []
        return [self._parse(d, raw) for d, raw in zip(digests, raws, strict=True) if raw is not None]

    def _parse(self, digest: str, raw: bytes) -> Document:
        try:
            rec = json.loads(raw)
            tokens = tuple(int(t) for t in rec["tokens"])
            doc = Document(digest, str(rec["name"]), tokens, float(rec["created"]))
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise DocumentError(f"document record {digest} is malformed: {e}") from None
        if self.digest(doc.tokens) != digest:
            raise DocumentError(
                f"document record {digest} holds tokens of another digest (another model "
                "layout, namespace or chunk size?)"
            )
        return doc

    # writing
    def add(self, tokens: Sequence[int], name: str) -> Document:
        """List a document whose full KV is already in the store's shared chunks."""
        digest = self.digest(tokens)
        n = self.store.longest_prefix(tokens)
        if n < len(tokens):
            raise StoreError(f"document {name!r}: the store holds the full KV of {n} of its {len(tokens)} tokens")
        doc = Document(digest, name, tuple(int(t) for t in tokens), time.time())
        record = json.dumps({"name": doc.name, "tokens": list(doc.tokens), "created": doc.created}).encode()
        self.store.backend.put_many([(self.record_key(digest), record)])
        self._update_index(lambda index: index if digest in index else [*index, digest], lambda i: digest in i)
        return doc

    def remove(self, digest: str) -> bool:
        """Unlist a document (its chunks stay, shared with any prompt that has them; the store's own
        eviction collects them). Returns whether it was listed."""
        listed = digest in self.digests()
        self._update_index(lambda index: [d for d in index if d != digest], lambda i: digest not in i)
        self.store.backend.delete_many([self.record_key(digest)])
        return listed

    def _update_index(self, change, holds) -> None:
        for _ in range(MAX_INDEX_RETRIES):
            self.store.backend.put_many([(self.index_key, json.dumps(change(self.digests())).encode())])
            if holds(self.digests()):  # a concurrent writer may have overwritten ours: try again
                return
        raise StoreError(
            f"the store did not keep the updated document index {self.index_key} in "
            f"{MAX_INDEX_RETRIES} tries: another writer kept changing it, or the store keeps the first "
            "record under a key (LMCache's tier does) and cannot hold a catalog"
        )
