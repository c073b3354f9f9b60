"""KNorm (Devoto et al., 2024): keep the tokens whose keys have the smallest L2 norm (low key
norm goes with high attention). Query-free; tokens committed later are appended."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vericache_sglang.core.compress.base import DroppedLayer, KeepingDropper, check_ratio
from vericache_sglang.core.compress.drop.scoring import budget, top_per_head
from vericache_sglang.core.compress.observation import Observation


@dataclass
class KNormParams:
    """KNorm (Devoto et al. 2024, arXiv:2406.11430): keep the tokens whose keys have the smallest L2 norm.

    Parameters
    ----------
    ratio : float
        Tokens each KV head keeps, as a fraction of the prompt's ``n`` tokens: ``max(1, ceil(ratio * n))``
        (at most ``n``). In (0, 1]. kvpress's ``compression_ratio`` is ``1 - ratio``.
    """

    ratio: float = 0.25


class KNorm(KeepingDropper):
    name = "knorm"
    Params = KNormParams
    summary = "smallest key L2 norms per KV head (query-free)"
    document_scoring = "query-agnostic: key norms"

    def validate(self) -> None:
        check_ratio("knorm", self.params.ratio)

    def compress_layer(self, layer_idx, k, v, obs: Observation | None) -> DroppedLayer:
        scores = -torch.linalg.vector_norm(k.float(), dim=-1)
        return DroppedLayer.gather(k, v, top_per_head(scores, budget(self.params.ratio, k.shape[1])))
