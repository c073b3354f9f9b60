"""The model runner: one forward over any KV context, written out layer by layer (gpt-fast style).

It reuses the transformers modules for the per-token math (norms, projections, rotary embedding,
MLP) and owns attention, so the same weights can attend to the exact full KV, a resident KV, a
compressor's compressed KV plus draft scratch, or a full KV still streaming in from the store.

Several sequences can run in one forward (a batch): their tokens share the matmuls, and each
attends to its own context.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from vericache_sglang.core.kv import CompressedKV, FullKV, KVLayout
from vericache_sglang.engine.model import LoadedModel


class ContextKV(Protocol):
    def attend_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Take the new tokens' K/V ``[kv_heads, n, head_dim]`` at ``layer`` and return every key and
        value they attend to, the new ones last. Whether the new K/V stay is the context's choice;
        ``q`` (their queries) is for query-aware contexts."""
        ...


class ResidentKV:
    """A full KV held in growing buffers; new tokens stay (prefill, full-KV decoding)."""

    def __init__(self, layout: KVLayout, capacity: int, device: torch.device | str = "cpu"):
        shape = (layout.num_kv_heads, max(capacity, 1), layout.head_dim)
        self.layout = layout
        self.k = [torch.empty(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]
        self.v = [torch.empty(shape, dtype=layout.dtype, device=device) for _ in range(layout.num_layers)]
        self.length = 0

    @classmethod
    def from_full(cls, full: FullKV, capacity: int, device: torch.device | str = "cpu") -> ResidentKV:
        ctx = cls(full.layout, max(capacity, full.num_tokens), device)
        n = full.num_tokens
        for layer, (k, v) in enumerate(full.layers):
            ctx.k[layer][:, :n] = k
            ctx.v[layer][:, :n] = v
        ctx.length = n
        return ctx

    def _grow(self, need: int) -> None:
        cap = self.k[0].shape[1]
        if need <= cap:
            return
        new_cap = max(need, 2 * cap)
        for bufs in (self.k, self.v):
            for i, b in enumerate(bufs):
                grown = torch.empty((b.shape[0], new_cap, b.shape[2]), dtype=b.dtype, device=b.device)
                grown[:, : self.length] = b[:, : self.length]
                bufs[i] = grown

    def attend_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.length + k.shape[1]
        if layer == 0:
            self._grow(end)
        self.k[layer][:, self.length : end] = k
        self.v[layer][:, self.length : end] = v
        keys, values = self.k[layer][:, :end], self.v[layer][:, :end]
        if layer == self.layout.num_layers - 1:
            self.length = end  # the forward's tokens are now part of the context
        return keys, values

    def extend(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Append exact K/V ``[kv_heads, n, head_dim]`` per layer."""
        for layer, (k, v) in enumerate(layers):
            self.attend_kv(layer, k, v)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def to_full(self) -> FullKV:
        return FullKV(
            self.layout, [(k[:, : self.length], v[:, : self.length]) for k, v in zip(self.k, self.v, strict=True)]
        )


class DraftKV:
    """A compressed KV plus this draft window's tokens, dropped after verify: written into the
    layers' room after their rows where they keep one (no per-step copy of the compressed KV),
    else kept as scratch and concatenated."""

    def __init__(self, ckv: CompressedKV):
        self.ckv = ckv
        ckv.draft_epoch += 1
        self.epoch = ckv.draft_epoch
        self.drafted = [0] * len(ckv.layers)  # window tokens written per layer
        self.scratch: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in ckv.layers]

    def attend_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ckv.draft_epoch != self.epoch:
            raise RuntimeError("a newer draft window was opened over this compressed KV")
        compressed = self.ckv.layers[layer]
        offset = self.drafted[layer]
        self.drafted[layer] += k.shape[1]
        in_place = compressed.read_with_drafts(offset, k, v, q)
        if in_place is not None:
            return in_place
        self.scratch[layer].append((k, v))
        ck, cv = compressed.read_for(q)
        ks = [ck, *(s[0] for s in self.scratch[layer])]
        vs = [cv, *(s[1] for s in self.scratch[layer])]
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)

    def forget(self, n: int) -> None:
        """Drop the window's last ``n`` tokens (a lookup chain cut where the model disagreed): the
        next forward writes over their rows."""
        for layer in range(len(self.drafted)):
            self.drafted[layer] -= n
            left, scratch = n, self.scratch[layer]
            while left and scratch:
                k, v = scratch[-1]
                if k.shape[1] <= left:
                    left -= k.shape[1]
                    scratch.pop()
                else:
                    scratch[-1] = (k[:, : k.shape[1] - left], v[:, : v.shape[1] - left])
                    left = 0


class LayerFeed(Protocol):
    def wait_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Block until ``layer``'s full KV has arrived; raise if its fetch failed."""
        ...

    def with_new(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Block as ``wait_layer``; then the layer's full KV followed by ``k``/``v``, written into
        room the feed kept after it, or None where it kept none."""
        ...


class StreamedKV:
    """The full KV arriving layer by layer (verification); new tokens' K/V are not kept. Where the
    feed kept room after each layer they are written there (the full KV is never copied on the
    verify's path), else concatenated."""

    def __init__(self, feed: LayerFeed):
        self.feed = feed

    def attend_kv(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        in_place = self.feed.with_new(layer, k, v)
        if in_place is not None:
            return in_place
        fk, fv = self.feed.wait_layer(layer)
        return torch.cat([fk, k], dim=1), torch.cat([fv, v], dim=1)


@dataclass
class Segment:
    """One sequence's slice of a forward: its new tokens, their positions, what they attend to."""

    tokens: Sequence[int]
    positions: Sequence[int]
    context: ContextKV
    logits: str = "all"  # "all" | "last" | "none"
    keep_queries: int = 0  # keep the post-RoPE queries of the last n tokens (scoring compressors)


@dataclass
class SegmentOutput:
    logits: torch.Tensor | None  # float32 [n or 1, vocab]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [kv_heads, n, head_dim]
    queries: list[torch.Tensor] | None = None  # per layer, [q_heads, keep, head_dim]


@dataclass
class Timeline:
    """When each layer started computing, for overlap measurements."""

    layer_start: list[float] = field(default_factory=list)


class ModelRunner:
    """``row_bucket`` and ``row_attention`` make a token's numerics independent of how many tokens
    share its forward (batch invariance), which low-precision GPU kernels otherwise break: a
    verify pass over x+1 tokens must produce, row by row, the bits one-token decoding produces.
    ``row_bucket=B`` pads every forward to a multiple of B rows, so a decode step and a verify pass
    run the same GEMM shapes; ``row_attention`` runs each new token's attention as its own
    one-query call, the call decoding makes (for segments of at most ``row_bucket`` tokens: a
    prefill chunk needs no invariance, its KV is shared by the reference and VeriCache). So a
    verify pass is invariant while the forward holds at most ``row_bucket`` rows."""

    def __init__(self, loaded: LoadedModel, row_bucket: int = 0, row_attention: bool = False):
        model = loaded.model
        cfg = model.config
        self.loaded = loaded
        self.model = model
        self.config = cfg
        self.embed = model.model.embed_tokens
        self.layers = model.model.layers
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.rotary = model.model.rotary_emb
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scaling = self.layers[0].self_attn.scaling
        self.max_positions = cfg.max_position_embeddings
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.layout = KVLayout(loaded.model_id, len(self.layers), self.num_kv_heads, self.head_dim, self.dtype)
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self._rope: Callable = apply_rotary_pos_emb
        if row_bucket < 0:
            raise ValueError(f"row_bucket must be >= 0, got {row_bucket}")
        self.row_bucket, self.row_attention = row_bucket, row_attention
        # The work every forward did, for cost accounting: (row, key) pairs attention scored, summed
        # over layers; a row's matmuls are the weights' (``flops``).
        self.attended_keys = 0
        self._matmul_params = (
            sum(p.numel() for p in self.layers.parameters() if p.dim() == 2) + self.lm_head.weight.numel()
        )

    def flops(self, rows: int, attended_keys: int) -> float:
        """Floating-point operations of ``rows`` token rows through every layer and the head, with
        attention over ``attended_keys`` (row, key) pairs across layers (QK and PV)."""
        return 2.0 * self._matmul_params * rows + 4.0 * self.num_heads * self.head_dim * attended_keys

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def _attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        """``q`` ``[q_heads, n, d]`` over ``keys``/``values`` ``[kv_heads, c + n, d]`` (the new last)."""
        n, total = q.shape[1], keys.shape[1]
        if n > 1 and self.row_attention and (not self.row_bucket or n <= self.row_bucket):
            past = total - n
            return torch.cat(
                [
                    self._attention(q[:, i : i + 1], keys[:, : past + i + 1], values[:, : past + i + 1])
                    for i in range(n)
                ],
                dim=1,
            )
        mask = None
        if n > 1:
            past = total - n
            mask = torch.ones(n, total, dtype=torch.bool, device=q.device)
            mask[:, past:] = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(
            q.unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            scale=self.scaling,
            enable_gqa=True,
        )
        return out[0]

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment], timeline: Timeline | None = None) -> list[SegmentOutput]:
        lengths = [len(s.tokens) for s in segments]
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        flat_tokens = [t for s in segments for t in s.tokens]
        flat_positions = [p for s in segments for p in s.positions]
        if max(flat_positions) >= self.max_positions:
            raise ValueError(f"position {max(flat_positions)} is beyond the model's {self.max_positions}")
        real = len(flat_tokens)
        pad = (-real) % self.row_bucket if self.row_bucket else 0  # dummy rows: token 0 at position 0
        tokens = torch.tensor(flat_tokens + [0] * pad, dtype=torch.long, device=self.device)
        positions = torch.tensor(flat_positions + [0] * pad, dtype=torch.long, device=self.device)
        h = self.embed(tokens).unsqueeze(0)  # [1, N, hidden]
        cos, sin = self.rotary(h, positions.unsqueeze(0))
        total = h.shape[1]
        kv_out: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in segments]
        q_out: list[list[torch.Tensor]] = [[] for _ in segments]
        for li, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(1, total, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(1, total, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(1, total, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self._rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            v = v.transpose(1, 2)
            outs = []
            for si, seg in enumerate(segments):
                a, b = bounds[si], bounds[si + 1]
                qs, ks, vs = q[0, :, a:b], k[0, :, a:b].contiguous(), v[0, :, a:b].contiguous()
                kv_out[si].append((ks, vs))
                if seg.keep_queries:
                    q_out[si].append(qs[:, max(0, b - a - seg.keep_queries) :].clone())
                keys, values = seg.context.attend_kv(li, ks, vs, qs)
                self.attended_keys += (b - a) * keys.shape[1]
                if timeline is not None and si == 0:
                    timeline.layer_start.append(time.monotonic())
                outs.append(self._attention(qs, keys, values))
            if pad:
                outs.append(q.new_zeros(self.num_heads, pad, self.head_dim))
            o = torch.cat(outs, dim=1).transpose(0, 1).reshape(1, total, self.num_heads * self.head_dim)
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        # One head GEMM for every row that wants logits: the head is the largest matrix, and read
        # once per segment it would cost a batch of one-token rows its bytes per row. Bucketed
        # rows: every row, so the GEMM has the same shape always.
        if self.row_bucket:
            rows = list(range(total))
        else:
            rows = [
                r
                for si, seg in enumerate(segments)
                if seg.logits != "none"
                for r in (
                    range(bounds[si + 1] - 1, bounds[si + 1])
                    if seg.logits == "last"
                    else range(bounds[si], bounds[si + 1])
                )
            ]
        if rows and any(seg.logits != "none" for seg in segments):
            picked = h if len(rows) == total else h[:, torch.tensor(rows, device=h.device)]
            every = self.lm_head(self.norm(picked))[0].float()
            where = {r: i for i, r in enumerate(rows)}
        results = []
        for si, seg in enumerate(segments):
            a, b = bounds[si], bounds[si + 1]
            logits = None
            if seg.logits != "none":
                first = where[b - 1] if seg.logits == "last" else where[a]
                logits = every[first : first + (1 if seg.logits == "last" else b - a)]
                if len(segments) > 1:
                    logits = logits.clone()  # not a view pinning the whole batch's logits
            results.append(SegmentOutput(logits, kv_out[si], q_out[si] if seg.keep_queries else None))
        return results
