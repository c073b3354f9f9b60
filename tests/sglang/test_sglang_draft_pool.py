"""The worker's CPU-runnable parts on SGLang's own pool objects, with SmolLM2's real KV: the private
compressed draft pool (admit, commit through the compressor's update and refresh, release; for a
quantizer the dequantizing pool, one layer at a time) and the packing of the core's verdicts into
the tensors SGLang's scheduler reads."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.memory_pool", reason="sglang is not installed")

from vericache_sglang.core.accept import greedy_accept
from vericache_sglang.core.compress import parse_spec
from vericache_sglang.sglang.draft.pool import CompressedDraftPool, DraftPoolFull
from vericache_sglang.sglang.pool_kv import PoolParts, read_full_kv, write_full_kv
from vericache_sglang.sglang.step.acceptance import pack

pytestmark = pytest.mark.real_model
HORIZON = 8


@pytest.fixture(scope="module")
def prefills(real_engine):
    from conftest import PROMPTS

    tokens = real_engine.encode((PROMPTS / "tools.txt").read_text()[:2000], chat=False)
    more = tokens + real_engine.encode(" and then four more", chat=False)[:4]
    return tokens, real_engine.prefill(tokens, reuse_prefix=False), real_engine.prefill(more, reuse_prefix=False)


def _pool(layout, spec: str, capacity: int = 8192) -> CompressedDraftPool:
    return CompressedDraftPool(
        layout=layout,
        capacity_tokens=capacity,
        max_requests=4,
        max_context_len=4096,
        horizon=HORIZON,
        compressor=parse_spec(spec),
        device="cpu",
        inner_backend="torch_native",
    )


def _row_kv(pool: CompressedDraftPool, rid: str):
    row = pool.row_index(rid)
    kept = pool.kept_len(rid)
    slots = pool.req_to_token_pool.req_to_token[row, :kept].to(torch.int64)
    return read_full_kv(pool.token_to_kv_pool, slots, pool.layout)


QUANTIZED = [
    "kivi:bits=4,group=64,key_group=16,residual=64",
    "snapkv:ratio=0.4+kivi:bits=2,group=32,residual=32",
    "int8",
]


@pytest.mark.parametrize("spec", ["snapkv:ratio=0.125", "streamingllm:sink=4,window=256", *QUANTIZED])
def test_admit_commit_release_on_sglang_pools(real_engine, prefills, spec):
    tokens, pre, pre_more = prefills
    layout = real_engine.runner.layout
    pool = _pool(layout, spec)
    comp = parse_spec(spec)
    free_tokens, free_rows = pool.allocator.available_size(), pool.req_to_token_pool.available_size()

    ckv = comp.compress(pre.kv, pre.obs)
    reference = copy.deepcopy(ckv)
    pool.admit("r1", ckv, len(tokens))
    kept = pool.kept_len("r1")
    assert kept == reference.layers[0].num_tokens <= len(tokens)
    assert pool.scratch_slots("r1").numel() == HORIZON
    assert pool.quantized == (spec in QUANTIZED)
    # the row a draft pass attends over holds exactly the compressor's kept K/V, layer by layer
    row = _row_kv(pool, "r1")
    for (k, v), layer in zip(row.layers, reference.layers, strict=True):
        rk, rv = layer.read()
        assert torch.equal(k, rk) and torch.equal(v, rv)

    # commit four tokens' exact K/V (from a prefill that reached them): the row becomes what the
    # compressor's own update makes of the reference
    n = len(pre_more.tokens) - len(tokens)
    new = pre_more.kv.slice(len(tokens), len(pre_more.tokens))
    positions = torch.arange(len(tokens), len(tokens) + n)
    pool.commit("r1", new, positions)
    for layer, (k, v) in enumerate(new.layers):
        comp.update(reference, layer, k, v, positions)
    row = _row_kv(pool, "r1")
    for (k, v), layer in zip(row.layers, reference.layers, strict=True):
        rk, rv = layer.read()
        assert torch.equal(k, rk) and torch.equal(v, rv)
    assert pool.next_position("r1") == len(tokens) + n
    with pytest.raises(ValueError, match="the row expects"):
        pool.commit("r1", new, positions)  # the same positions twice

    pool.release("r1")
    assert pool.allocator.available_size() == free_tokens
    assert pool.req_to_token_pool.available_size() == free_rows


def test_a_quantizers_pool_holds_one_layer_and_keeps_drafted_kv_in_the_rows_lane(real_engine, prefills):
    """Codes stay in the compressed KV; the pool dequantizes the layer asked for into one workspace
    shared by every layer, and a draft pass's K/V goes into the row's scratch lane, per layer."""
    tokens, pre, _ = prefills
    layout = real_engine.runner.layout
    pool = _pool(layout, QUANTIZED[1])
    kv_pool = pool.token_to_kv_pool
    ckv = parse_spec(QUANTIZED[1]).compress(pre.kv, pre.obs)
    pool.admit("r1", ckv, len(tokens))
    assert kv_pool.k_buffer[0] is kv_pool.k_buffer[layout.num_layers - 1]  # one layer's workspace
    plain = layout.num_layers * (kv_pool.size + 1) * 2 * layout.num_kv_heads * layout.head_dim * 4
    assert kv_pool.nbytes() <= plain / layout.num_layers  # one layer of a full-precision pool of the same slots
    assert ckv.nbytes < pre.kv.nbytes / 8  # the codes: 2-bit of 0.4 of the tokens, with scales

    class Layer:
        def __init__(self, layer_id: int):
            self.layer_id = layer_id

    lane = pool.scratch_slots("r1")
    g = torch.Generator().manual_seed(0)
    drafted = [torch.randn(2, layout.num_kv_heads, layout.head_dim, generator=g) for _ in range(layout.num_layers)]
    for layer in range(layout.num_layers):
        kv_pool.set_kv_buffer(Layer(layer), lane[:2], drafted[layer], -drafted[layer])
    assert kv_pool.nbytes() > plain / layout.num_layers  # the row's scratch lane, every layer, in full precision
    for layer in (3, 0, layout.num_layers - 1):  # any order: each read refills the workspace with its layer
        k_ws, v_ws = kv_pool.get_key_buffer(layer), kv_pool.get_value_buffer(layer)
        assert torch.equal(k_ws[lane[:2]], drafted[layer]) and torch.equal(v_ws[lane[:2]], -drafted[layer])
        rk, _ = ckv.layers[layer].read()
        assert torch.equal(k_ws[pool.req_to_token_pool.req_to_token[pool.row_index("r1"), 0].long()], rk[:, 0])
    with pytest.raises(ValueError, match="scratch slots only"):
        kv_pool.set_kv_buffer(
            Layer(0),
            pool.req_to_token_pool.req_to_token[pool.row_index("r1"), :1].long(),
            drafted[0][:1],
            drafted[0][:1],
        )


def test_commit_with_refresh_rechooses_the_rows_the_core_would(real_engine, prefills):
    """``+refresh`` in the worker: the full KV read per layer out of an SGLang pool (``PoolParts``)
    and the committed tokens' queries give the row exactly what the core's commit-then-refresh
    gives on the same tensors, at the same token count."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    spec = "snapkv:ratio=0.03125+refresh:ratio=0.09375,span=16"
    tokens, pre, pre_more = prefills
    layout = real_engine.runner.layout
    pool, comp = _pool(layout, spec), parse_spec(spec)
    ckv = comp.compress(pre.kv, pre.obs)
    reference = copy.deepcopy(ckv)
    before = [layer.positions.clone() for layer in reference.layers]  # the prompt's refreshed rows
    pool.admit("r1", ckv, len(tokens))
    kept = pool.kept_len("r1")

    total = len(pre_more.tokens)
    target = MHATokenToKVPool(
        size=total + 8,
        page_size=1,
        dtype=layout.dtype,
        head_num=layout.num_kv_heads,
        head_dim=layout.head_dim,
        layer_num=layout.num_layers,
        device="cpu",
        enable_memory_saver=False,
    )
    slots = torch.randperm(total + 8)[:total] + 1  # a request's slots are anywhere in the pool
    write_full_kv(target, slots, pre_more.kv)
    n = total - len(tokens)
    new = pre_more.kv.slice(len(tokens), total)
    positions = torch.arange(len(tokens), total)
    queries = [pre_more.obs.window_queries(layer, n) for layer in range(layout.num_layers)]
    pool.commit("r1", new, positions, (PoolParts(target, slots, layout.num_layers), queries))

    comp.commit(reference, new.layers, positions, queries)
    comp.refresh(reference, [[kv] for kv in pre_more.kv.layers], queries)
    assert pool.kept_len("r1") == kept + n == reference.layers[0].num_tokens
    row = _row_kv(pool, "r1")
    for (k, v), layer in zip(row.layers, reference.layers, strict=True):
        rk, rv = layer.read()
        assert torch.equal(k, rk) and torch.equal(v, rv)
    moved = sum(not torch.equal(a, layer.positions) for a, layer in zip(before, reference.layers, strict=True))
    assert moved  # the refresh chose other rows than the prompt's: the comparison is not vacuous
    pool.release("r1")


