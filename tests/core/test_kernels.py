"""Triton kernels against their torch references (TRITON_INTERPRET=1 on CPU; see conftest)."""

import pytest
import torch

from vericache_sglang.core.compress.quant.quant import dequantize, pack, quantize

triton = pytest.importorskip("triton")
# On a GPU the kernels run compiled on the device; without one, in the interpreter on CPU tensors.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dequant_per_token_groups_matches_reference(bits):
    from vericache_sglang.kernels.dequant import dequantize_packed

    x = torch.randn(2, 40, 64, device=DEVICE)
    codes, scale, mn = quantize(x.view(2, 40, 2, 32), dim=3, bits=bits)  # values: per token, 32 channels
    ref = dequantize(codes, scale, mn, torch.float32).view(2, 40, 64)
    got = dequantize_packed(pack(codes.view(2, 40, 64), bits), scale, mn, bits, col_group=32)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("bits", [2, 4])
def test_dequant_per_channel_groups_matches_reference(bits):
    from vericache_sglang.kernels.dequant import dequantize_packed

    x = torch.randn(3, 64, 64, device=DEVICE)
    codes, scale, mn = quantize(x.view(3, 2, 32, 64), dim=2, bits=bits)  # keys: per channel, 32 tokens
    ref = dequantize(codes, scale, mn, torch.float32).view(3, 64, 64)
    got = dequantize_packed(pack(codes.view(3, 64, 64), bits), scale, mn, bits, row_group=32)
    assert torch.equal(got, ref)


def packed(x, bits, row_group=1, col_group=1):
    """Quantize ``x`` ``[heads, n, d]`` with one (scale, min) per row_group x col_group block."""
    from vericache_sglang.kernels.quant_attention import PackedKV

    h, n, d = x.shape
    blocks = x.view(h, n // row_group, row_group, d // col_group, col_group)
    codes, scale, mn = _quantize_blocks(blocks, bits)
    return PackedKV(pack(codes.view(h, n, d), bits), scale, mn, bits, row_group, col_group)


def _quantize_blocks(blocks, bits):
    h, nr, rg, nc, cg = blocks.shape
    flat = blocks.permute(0, 1, 3, 2, 4).reshape(h, nr, nc, rg * cg)
    codes, scale, mn = quantize(flat, dim=3, bits=bits)
    codes = codes.view(h, nr, nc, rg, cg).permute(0, 1, 3, 2, 4)
    return codes.contiguous(), scale.view(h, nr, nc), mn.view(h, nr, nc)


@pytest.mark.parametrize("bits,layout", [(2, "kivi"), (4, "kivi"), (4, "per_token"), (8, "per_token")])
def test_quant_decode_attention_matches_reference(bits, layout):
    from vericache_sglang.kernels.quant_attention import quant_attention_reference, quant_decode_attention

    g = torch.Generator().manual_seed(bits)
    k = torch.randn(2, 96, 64, generator=g).to(DEVICE)
    v = torch.randn(2, 96, 64, generator=g).to(DEVICE)
    q = torch.randn(6, 64, generator=g).to(DEVICE)
    if layout == "kivi":  # keys per channel over 32-token groups, values per token over 32 channels
        pk, pv = packed(k, bits, row_group=32), packed(v, bits, col_group=32)
    else:
        pk, pv = packed(k, bits, col_group=32), packed(v, bits, col_group=32)
    ref = quant_attention_reference(q, pk, pv)
    got = quant_decode_attention(q, pk, pv)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (got - ref).abs().max()
    # and the reference is attention over the dequantized cache, close to the exact one at 8 bits
    if bits == 8:
        exact = torch.softmax(torch.einsum("hd,hnd->hn", q, k.repeat_interleave(3, 0)) / 8, -1)
        exact = torch.einsum("hn,hnd->hd", exact, v.repeat_interleave(3, 0))
        assert (ref - exact).abs().max() < 0.05


def test_quant_decode_attention_rejects_bad_shapes():
    from vericache_sglang.kernels.quant_attention import quant_decode_attention

    k = packed(torch.randn(2, 32, 64, device=DEVICE), 4, col_group=32)
    with pytest.raises(ValueError, match="query heads"):
        quant_decode_attention(torch.randn(3, 64, device=DEVICE), k, k)
    with pytest.raises(ValueError, match="power of two"):
        quant_decode_attention(torch.randn(4, 48, device=DEVICE), k, k)
