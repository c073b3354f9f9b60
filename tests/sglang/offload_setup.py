"""SGLang's own objects for the offload tests (CPU): a pool, its allocator and row table, the
vericache radix cache over them, requests with known KV, and stand-ins for the verify pass (the
model cannot run here: a reader of what attention would read, the request's ``req_to_token`` row
through the pool's waiting accessors). ``full_kv: "host"`` is ``test_sglang_offload.py``, ``"store"``
``test_sglang_store_tier.py``."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.l2_transfer", reason="sglang is not installed")

from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixKey
from sglang.srt.plugins import load_plugins
from sglang.srt.sampling.sampling_params import SamplingParams

from vericache_sglang.sglang.config import VeriCacheConfig
from vericache_sglang.sglang.draft.radix_cache import VeriCacheRadixCache
from vericache_sglang.sglang.full_kv.offload import FullKVOffload

LAYERS, HEADS, DIM, SIZE = 3, 2, 8, 512


@pytest.fixture(scope="module", autouse=True)
def published_server_args():
    """SGLang's row release reads the server's published config (as in a scheduler process)."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import prepare_server_args

    from vericache_sglang.engine.model import smollm2_dir

    if not (smollm2_dir() / "config.json").exists():
        pytest.skip("SmolLM2 is not prepared (scripts/setup.sh); the server args need a model path")
    load_plugins()
    sa = prepare_server_args(
        [
            "--model-path",
            str(smollm2_dir()),
            "--device",
            "cpu",
            "--enable-vericache",
            "--vericache-config",
            '{"full_kv": "host"}',
        ]
    )
    sa.resolve_once()
    get_context().set_server_args(sa)


class Setup:
    """SGLang's pool, allocator, request rows and the vericache radix cache over them."""

    def __init__(self):
        self.pool = MHATokenToKVPool(
            size=SIZE,
            page_size=1,
            dtype=torch.float32,
            head_num=HEADS,
            head_dim=DIM,
            layer_num=LAYERS,
            device="cpu",
            enable_memory_saver=False,
        )
        self.alloc = TokenToKVPoolAllocator(
            size=SIZE, dtype=torch.float32, device="cpu", kvcache=self.pool, need_sort=False
        )
        self.rows = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
        self.cache = VeriCacheRadixCache(
            CacheInitParams(
                disable=False, req_to_token_pool=self.rows, token_to_kv_pool_allocator=self.alloc, page_size=1
            )
        )
        self.gen = torch.Generator().manual_seed(0)
        self.kv: dict[str, list[torch.Tensor]] = {}  # rid -> per layer [tokens, 2, heads, dim] written

    def request(self, rid: str, prompt: list[int], prefix: int = 0) -> Req:
        """A prefilled request: ``prefix`` tokens matched in the tree (and locked), the rest its own."""
        req = Req(rid, "", array("l", prompt), SamplingParams(max_new_tokens=64))
        self.rows.alloc([req])
        if prefix:
            match = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(prompt[:prefix])))
            assert match.device_prefix_len == prefix
            indices = self.cache.path_device_indices(match.last_device_node)
            self.rows.write((req.kv.req_pool_idx, slice(0, prefix)), indices.to(torch.int32))
            req.lock, req.last_node = self.cache.lock(match.last_device_node), match.last_device_node
            req.kv.cache_protected_len = prefix
            self.kv[rid] = [t[:prefix].clone() for t in self.kv["_prefix"]]  # set by the test
        self.extend(req, len(prompt) - prefix)
        return req

    def over_cached_prefix(self, prompt: list[int], prefix: int) -> tuple[Req, Req]:
        """Request "first" over ``prompt[:prefix]``, inserted into the tree (which then owns those
        slots), and request "b" over all of ``prompt``, matching that prefix in the tree."""
        first = self.request("first", prompt[:prefix])
        slots = self.rows.req_to_token[first.kv.req_pool_idx, :prefix].to(torch.int64)
        self.cache.insert(InsertParams(key=RadixKey(prompt[:prefix]), value=slots))
        self.kv["_prefix"] = [t.clone() for t in self.kv["first"]]
        return first, self.request("b", prompt, prefix=prefix)

    def extend(self, req: Req, n: int) -> torch.Tensor:
        """``n`` new tokens with KV (a prefill or a verify pass writing them); commits them."""
        start = req.kv.kv_committed_len if req.kv.kv_committed_len else req.kv.cache_protected_len
        slots = self.alloc.alloc(n)
        self.rows.write((req.kv.req_pool_idx, slice(start, start + n)), slots.to(torch.int32))
        old = self.kv.get(req.rid, [torch.empty(0, 2, HEADS, DIM)] * LAYERS)
        new = []
        for layer in range(LAYERS):
            kv = torch.randn(n, 2, HEADS, DIM, generator=self.gen)
            self.pool.k_buffer[layer][slots], self.pool.v_buffer[layer][slots] = kv[:, 0], kv[:, 1]
            new.append(torch.cat([old[layer], kv]))
        self.kv[req.rid] = new
        req.kv.kv_committed_len = req.kv.kv_allocated_len = start + n
        return slots

    def seen(self, req: Req) -> list[torch.Tensor]:
        """What a verify pass reads for ``req``: its row, through the pool's waiting accessors."""
        row = self.rows.req_to_token[req.kv.req_pool_idx, : req.kv.kv_committed_len].to(torch.int64)
        return [
            torch.stack([self.pool.get_key_buffer(layer)[row], self.pool.get_value_buffer(layer)[row]], 1)
            for layer in range(LAYERS)
        ]

    def same(self, req: Req) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.seen(req), self.kv[req.rid], strict=True))