def test_a_full_pool_refuses_cleanly_and_keeps_no_half_row(real_engine, prefills):
    tokens, pre, _ = prefills
    layout = real_engine.runner.layout
    pool = _pool(layout, "streamingllm:sink=4,window=256", capacity=300)  # room for one row
    comp = parse_spec("streamingllm:sink=4,window=256")
    pool.admit("a", comp.compress(pre.kv), len(tokens))
    rows = pool.req_to_token_pool.available_size()
    with pytest.raises(DraftPoolFull):
        pool.admit("b", comp.compress(pre.kv), len(tokens))
    assert pool.req_to_token_pool.available_size() == rows and "b" not in pool.rows


def test_packed_verdicts_are_the_core_decisions():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 7], [1, 2, 3]])
    target = torch.tensor([[5, 6, 7, 8], [5, 9, 7, 8], [4, 2, 3, 0]])
    verdicts = [greedy_accept(d, t) for d, t in zip(drafts.tolist(), target.tolist(), strict=True)]
    packed = pack(verdicts, 4, torch.tensor([100, 200, 300]))
    assert packed.accept_lens.tolist() == [4, 2, 1]
    assert packed.output_ids.tolist() == [[5, 6, 7, 8], [5, 9, 0, 0], [4, 0, 0, 0]]
    assert packed.new_seq_lens.tolist() == [104, 202, 301]
    assert packed.next_seeds.tolist() == [8, 9, 4]


