"""Verification-guided refresh: a share of the compressed KV's rows re-chosen at every verification
from the verify pass's own attention, swapped in exactly from the full KV that is on the device
at that moment (no extra transfer).

A dropper chose its rows from the prompt's last queries; as generation moves on, what matters
moves. Every verification already runs the committed tokens' queries over the whole full KV, so
which rows they attend to is known where it is needed. ``snapkv:ratio=0.0625+refresh:ratio=0.0625``
keeps SnapKV's choice at 1/16 of the prompt plus 1/16 of it in refreshed rows: the bytes are the
sum, stated in the spec, and fixed (the refreshed set is replaced, not grown).

Scoring at a verification, per layer and KV head: the committed tokens' attention over the full
KV (the verifier's token's query included: it is the one that saw where drafting went wrong),
summed over those queries and averaged over the head's query group, then spread ``span`` rows
forward, since text being copied is read forward (the row after an attended one is the next
one needed). The best rows of tokens the inner compressor does not hold are kept: none it holds
exactly, nor one a composition holds quantized (two copies of a token would weigh it twice in
attention). A quantizer alone holds every token and leaves nothing to add: refused.
Before the first verification the prompt's last queries choose them (SnapKV's observation).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vericache_sglang.core.compress.base import Compressor, check_ratio
from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.kv import CompressedKV, CompressedLayer, FullKV


@dataclass
class RefreshParams:
    """Verification-guided refresh (this project's ``+refresh`` drafting modifier; no paper).

    Parameters
    ----------
    ratio : float
        Refreshed rows per KV head, as a fraction of the prompt's ``n`` tokens: ``max(1, ceil(ratio * n))``
        (at most ``n``, and no more than the tokens the inner compressor does not hold), fixed for the
        request: the set is replaced at each verification, not grown. In (0, 1]. Its bytes add to the
        inner compressor's.
    span : int
        Rows after an attended row that share its score, in tokens: row ``p`` takes the best score of rows
        ``p - span .. p`` (copied text is read forward). >= 0; 0 spreads nothing.
    window : int
        Prompt tokens whose queries choose the rows before the first verification: the last ``window``
        (at most the prompt). >= 1.
    decay : float
        Weight of the earlier scores: each verification's scores add ``decay`` times the running scores
        before them (before spreading). In [0, 1); 0 scores by this verification's attention alone.
    """

    ratio: float = 0.0625  # refreshed rows per KV head, as a fraction of the prompt
    span: int = 16  # rows after an attended row that share its score
    window: int = 16  # prompt queries that choose the rows before the first verification
    decay: float = 0.0  # weight of the earlier verifications' scores (0: this verification's alone)


class RefreshedLayer(CompressedLayer):
    """The inner compressor's layer plus ``rows`` exact refreshed rows per head (held first in a
    draft window's reads, so the inner layer's in-place room serves both)."""

    def __init__(
        self,
        inner: CompressedLayer,
        keys: torch.Tensor,
        values: torch.Tensor,
        positions: torch.Tensor,
        scores: torch.Tensor | None = None,
    ):
        self.inner = inner
        self.keys, self.values, self.positions = keys, values, positions  # [kv_heads, r(, head_dim)]
        self.scores = scores  # [kv_heads, n] every full-KV row's decayed score (with ``decay``)

    @property
    def rows(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        mine = self.keys.nbytes + self.values.nbytes + self.positions.nbytes
        return self.inner.nbytes + mine + (0 if self.scores is None else self.scores.nbytes)

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens + self.rows

    @property
    def reserved_nbytes(self) -> int:
        return self.inner.reserved_nbytes

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.inner.read()
        return torch.cat([self.keys, k], dim=1), torch.cat([self.values, v], dim=1)

    def read_for(self, query: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.inner.read_for(query)
        return torch.cat([self.keys, k], dim=1), torch.cat([self.values, v], dim=1)

    def read_with_drafts(
        self, offset: int, k: torch.Tensor, v: torch.Tensor, query: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        # Attention is order-free over the compressed rows: the refreshed rows go into the inner
        # layer's room first (once per window), the window's tokens after them.
        if offset == 0:
            k, v = torch.cat([self.keys, k], dim=1), torch.cat([self.values, v], dim=1)
        else:
            offset += self.rows
        return self.inner.read_with_drafts(offset, k, v, query)

    def exact_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inner = self.inner.exact_kv()
        mine = (self.positions, self.keys, self.values)
        if inner is None:
            return mine
        pos, k, v = inner
        return (
            torch.cat([self.positions, pos.to(self.positions.dtype)], dim=1),
            torch.cat([self.keys, k], dim=1),
            torch.cat([self.values, v], dim=1),
        )


def refresh_scores(queries: torch.Tensor, keys: Sequence[torch.Tensor], causal: bool) -> torch.Tensor:
    """Scores ``[kv_heads, n]`` of every full-KV row, the full KV given in parts (``[kv_heads, n_i,
    d]`` each, in position order, never concatenated): ``queries`` ``[q_heads, m, d]``' attention,
    summed over queries, averaged per KV head. ``causal``: the queries are of the last ``m`` rows
    (else they follow every row)."""
    hq, m, d = queries.shape
    hk = keys[0].shape[0]
    group = hq // hk
    # A KV head's query group side by side, so no key is repeated per query head.
    q = queries.float().reshape(hk, group * m, d)
    logits = torch.cat([q @ k.float().transpose(1, 2) for k in keys], dim=-1) / math.sqrt(d)  # [hk, group*m, n]
    n = logits.shape[-1]
    if causal and m > 1:
        future = torch.ones(m, m, dtype=torch.bool, device=q.device).triu(1).repeat(group, 1)
        logits[:, :, n - m :].masked_fill_(future, float("-inf"))
    return logits.softmax(dim=-1).sum(dim=1) / group


def spread_forward(scores: torch.Tensor, span: int) -> torch.Tensor:
    """Row ``p`` takes the best score of rows ``p - span .. p``."""
    if not span:
        return scores
    return F.max_pool1d(F.pad(scores.unsqueeze(1), (span, 0), value=0.0), span + 1, stride=1).squeeze(1)


class Refreshed(Compressor):
    """``inner`` plus refreshed rows; every other call goes to ``inner``."""

    Params = RefreshParams
    refreshes = True

    def __init__(self, inner: Compressor, **params: object):
        if isinstance(inner, Refreshed):
            raise ValueError("refresh given twice")
        if inner.kind == "quantization":
            raise ValueError(
                f"refresh after {inner.name} alone: a quantizer holds every token, so there is no "
                f"row to add; put a dropper before it (snapkv:ratio=0.5+{inner.name}+refresh)"
            )
        self.inner = inner
        super().__init__(**params)
        self.name = f"{inner.name}+refresh"
        self.kind = inner.kind
        self.mode = inner.mode
        self.needs = inner.needs | {"update_queries"}
        self.document_scoring = inner.document_scoring
        self.uniform_layers = inner.uniform_layers
        self.evicts = inner.evicts
        self.summary = f"{inner.summary}; plus rows re-chosen at each verification from its attention"

    def validate(self) -> None:
        p = self.params
        check_ratio("refresh", p.ratio)
        if p.span < 0 or p.window < 1:
            raise ValueError(f"refresh: span must be >= 0 and window >= 1, got {p.span}, {p.window}")
        if not 0.0 <= p.decay < 1.0:
            raise ValueError(f"refresh: decay must be in [0, 1), got {p.decay}")

    @property
    def base_spec(self) -> str:
        p = self.params
        return f"{self.inner.base_spec}+refresh:ratio={p.ratio},span={p.span},window={p.window},decay={p.decay}"

    def rows_for(self, prompt_tokens: int) -> int:
        return min(prompt_tokens, max(1, math.ceil(self.params.ratio * prompt_tokens)))

    def compress(self, full: FullKV, obs: Observation | None = None) -> CompressedKV:
        inner = self.inner.compress(full, obs)
        rows = self.rows_for(full.num_tokens)
        layers = []
        for i, (layer, (k, v)) in enumerate(zip(inner.layers, full.layers, strict=True)):
            window = min(self.params.window, k.shape[1])
            q = None
            if obs is not None and (obs.queries is not None or obs.source is not None):
                q = obs.window_queries(i, window)
            layers.append(self._choose(layer, [(k, v)], q, rows, None, causal=obs is not None and not obs.follows))
        return CompressedKV(full.layout, self.base_spec, layers)

    def compress_layer(self, layer_idx, k, v, obs):
        raise NotImplementedError("refresh compresses all layers at once: use compress()")

    def update_layer(self, layer: CompressedLayer, k, v, positions, q) -> CompressedLayer:
        assert isinstance(layer, RefreshedLayer)
        layer.inner = self.inner.update_layer(layer.inner, k, v, positions, q if self.inner.update_queries else None)
        return layer

    def refresh(
        self,
        ckv: CompressedKV,
        full: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
        queries: Sequence[torch.Tensor],
    ) -> None:
        """Re-choose every layer's refreshed rows. ``full[layer]`` is the full KV in parts, in
        position order (the fetched KV, then the verify pass's committed tokens); ``queries[layer]``
        ``[q_heads, m, d]`` are the committed tokens' queries, the last ``m`` rows of it."""
        for i, layer in enumerate(ckv.layers):
            assert isinstance(layer, RefreshedLayer)
            ckv.layers[i] = self._choose(layer.inner, full[i], queries[i], layer.rows, layer.scores, causal=True)

    def _choose(
        self,
        inner: CompressedLayer,
        parts: Sequence[tuple[torch.Tensor, torch.Tensor]],
        queries: torch.Tensor | None,
        rows: int,
        before: torch.Tensor | None,
        causal: bool,
    ) -> RefreshedLayer:
        hk = parts[0][0].shape[0]
        n = sum(k.shape[1] for k, _ in parts)
        device = parts[0][0].device
        kept = None
        if queries is None:  # nothing to score by: the latest rows, as a sliding window would
            scores = torch.arange(n, dtype=torch.float32, device=device).expand(hk, -1).clone()
        else:
            scores = refresh_scores(queries, [k for k, _ in parts], causal)
            if self.params.decay:
                if before is not None:
                    scores[:, : before.shape[1]] += self.params.decay * before
                kept = scores.clone()
            scores = spread_forward(scores, self.params.span)
        held = inner.held_positions()
        free = n
        if held is not None:  # tokens the inner layer holds (exact or quantized) are not taken twice
            pos = held.long().to(device)
            scores.scatter_(1, pos, float("-inf"))
            free = n - pos.shape[1]
        rows = max(0, min(rows, free))
        keep = scores.topk(rows, dim=-1).indices.sort(dim=-1).values
        keys, values = gather_rows(parts, keep)
        return RefreshedLayer(inner, keys, values, keep.to(torch.int32), kept)


def gather_rows(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]], rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values ``[kv_heads, r, d]`` at positions ``rows`` ``[kv_heads, r]`` of a KV held in
    parts (in position order): each part serves the rows that fall in it."""
    if len(parts) == 1:
        idx = rows.unsqueeze(-1).expand(-1, -1, parts[0][0].shape[-1])
        return parts[0][0].gather(1, idx), parts[0][1].gather(1, idx)
    k0, v0 = parts[0]
    keys = k0.new_empty(k0.shape[0], rows.shape[1], k0.shape[-1])
    values = v0.new_empty(v0.shape[0], rows.shape[1], v0.shape[-1])
    start = 0
    for k, v in parts:
        size = k.shape[1]
        inside = ((rows >= start) & (rows < start + size)).unsqueeze(-1)
        if size and inside.any():
            idx = (rows - start).clamp(0, size - 1).unsqueeze(-1).expand(-1, -1, k.shape[-1])
            keys = torch.where(inside, k.gather(1, idx), keys)
            values = torch.where(inside, v.gather(1, idx), values)
        start += size
    return keys, values
