import math

import pytest
import torch

from vericache_sglang.core.compress import COMPRESSORS, SpecError, parse_spec
from vericache_sglang.core.compress.drop.snapkv import snapkv_scores
from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.compress.quant.kivi import KIVILayer
from vericache_sglang.core.compress.quant.quant import (
    dequantize,
    dequantize_packed,
    dequantize_packed_into,
    pack,
    quantize,
    unpack,
)
from vericache_sglang.core.kv import FullKV, KVLayout

LAYOUT = KVLayout("test-model@0", num_layers=2, num_kv_heads=2, head_dim=64, dtype=torch.float32)


def full_kv(n: int, seed: int = 0) -> FullKV:
    g = torch.Generator().manual_seed(seed)
    layers = [(torch.randn(2, n, 64, generator=g), torch.randn(2, n, 64, generator=g)) for _ in range(2)]
    return FullKV(LAYOUT, layers)


def obs(n_window: int = 64, seed: int = 1) -> Observation:
    g = torch.Generator().manual_seed(seed)
    return Observation([torch.randn(4, n_window, 64, generator=g) for _ in range(2)])


@pytest.mark.parametrize(
    "spec,cls,params",
    [
        ("snapkv:ratio=0.125", "snapkv", {"ratio": 0.125}),
        ("kivi:bits=2", "kivi", {"bits": 2}),
        ("streamingllm:sink=4,window=512", "streamingllm", {"sink": 4, "window": 512}),
        ("  SnapKV : ratio = 0.5 , pool=avg ", "snapkv", {"ratio": 0.5, "pool": "avg"}),
        ("kivi", "kivi", {"bits": 2}),
    ],
)
def test_parse_spec(spec, cls, params):
    c = parse_spec(spec)
    assert c.name == cls
    for k, v in params.items():
        assert getattr(c.params, k) == v
    assert parse_spec(c.spec).spec == c.spec  # the canonical spec round-trips


@pytest.mark.parametrize(
    "spec,message",
    [
        ("h2oo:ratio=0.5", "unknown compressor 'h2oo'"),
        ("", "empty compressor spec"),
        ("snapkv:ratio", "expected key=value"),
        ("snapkv:", "parameters expected"),
        ("snapkv:budget=3", "snapkv has no parameter 'budget'"),
        ("snapkv:ratio=abc", "not a valid float"),
        ("snapkv:ratio=0", "ratio must be in (0, 1]"),
        ("snapkv:ratio=1.5", "ratio must be in (0, 1]"),
        ("snapkv:kernel=4", "odd number"),
        ("kivi:bits=3", "bits must be 2 or 4"),
        ("kivi:residual=48", "multiple of the key group (32)"),
        ("kivi:group=64,key_group=16,residual=40", "multiple of the key group (16)"),
        ("kivi:value_group=-1", "group sizes must be >= 1"),
        ("streamingllm:window=0", "window must be >= 1"),
        ("snapkv:ratio=0.5,ratio=0.25", "given twice"),
    ],
)
def test_bad_specs_are_clear_errors(spec, message):
    with pytest.raises(SpecError) as e:
        parse_spec(spec)
    assert message in str(e.value)
    if "unknown" in message or "empty" in message:
        for name in COMPRESSORS:
            assert name in str(e.value)  # the error lists the choices


def test_streamingllm_keeps_sinks_and_window_and_slides():
    c = parse_spec("streamingllm:sink=4,window=16")
    kv = full_kv(100)
    ckv = c.compress(kv)
    layer = ckv.layers[0]
    assert layer.positions[0].tolist() == [*range(4), *range(84, 100)]
    k, v = layer.read()
    assert torch.equal(k[:, :4], kv.layers[0][0][:, :4]) and torch.equal(v[:, 4:], kv.layers[0][1][:, 84:])
    new = full_kv(3, seed=5).layers[0]
    c.update(ckv, 0, new[0], new[1], torch.tensor([100, 101, 102]))
    assert ckv.layers[0].num_tokens == 20
    assert ckv.layers[0].positions[1].tolist() == [*range(4), *range(87, 103)]


def test_snapkv_keeps_same_count_per_head_window_and_top_scores():
    c = parse_spec("snapkv:ratio=0.25,window=16,kernel=5")
    kv, ob = full_kv(200), obs()
    ckv = c.compress(kv, ob)
    budget = math.ceil(0.25 * 200)
    for li, layer in enumerate(ckv.layers):
        assert layer.positions.shape == (2, budget)
        for h in range(2):
            kept = set(layer.positions[h].tolist())
            assert set(range(184, 200)) <= kept  # the observation window is always kept
            scores = snapkv_scores(ob.queries[li][:, -16:], kv.layers[li][0], 5, "max")[h]
            selected = sorted(kept - set(range(184, 200)))
            threshold = scores[selected].min()
            outside = [i for i in range(184) if i not in kept]
            assert scores[outside].max() <= threshold  # nothing dropped outranks what was kept
        k, _ = layer.read()
        gathered = kv.layers[li][0].gather(1, layer.positions.long().unsqueeze(-1).expand(-1, -1, 64))
        assert torch.equal(k, gathered)  # kept tokens are exact


