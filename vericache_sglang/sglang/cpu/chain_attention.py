"""Chain verification on SGLang's CPU attention backend.

``torch_native`` has no speculative support: it runs a TARGET_VERIFY pass through its
``forward_extend``, which pads each request's queries to its whole context and runs causal SDPA
over all of it, computing (and discarding) every prefix position: O(context^2) per verification.
A chain verification (the seed and ``x`` drafts, each attending to the committed prefix and to
the chain before it) needs only its ``x + 1`` queries: this backend is ``torch_native`` with
TARGET_VERIFY computed so, per request, one SDPA of ``[x + 1]`` queries over ``committed + x + 1``
keys with the causal offset as a mask. A prefill that extends a cached prefix (a radix-tree hit, a
prefix loaded from the store, a later chunk) is the same computation, and torch_native pads it the
same way (a 99-token question over a cached 2,880-token document cost as much attention as
prefilling the document); it runs here too. A prefill from scratch, and every other pass, is
``torch_native``'s own. The worker selects it for its prefill and verify passes (``ForwardContext``
override); a TARGET_VERIFY pass reads SGLang's own convention (``seq_lens`` the committed lengths,
``spec_info.draft_token_num`` the chain width). Registered as the ``vericache_torch_native``
attention backend too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from torch.nn.functional import scaled_dot_product_attention

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

NAME = "vericache_torch_native"


class ChainVerifyTorchNative(TorchNativeAttnBackend):
    def forward_extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: RadixAttention,
        forward_batch: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        mode = forward_batch.forward_mode
        if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if mode.is_target_verify():
            width = int(forward_batch.spec_info.draft_token_num)
            prefixes = forward_batch.seq_lens.tolist()
            news = [width] * len(prefixes)
        elif mode.is_extend() and forward_batch.extend_prefix_lens_cpu and any(forward_batch.extend_prefix_lens_cpu):
            prefixes, news = list(forward_batch.extend_prefix_lens_cpu), list(forward_batch.extend_seq_lens_cpu)
        else:  # a prefill from scratch: torch_native's causal SDPA computes no position twice
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            loc = KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc)
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        return self._over_prefixes(q, layer, forward_batch.req_pool_indices.tolist(), prefixes, news)

    def _over_prefixes(
        self, q: torch.Tensor, layer: RadixAttention, rows: list[int], prefixes: list[int], news: list[int]
    ) -> torch.Tensor:
        """Request ``i``'s ``news[i]`` queries (consecutive in ``q``) over its pool row's first
        ``prefixes[i] + news[i]`` keys, each seeing the prefix and the new tokens up to itself."""
        heads, head_dim = layer.tp_q_head_num, layer.qk_head_dim
        q_ = q.view(-1, heads, head_dim)
        o = q.new_empty((q_.shape[0], heads, layer.v_head_dim))
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        req_to_token = self.req_to_token_pool.req_to_token
        start = 0
        for row, prefix, new in zip(rows, prefixes, news, strict=True):
            total = prefix + new
            idx = req_to_token[row, :total]
            keys = k_cache[idx].movedim(0, 1).to(q.dtype)  # [kv_heads, total, d]
            values = v_cache[idx].movedim(0, 1).to(q.dtype)
            own = torch.arange(new, device=q.device)
            # no prefix: plain causal attention, as torch_native computes a prefill from scratch
            visible = None if prefix == 0 else torch.arange(total, device=q.device)[None, :] <= (prefix + own)[:, None]
            span = slice(start, start + new)
            out = scaled_dot_product_attention(
                q_[span].movedim(0, 1).unsqueeze(0),
                keys.unsqueeze(0),
                values.unsqueeze(0),
                attn_mask=visible,
                is_causal=visible is None,
                scale=layer.scaling,
                enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num,
            )
            o[span] = out.squeeze(0).movedim(0, 1)
            start += new
        return o.view(q.shape[0], heads * layer.v_head_dim)


def create_chain_verify_backend(runner: ModelRunner) -> ChainVerifyTorchNative:
    """Factory registered as ``vericache_torch_native`` in SGLang's ATTENTION_BACKENDS."""
    return ChainVerifyTorchNative(runner)