def host_offload(setup: Setup, **cfg) -> tuple[FullKVOffload, list[str]]:
    released: list[str] = []
    runner = SimpleNamespace(
        token_to_kv_pool=setup.pool, req_to_token_pool=setup.rows, token_to_kv_pool_allocator=setup.alloc
    )  # a holder of SGLang's real pools
    host = FullKVOffload(VeriCacheConfig(full_kv="host", horizon=4, **cfg), runner, setup.alloc, released.append)
    return host, released


def verify_reading(s: Setup, req: Req, seen: list[bool]):
    """A stand-in for the verify pass (the model cannot run here): records whether the pass would
    read exactly ``req``'s full KV, and returns logits of the right shape."""

    def verify(rows: torch.Tensor) -> torch.Tensor:
        seen.append(s.same(req))
        return torch.zeros(len(rows) * 5, 3)

    return verify


def grouped_reading(s: Setup, reqs: list[Req], groups: list[list[int]]):
    """The verify-pass stand-in for a batch: records each group, checks every request in it reads
    its exact full KV, and returns logits whose every row is the request's batch index."""

    def verify(rows: torch.Tensor) -> torch.Tensor:
        groups.append(rows.tolist())
        assert all(s.same(reqs[i]) for i in rows.tolist())
        return rows.repeat_interleave(5).float()[:, None].repeat(1, 2)

    return verify


def plan_and_draft(host: FullKVOffload, reqs: list[Req]) -> None:
    """One step's plan and its ``horizon`` draft passes (each an iteration of the plan)."""
    host.plan(reqs)
    for _ in range(host.horizon):
        host.draft_pass(lambda: torch.zeros(1))


def verified_exactly(host: FullKVOffload, s: Setup, req: Req) -> bool:
    """The step's verification of ``req`` alone: whether its one pass read exactly its full KV."""
    seen: list[bool] = []
    host.verify([req], verify_reading(s, req, seen), width=5)
    return seen == [True]


def finish(req: Req) -> None:
    req.finished_reason = FINISH_LENGTH(len(req.output_ids))
    req.finished_len = len(req.output_ids)


def store_offload(setup: Setup, backend=None, **cfg) -> tuple[FullKVOffload, list[BaseException]]:
    from remote_store import open_store
    from vericache_sglang.full_kv.store import FullKVStore
    from vericache_sglang.sglang.full_kv.store_tier import StoreFullKV
    from vericache_sglang.sglang.pool_kv import pool_layout

    runner = SimpleNamespace(
        token_to_kv_pool=setup.pool, req_to_token_pool=setup.rows, token_to_kv_pool_allocator=setup.alloc
    )
    store = FullKVStore(backend or open_store("memory://"), pool_layout(setup.pool, "test"), chunk_tokens=16)
    errors: list[BaseException] = []
    offload = FullKVOffload(
        VeriCacheConfig(full_kv="store", horizon=4, **cfg),
        runner,
        setup.alloc,
        lambda rid: None,
        tier=StoreFullKV(setup.pool, store),
        on_error=errors.append,
    )
    return offload, errors


def recompute_from(s: Setup, req: Req, calls: list[tuple[int, int, int]]):
    """A stand-in for the worker's recompute pass (the model cannot run here): writes the request's
    exact KV of positions from ``start`` into the lent slots, as the pass over its tokens would."""

    def recompute(i: int, start: int, slots: torch.Tensor) -> None:
        calls.append((i, start, int(slots.numel())))
        for layer in range(LAYERS):
            kv = s.kv[req.rid][layer][start : start + slots.numel()]
            s.pool.k_buffer[layer][slots], s.pool.v_buffer[layer][slots] = kv[:, 0], kv[:, 1]

    return recompute