def test_snapkv_needs_observation():
    with pytest.raises(ValueError, match="observation"):
        parse_spec("snapkv:ratio=0.25").compress(full_kv(200), None)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_unpack_roundtrip(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_dequantization_is_the_reference_bit_for_bit(bits, dtype):
    """The draft path's table lookup gives exactly dequantize(unpack(...)), per channel and per token."""
    x = torch.randn(3, 64, 64) * 3
    for grouped, dim in (((3, 2, 32, 64), 2), ((3, 64, 2, 32), 3)):
        codes, scale, mn = quantize(x.reshape(grouped), dim=dim, bits=bits)
        packed = pack(codes.reshape(3, 64, 64), bits)
        ref = dequantize(unpack(packed, bits).view(grouped), scale, mn, dtype)
        assert torch.equal(dequantize_packed(packed, bits, scale, mn, grouped, dtype), ref)
        if dtype == torch.float32:  # written into a slice of a larger buffer, as the draft path does
            buf = torch.full((3, 70, 64), float("nan"))
            dequantize_packed_into(buf[:, 4:68], packed, bits, scale, mn, grouped)
            assert torch.equal(buf[:, 4:68], ref.view(3, 64, 64))
            assert buf[:, :4].isnan().all() and buf[:, 68:].isnan().all()


def test_quantize_error_is_within_half_a_step():
    x = torch.randn(4, 32, 64)
    codes, scale, mn = quantize(x, dim=1, bits=2)
    err = (dequantize(codes, scale, mn, torch.float32) - x).abs()
    assert (err <= scale.float() / 2 + 1e-3).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_sizes_and_residual(bits):
    c = parse_spec(f"kivi:bits={bits},group=32,residual=128")
    kv = full_kv(300)
    ckv = c.compress(kv)
    layer = ckv.layers[0]
    assert isinstance(layer, KIVILayer)
    assert layer.quantized_tokens == 256 and layer.k_res.shape[1] == 44
    # packed codes + float16 scale/min: keys per (32-token group, channel), values per (token, 32 channels)
    codes = 2 * 2 * 256 * 64 * bits // 8
    scales = 2 * 2 * (256 // 32 * 64 + 256 * 64 // 32) * 2
    residual = 2 * 2 * 44 * 64 * 4
    assert layer.nbytes == codes + scales + residual
    k, _ = layer.read()
    assert k.shape == (2, 300, 64)
    assert torch.equal(k[:, 256:], kv.layers[0][0][:, 256:])  # the residual is exact
    assert (k[:, :256] - kv.layers[0][0][:, :256]).abs().max() > 0  # the rest is not
    pos, k_exact, _ = layer.exact_kv()
    assert pos[0].tolist() == list(range(256, 300)) and torch.equal(k_exact, kv.layers[0][0][:, 256:])
    new = full_kv(100, seed=3).layers[0]
    c.update(ckv, 0, new[0], new[1], torch.arange(300, 400))
    assert ckv.layers[0].quantized_tokens == 384 and ckv.layers[0].num_tokens == 400


def test_kivi_key_and_value_groups_apart():
    """``key_group`` / ``value_group`` set each side's scale grouping: the bytes are each side's own,
    and smaller key groups quantize keys closer (keys per channel over fewer tokens)."""
    kv = full_kv(300)
    k_true, v_true = kv.layers[0]
    both = parse_spec("kivi:bits=4,group=64,residual=64").compress(kv).layers[0]
    apart = parse_spec("kivi:bits=4,group=64,key_group=16,residual=64").compress(kv).layers[0]
    # spelled in the canonical spec only when set: specs without them keep their strings
    spec = parse_spec("kivi:key_group=16,group=64,residual=64,bits=4").spec
    assert spec == "kivi:bits=4,group=64,residual=64,key_group=16"
    assert isinstance(apart, KIVILayer) and (apart.key_group, apart.value_group) == (16, 64)
    assert apart.quantized_tokens == both.quantized_tokens == 256
    # keys: one (scale, min) per channel per 16 tokens instead of 64; values unchanged
    extra = 2 * 2 * (256 // 16 - 256 // 64) * 64 * 2
    assert apart.nbytes == both.nbytes + extra
    (k_both, v_both), (k_apart, v_apart) = both.read(), apart.read()
    assert torch.equal(v_both, v_apart)
    err = lambda k: (k[:, :256] - k_true[:, :256]).abs().mean()
    assert err(k_apart) < err(k_both)
    assert torch.equal(k_apart[:, 256:], k_true[:, 256:])  # the residual stays exact
    values_apart = parse_spec("kivi:bits=4,group=64,value_group=16,residual=64").compress(kv).layers[0]
    v_err = lambda v: (v[:, :256] - v_true[:, :256]).abs().mean()
    assert v_err(values_apart.read()[1]) < v_err(v_both)


def test_compressed_bytes_are_smaller_than_full():
    kv = full_kv(512)
    for spec, bound in [("snapkv:ratio=0.125", 0.14), ("kivi:bits=2", 0.35), ("streamingllm:window=64", 0.14)]:
        c = parse_spec(spec)
        ckv = c.compress(kv, obs())
        assert ckv.nbytes < bound * kv.nbytes, spec