@pytest.mark.parametrize("spec", ["pyramidkv:ratio=0.25", "pyramidkv:ratio=0.25+kivi:bits=4,group=64,residual=64"])
def test_a_per_layer_budget_gives_each_layer_its_own_part_of_the_row(real_engine, prefills, spec):
    """A row holds the largest layer's count of kept slots; layer ``l`` reads its own first
    ``n_l`` of them, then the scratch (what ``draft/layer_rows.py`` hands the backend)."""
    tokens, pre, _ = prefills
    pool = _pool(real_engine.runner.layout, spec)
    ckv = parse_spec(spec).compress(pre.kv, pre.obs)
    counts = ckv.tokens_per_layer()
    assert len(set(counts)) > 1  # a pyramid
    reference = copy.deepcopy(ckv)
    pool.admit("r1", ckv, len(tokens))
    index, kept = pool.row_index("r1"), pool.kept_len("r1")
    assert kept == max(counts)
    assert pool.shortfalls([index], 0) == [kept - counts[0]]
    scratch = pool.scratch_slots("r1")
    for layer, (n, ref) in enumerate(zip(counts, reference.layers, strict=True)):
        slots = pool.layer_slots(index, layer)
        assert slots.numel() == n + HORIZON and torch.equal(slots[n:], scratch)
        rk, rv = ref.read()
        idx = slots[:n].to(torch.int64)
        k = pool.token_to_kv_pool.get_key_buffer(layer)[idx].transpose(0, 1)
        v = pool.token_to_kv_pool.get_value_buffer(layer)[idx].transpose(0, 1)
        assert torch.equal(k, rk.to(k.dtype)) and torch.equal(v, rv.to(v.dtype))
    pool.release("r1")
