"""The compressor family on real KV from the tiny Llama (its prefill gives the observation, the
rotary embedding and probe forwards): what each method keeps, its byte sizes, and its errors."""

import json
import math
import subprocess
import sys

import pytest
import torch

from vericache_sglang.core.compress import COMPRESSORS, SpecError, describe_compressors, parse_spec
from vericache_sglang.core.compress.base import DroppedLayer
from vericache_sglang.core.compress.compose import ComposedLayer
from vericache_sglang.core.compress.drop.adakv import AdaKVLayer
from vericache_sglang.core.compress.drop.expected_attention import averaged_rotation
from vericache_sglang.core.compress.drop.h2o import ScoredLayer
from vericache_sglang.core.compress.drop.pyramidkv import pyramid_budgets
from vericache_sglang.core.compress.drop.quest import QuestLayer
from vericache_sglang.core.compress.quant.kvquant import KVQuantLayer
from vericache_sglang.core.compress.quant.tokenquant import hadamard
from vericache_sglang.engine.prefill import prefill

N = 300
FAMILY = [
    "streamingllm",
    "h2o",
    "snapkv:window=16",
    "pyramidkv:window=16",
    "adakv:window=16",
    "expected_attention",
    "tova",
    "knorm",
    "quest:page=8",
    "kivi:group=16,residual=32",
    "int8:group=16",
    "int4:group=16",
    "kvquant",
    "rotatekv:group=16",
    "snapkv:window=16+kivi:bits=4,group=16,residual=32",
]


@pytest.fixture(scope="module")
def pre(tiny_runner):
    prompt = torch.randint(0, 512, (N,), generator=torch.Generator().manual_seed(11)).tolist()
    return prefill(tiny_runner, prompt, chunk=128)


def layer0(pre, spec):
    return parse_spec(spec).compress(pre.kv, pre.obs).layers[0]


def test_every_name_is_registered_and_listed():
    names = {
        "streamingllm",
        "h2o",
        "snapkv",
        "pyramidkv",
        "adakv",
        "expected_attention",
        "tova",
        "knorm",
        "kvzip",
        "quest",
        "kivi",
        "int8",
        "int4",
        "kvquant",
        "rotatekv",
    }
    assert set(COMPRESSORS) == names
    for name in names:
        assert parse_spec(name).name == name  # every bare name has defaults
    listed = {c["name"]: c for c in describe_compressors()}
    assert set(listed) == names and listed["kvzip"]["mode"] == "offline" and listed["h2o"]["needs"]


