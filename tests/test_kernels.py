"""Triton kernels against their torch references (TRITON_INTERPRET=1 on CPU; see conftest)."""

import pytest
import torch

from vericache_sglang.core.compress.quant import dequantize, pack, quantize

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
