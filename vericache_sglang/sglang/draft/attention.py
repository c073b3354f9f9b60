"""The ``vericache`` attention backend: the target model's own attention kernels, reading the
compressed KV pool instead of the full one.

A token-dropping compressor's output is, for SGLang's kernels, just a shorter KV row: the kept
tokens' K (RoPE already applied at their true positions) and V copied into a private
``MHATokenToKVPool``, indexed by a private ``ReqToTokenPool`` row per request. New draft queries
carry their true positions, so any stock backend (triton, flashinfer, fa3, torch_native) computes
exactly the attention a compressed-KV decoder computes. This module builds such a backend over the
private pools (UNO's private-backend pattern); the worker selects it per pass through
``ForwardContext``. On CPU the wrapped backend is torch_native (tested in real servers); on a GPU
flashinfer, triton or fa3 (unverified).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.model_runner import ModelRunner

# The stock backend the private one wraps when the operator picked none for drafting.
DEFAULT_INNER = "triton"


@dataclass
class DraftPools:
    """The worker's private compressed-KV pools, published on the target ModelRunner."""

    req_to_token_pool: ReqToTokenPool  # one compressed row per running request
    token_to_kv_pool: MHATokenToKVPool  # holding only kept tokens
    allocator: TokenToKVPoolAllocator  # over token_to_kv_pool
    inner_backend: str = DEFAULT_INNER
    kv_index_translator: KVIndexTranslator | None = None  # built on first bind, over these pools


RUNNER_ATTR = "vericache_draft_pools"


def _translator(runner: ModelRunner, pools: DraftPools) -> KVIndexTranslator:
    # the backends that gather read indices (triton, flashinfer) take them from the runner's
    # translator, which holds the target pool's req_to_token: a private one reads the private rows
    if pools.kv_index_translator is None:
        from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator

        pools.kv_index_translator = KVIndexTranslator(
            req_to_token=pools.req_to_token_pool.req_to_token,
            token_to_kv_pool_allocator=pools.allocator,
            token_to_kv_pool=pools.token_to_kv_pool,
            page_size=1,
            device=runner.device,
        )
    return pools.kv_index_translator


@contextlib.contextmanager
def pools_bound(runner: ModelRunner, pools: DraftPools) -> Iterator[None]:
    """Make ``runner`` look like it owns ``pools`` (backends cache them, and the KV index
    translator over them, at construction)."""
    names = ("req_to_token_pool", "token_to_kv_pool", "kv_index_translator")
    saved = [getattr(runner, name) for name in names]
    private = (pools.req_to_token_pool, pools.token_to_kv_pool, _translator(runner, pools))
    for name, value in zip(names, private, strict=True):
        setattr(runner, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved, strict=True):
            setattr(runner, name, value)


def create_draft_backend(runner: ModelRunner) -> AttentionBackend:
    """Factory registered as ``vericache`` in SGLang's ATTENTION_BACKENDS."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    pools: DraftPools | None = getattr(runner, RUNNER_ATTR, None)
    if pools is None:
        raise ValueError(
            "the vericache attention backend reads VeriCache's private compressed pool; it is selected by "
            "--enable-vericache for drafting, not as the server's --attention-backend"
        )
    if pools.inner_backend not in ATTENTION_BACKENDS or pools.inner_backend == "vericache":
        raise ValueError(f"vericache draft backend cannot wrap {pools.inner_backend!r}")
    with pools_bound(runner, pools):
        return ATTENTION_BACKENDS[pools.inner_backend](runner)
