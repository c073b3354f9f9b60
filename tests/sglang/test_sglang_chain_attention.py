"""The CPU chain backend's attention (``sglang.cpu.chain_attention``) against torch_native's own
extend on the same pool: new tokens over a cached prefix attend from their own rows only, and give
what torch_native's padded computation gives them; a prompt with no prefix is torch_native's
causal attention exactly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang.srt.layers.attention.torch_native_backend", reason="sglang is not installed")

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from vericache_sglang.sglang.cpu.chain_attention import ChainVerifyTorchNative

HEADS, KV_HEADS, DIM = 4, 2, 16


def _backend(pool_tokens: int, rows: int, width: int):
    g = torch.Generator().manual_seed(0)
    k = torch.randn(pool_tokens, KV_HEADS, DIM, generator=g)
    v = torch.randn(pool_tokens, KV_HEADS, DIM, generator=g)
    req_to_token = torch.randperm(pool_tokens, generator=g)[: rows * width].view(rows, width)
    backend = object.__new__(ChainVerifyTorchNative)  # the attention only reads the two pools
    backend.token_to_kv_pool = SimpleNamespace(get_key_buffer=lambda layer: k, get_value_buffer=lambda layer: v)
    backend.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
    layer = SimpleNamespace(
        tp_q_head_num=HEADS, tp_k_head_num=KV_HEADS, qk_head_dim=DIM, v_head_dim=DIM, layer_id=0, scaling=DIM**-0.5
    )
    return backend, layer, k, v, req_to_token


def test_new_tokens_over_a_cached_prefix_attend_as_torch_native_computes_them():
    backend, layer, k, v, req_to_token = _backend(512, 3, 160)
    prefixes, news, rows = [120, 0, 33], [9, 14, 1], [2, 0, 1]
    q = torch.randn(sum(news), HEADS * DIM, generator=torch.Generator().manual_seed(1))
    ours = backend._over_prefixes(q, layer, rows, prefixes, news).view(-1, HEADS, DIM)
    stock = torch.empty_like(ours)
    TorchNativeAttnBackend._run_sdpa_forward_extend(
        backend,
        q.view(-1, HEADS, DIM),
        stock,
        k,
        v,
        req_to_token,
        torch.tensor(rows),
        torch.tensor([p + n for p, n in zip(prefixes, news, strict=True)]),
        torch.tensor(prefixes),
        torch.tensor(news),
        scaling=layer.scaling,
        enable_gqa=True,
        causal=True,
    )
    assert (ours - stock).abs().max() < 1e-5
    no_prefix = slice(news[0], news[0] + news[1])
    assert torch.equal(ours[no_prefix], stock[no_prefix])  # a prefill from scratch: the same computation
