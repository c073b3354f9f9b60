"""Shared prefixes (remote prefix caching, RAG): a document's full KV in the store, its compressed KV
next to the serving node's prefix index. A request that starts with a registered document drafts
at once over the compressed prefix; its own prompt tokens past the document are drafted too (their
K/V over a compressed prefix is inexact), and the first verification recomputes them exactly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from remote_store.fullkv import FullKVStore
from vericache_sglang.core.compress import Compressor
from vericache_sglang.core.kv import CompressedKV
from vericache_sglang.engine.decode import prefill
from vericache_sglang.engine.runner import ModelRunner


@dataclass
class RegisteredPrefix:
    tokens: list[int]  # whole store chunks
    ckv: CompressedKV  # compressed once, copied into each request that uses it
    full_kv_bytes: int
    seconds: float  # prefill, store and compress, once

    @property
    def compressed_kv_bytes(self) -> int:
        return self.ckv.nbytes


class PrefixRegistry:
    def __init__(self, runner: ModelRunner, store: FullKVStore, compressor: Compressor):
        self.runner = runner
        self.store = store
        self.compressor = compressor
        self.prefixes: list[RegisteredPrefix] = []

    def register(self, tokens: list[int]) -> RegisteredPrefix:
        """Prefill ``tokens`` (cut to whole chunks), store their full KV as shared chunks, compress them."""
        n = len(tokens) - len(tokens) % self.store.chunk_tokens
        if n == 0:
            raise ValueError(f"a prefix needs at least one whole chunk of {self.store.chunk_tokens} tokens")
        t = time.monotonic()
        pre = prefill(self.runner, tokens[:n])
        writer = self.store.open_request(tokens[:n])
        writer.write(0, pre.kv.layers)
        writer.release()  # the chunks are shared: they stay
        prefix = RegisteredPrefix(list(tokens[:n]), self.compressor.compress(pre.kv, pre.obs), pre.kv.nbytes,
                                  time.monotonic() - t)
        self.prefixes.append(prefix)
        return prefix

    def match(self, tokens: list[int]) -> RegisteredPrefix | None:
        """The longest registered prefix of ``tokens`` that leaves at least one token after it."""
        best = None
        for p in self.prefixes:
            n = len(p.tokens)
            if n < len(tokens) and tokens[:n] == p.tokens and (best is None or n > len(best.tokens)):
                best = p
        return best