def test_cli_lists_compressors_as_json():
    done = subprocess.run(
        [sys.executable, "-m", "vericache_sglang.cli", "compressors", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    table = {c["name"]: c for c in json.loads(done.stdout)}
    assert table["kvquant"]["parameters"]["bits"] == {"type": "int", "default": 4}
    assert table["quest"]["kind"] == "sparse"


@pytest.mark.parametrize(
    "spec,message",
    [
        ("h2o:ratio=0", "ratio must be in (0, 1]"),
        ("tova:ratio=1.01", "ratio must be in (0, 1]"),
        ("pyramidkv:beta=0", "beta must be >= 1"),
        ("adakv:alpha=2", "alpha must be in [0, 1]"),
        ("kvquant:bits=3", "bits must be 2, 4 or 8"),
        ("rotatekv:bits=8", "bits must be 2 or 4"),
        ("kvquant:outliers=0.6", "outliers must be in [0, 0.5)"),
        ("quest:page=0", "page must be >= 1"),
        ("kivi:bits=4+snapkv", "the first part must be a token dropper"),
        ("snapkv+h2o", "the second part must be a quantizer"),
        ("h2o+kivi", "evicts tokens while decoding"),
        ("quest+int8", "the first part must be a token dropper"),
        ("snapkv+kivi+int8", "exactly two parts"),
        ("snapkv+", "empty part"),
    ],
)
def test_bad_specs(spec, message):
    with pytest.raises(SpecError, match=None) as e:
        parse_spec(spec)
    assert message in str(e.value)


@pytest.mark.parametrize("spec", FAMILY)
def test_same_count_per_head_and_real_bytes(pre, spec):
    ckv = parse_spec(spec).compress(pre.kv, pre.obs)
    for layer in ckv.layers:
        k, v = layer.read()
        assert k.shape == v.shape and k.shape[1] == layer.num_tokens and k.dtype == pre.kv.layout.dtype
        exact = layer.exact_kv()
        if exact is not None:  # what a layer calls exact is bit-equal to the full KV at those positions
            pos, ek, _ = exact
            full_k = pre.kv.layers[ckv.layers.index(layer)][0]
            assert torch.equal(ek, full_k.gather(1, pos.long().unsqueeze(-1).expand(-1, -1, ek.shape[-1])))
    assert 0 < ckv.nbytes


def test_droppers_keep_their_budget(pre):
    for spec in ("h2o", "tova", "knorm", "expected_attention", "snapkv:window=16"):
        layer = layer0(pre, spec)
        assert layer.num_tokens == math.ceil(0.25 * N), spec
        assert torch.all(layer.positions[:, 1:] > layer.positions[:, :-1]), spec  # sorted, distinct


def test_h2o_chunked_update_equals_one_by_one(tiny_runner, pre):
    c = parse_spec("h2o:ratio=0.1")
    a, b = c.compress(pre.kv, pre.obs), c.compress(pre.kv, pre.obs)
    g = torch.Generator().manual_seed(2)
    k, v = (torch.randn(2, 9, 16, generator=g) for _ in range(2))
    q = torch.randn(4, 9, 16, generator=g)
    pos = torch.arange(N, N + 9)
    c.update(a, 0, k, v, pos, q)
    for j in range(9):
        c.update(b, 0, k[:, j : j + 1], v[:, j : j + 1], pos[j : j + 1], q[:, j : j + 1])
    la, lb = a.layers[0], b.layers[0]
    assert isinstance(la, ScoredLayer) and la.num_tokens == la.capacity == math.ceil(0.1 * N)
    assert torch.equal(la.positions, lb.positions) and torch.allclose(la.scores, lb.scores)
    recent = int(0.5 * la.capacity)
    assert la.positions[:, -recent:].tolist() == [list(range(N + 9 - recent, N + 9))] * 2


def test_online_compressors_refuse_updates_without_queries(pre):
    c = parse_spec("tova")
    ckv = c.compress(pre.kv, pre.obs)
    with pytest.raises(ValueError, match="needs their queries"):
        c.commit(ckv, [(k[:, :1], v[:, :1]) for k, v in pre.kv.layers], torch.tensor([N]))


def test_tova_keeps_the_same_tokens_in_every_head(pre):
    layer = layer0(pre, "tova")
    assert torch.equal(layer.positions[0], layer.positions[1]) and layer.positions[0, -1] == N - 1


def test_pyramid_budgets_decrease_and_keep_the_total():
    budgets = pyramid_budgets(4000, 0.25, 64, 20, 30)
    assert budgets == sorted(budgets, reverse=True) and budgets[0] > budgets[-1]
    assert abs(sum(budgets) - 30 * 1000) < 30  # the same total as SnapKV at that ratio
    small = pyramid_budgets(2000, 0.25, 64, 20, 30)  # kvpress would fall back to uniform here
    assert small[0] > small[-1] == 64  # the top layers are clamped at the window
    assert pyramid_budgets(10, 0.5, 64, 20, 30) == [5] * 30  # too short for a pyramid: SnapKV's


def test_adakv_keeps_a_superset_of_its_allotment(pre):
    layer = layer0(pre, "adakv:window=16,ratio=0.2")
    assert isinstance(layer, AdaKVLayer)
    per_head = math.ceil(0.2 * N)
    assert sum(layer.allotted) == 2 * per_head and layer.num_tokens == max(layer.allotted)
    assert min(layer.allotted) >= int(per_head * 0.2)


def test_expected_attention_rotation_and_sinks(pre, tiny_runner):
    rope = pre.obs.source.rope()
    r = averaged_rotation(rope, 7, 1, 16)  # one position: exactly RoPE's rotation there
    x = torch.randn(3, 1, 16)
    assert torch.allclose(x @ r.T, rope.rotate(x, torch.tensor([7])), atol=1e-6)
    layer = layer0(pre, "expected_attention")
    assert layer.positions[:, :4].tolist() == [[0, 1, 2, 3]] * 2


def test_quest_reads_the_best_pages_and_holds_everything(pre):
    layer = layer0(pre, "quest:page=8,ratio=0.25")
    assert isinstance(layer, QuestLayer) and layer.num_tokens == N
    assert layer.nbytes > sum(k.nbytes + v.nbytes for k, v in [pre.kv.layers[0]])  # no memory saved
    q = torch.randn(4, 1, 16)
    k, _ = layer.read_for(q)
    newest = (N - 1) // 8 * 8
    want = math.ceil(0.25 * (newest // 8 + 1)) - 1
    assert k.shape[1] == want * 8 + (N - newest)
    chosen = layer.selected_pages(q, newest // 8, want)
    bound = (
        q.view(2, 2, 16).clamp(min=0) @ layer.kmax[:, : newest // 8].transpose(1, 2)
        + q.view(2, 2, 16).clamp(max=0) @ layer.kmin[:, : newest // 8].transpose(1, 2)
    ).amax(dim=1)
    assert torch.equal(chosen, bound.topk(want).indices.sort().values)
    assert torch.equal(layer.read_for(None)[0], pre.kv.layers[0][0])


def test_kvquant_restores_outliers_exactly(pre):
    layer = layer0(pre, "kvquant:bits=2,outliers=0.05")
    assert isinstance(layer, KVQuantLayer)
    block = layer.keys[0]
    assert block.index.numel() > 0
    rope = pre.obs.source.rope()
    pre_rope = rope.unrotate(pre.kv.layers[0][0].float(), layer.positions)
    decoded = block.decode(2, torch.float32)
    assert torch.equal(decoded.flatten()[block.index.long()], pre_rope.flatten()[block.index.long()])
    k, _ = layer.read()
    err = (k - pre.kv.layers[0][0]).abs().max()
    assert err < (pre.kv.layers[0][0].abs().max()) / 2  # 2-bit with 5% outliers kept


def test_rotation_is_orthogonal_and_quantizers_are_close(pre):
    h = hadamard(16)
    assert torch.allclose(h @ h.T, torch.eye(16), atol=1e-6)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(24)
    k0 = pre.kv.layers[0][0]
    errs = {
        spec: (layer0(pre, spec).read()[0] - k0).abs().mean().item()
        for spec in ("int8:group=16", "int4:group=16", "rotatekv:group=16,bits=4")
    }
    assert errs["int8:group=16"] < errs["int4:group=16"]
    scale = k0.abs().mean().item()
    assert errs["int8:group=16"] < 0.01 * scale and errs["rotatekv:group=16,bits=4"] < 0.2 * scale


def test_int4_bytes_are_packed(pre):
    layer = layer0(pre, "int4:group=16")
    codes = 2 * 2 * N * 16 // 2  # keys and values, 2 heads, 4 bits
    scales = 2 * 2 * N * (16 // 16) * 2 * 2  # float16 scale and min per group
    assert layer.nbytes == codes + scales


def test_composition_maps_exact_rows_to_positions(pre):
    c = parse_spec("snapkv:window=16,ratio=0.5+kivi:bits=4,group=16,residual=32")
    ckv = c.compress(pre.kv, pre.obs)
    layer = ckv.layers[0]
    assert isinstance(layer, ComposedLayer) and layer.num_tokens == math.ceil(0.5 * N)
    drop = parse_spec("snapkv:window=16,ratio=0.5").compress(pre.kv, pre.obs).layers[0]
    assert isinstance(drop, DroppedLayer) and torch.equal(layer.positions, drop.positions)
    pos, k, _ = layer.exact_kv()  # the kivi residual, at the dropper's positions
    assert torch.equal(pos, drop.positions[:, -pos.shape[1] :])
    assert torch.equal(k, drop.keys[:, -pos.shape[1] :])
    assert c.spec == "snapkv:ratio=0.5,window=16,kernel=7,pool=max+kivi:bits=4,group=16,residual=32"
    assert parse_spec(c.spec).spec == c.spec


def test_kvzip_needs_a_tokenizer_and_a_model(pre):
    with pytest.raises(ValueError, match="has no tokenizer"):
        parse_spec("kvzip").compress(pre.kv, pre.obs)
    from vericache_sglang.core.compress.observation import Observation

    with pytest.raises(ValueError, match="needs the model"):
        parse_spec("kvzip").compress(pre.kv, Observation(pre.obs.queries))


def test_a_short_observed_tail_is_recomputed(tiny_runner, pre):
    """A prefill that reused a stored prefix observed only its last few tokens: a windowed scorer
    gets its window from the model, the same queries the full prefill kept."""
    short = prefill(tiny_runner, pre.tokens, chunk=128, prefix=pre.kv.slice(0, N - 5))
    assert short.obs.queries[0].shape[1] == 5
    a = parse_spec("snapkv:window=16").compress(short.kv, short.obs).layers[0]
    b = parse_spec("snapkv:window=16").compress(pre.kv, pre.obs).layers[0]
    assert torch.equal(a.positions, b.positions)
