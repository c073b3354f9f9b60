"""Quest (Tang et al., 2024): query-aware sparsity. Every token stays (nothing is saved in memory);
the KV is cut into pages of ``page`` tokens with per-channel key minima and maxima, and each draft
step reads only the ``ratio`` of pages whose upper bound on ``q·k`` is highest for its queries,
plus the newest page. A KV head's bound is the largest over its query heads and the step's
queries, so every head reads the same number of pages.

Everything the layer holds is exact, so verification moves nothing over the link for it: Quest
buys draft bandwidth, not memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vericache_sglang.core.compress.base import Compressor, check_ratio
from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.kv import CompressedLayer


@dataclass
class QuestParams:
    """Quest (Tang et al. 2024, arXiv:2406.10774): query-aware page selection; every token stays in memory.

    Parameters
    ----------
    ratio : float
        Share of a layer's pages each draft step reads, the newest included: ``ceil(ratio * pages)`` of its
        ``ceil(n / page)`` pages. In (0, 1]; 1 reads everything. It sets draft bandwidth, not memory. The
        paper's token budget, here as a fraction of the context.
    page : int
        Page size in tokens (the paper's): each full page keeps per-channel key minima and maxima, which
        bound ``q·k``; the newest page is always read. >= 1.
    """

    ratio: float = 0.25
    page: int = 16


class QuestLayer(CompressedLayer):
    def __init__(self, k: torch.Tensor, v: torch.Tensor, page: int, ratio: float):
        self.keys, self.values, self.page, self.ratio = k.contiguous(), v.contiguous(), page, ratio
        self.kmin = self.kmax = torch.empty(k.shape[0], 0, k.shape[2], dtype=k.dtype, device=k.device)
        self._refresh_pages(0)

    def _refresh_pages(self, first_page: int) -> None:
        """Recompute the bounds of pages from ``first_page`` on (only full pages are bounded)."""
        h, n, d = self.keys.shape
        full = n // self.page
        if full <= first_page:
            return
        k = self.keys[:, first_page * self.page : full * self.page].view(h, full - first_page, self.page, d)
        self.kmin = torch.cat([self.kmin[:, :first_page], k.amin(dim=2)], dim=1)
        self.kmax = torch.cat([self.kmax[:, :first_page], k.amax(dim=2)], dim=1)

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.kmin.nbytes + self.kmax.nbytes

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def selected_pages(self, query: torch.Tensor, selectable: int, want: int) -> torch.Tensor:
        """The ``want`` pages ``[kv_heads, want]`` (sorted) of the first ``selectable`` that the
        queries ``[q_heads, m, d]`` bound highest."""
        h = self.kmin.shape[0]
        q = query.float().reshape(h, -1, query.shape[-1])  # a KV head's query group, all steps
        kmax, kmin = self.kmax[:, :selectable].float(), self.kmin[:, :selectable].float()
        bound = q.clamp(min=0) @ kmax.transpose(1, 2) + q.clamp(max=0) @ kmin.transpose(1, 2)
        return bound.amax(dim=1).topk(want, dim=-1).indices.sort(dim=-1).values

    def read_for(self, query: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        h, n, d = self.keys.shape
        newest = ((n - 1) // self.page) * self.page  # the newest page, always read
        selectable = newest // self.page
        want = math.ceil(self.ratio * (selectable + 1)) - 1
        if query is None or want >= selectable:
            return self.read()
        chosen = self.selected_pages(query, selectable, want)
        cols = (chosen.unsqueeze(-1) * self.page + torch.arange(self.page, device=chosen.device)).flatten(1)
        cols = torch.cat([cols, torch.arange(newest, n, device=cols.device).expand(h, -1)], dim=1)
        idx = cols.unsqueeze(-1).expand(-1, -1, d)
        return self.keys.gather(1, idx), self.values.gather(1, idx)

    def exact_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, n, _ = self.keys.shape
        return torch.arange(n, dtype=torch.int32, device=self.keys.device).expand(h, -1), self.keys, self.values

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        first = self.keys.shape[1] // self.page
        self.keys = torch.cat([self.keys, k], dim=1)
        self.values = torch.cat([self.values, v], dim=1)
        self._refresh_pages(first)


class Quest(Compressor):
    name = "quest"
    kind = "sparse"
    Params = QuestParams
    summary = "keeps every token; each draft step reads the pages with the highest q·k bound"
    document_scoring = "query-agnostic at compression (keeps every token); each draft step's own query chooses pages"

    def validate(self) -> None:
        check_ratio("quest", self.params.ratio)
        if self.params.page < 1:
            raise ValueError(f"quest: page must be >= 1, got {self.params.page}")

    def compress_layer(self, layer_idx, k, v, obs: Observation | None) -> QuestLayer:
        return QuestLayer(k, v, self.params.page, self.params.ratio)

    def update_layer(self, layer, k, v, positions, q) -> QuestLayer:
        assert isinstance(layer, QuestLayer)
        layer.append(k, v)
        return layer
