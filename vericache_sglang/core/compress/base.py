"""The compressor interface (the paper's Listing 1, in this project's words).

A compressor turns a request's exact full KV into the compressed KV that drafting attends to
(``compress``), keeps it current as verified tokens are committed (``update``), and decides how
attention reads it (each layer's ``CompressedLayer.read``). It never sees drafted KV: drafts are
scratch, and only the verifier's exact K/V of committed tokens reaches ``update``.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch

from vericache_sglang.core.kv import CompressedKV, CompressedLayer, FullKV


@dataclass
class Observation:
    """What the prefill saw that a scoring compressor may use.

    ``queries[layer]`` holds the post-RoPE queries ``[q_heads, window, head_dim]`` of the last
    prompt tokens (SnapKV's observation window).
    """

    queries: list[torch.Tensor] | None = None

    def window_queries(self, layer: int, window: int) -> torch.Tensor:
        if self.queries is None:
            raise ValueError("this compressor needs the prefill's observation queries")
        q = self.queries[layer]
        if q.shape[1] < window:
            raise ValueError(f"observation window of {window} tokens asked, prefill kept {q.shape[1]}")
        return q[:, q.shape[1] - window :]


class Compressor(ABC):
    """Base class. Subclasses declare ``name``, ``kind`` and a ``Params`` dataclass of defaults."""

    name: ClassVar[str]
    kind: ClassVar[Literal["dropping", "quantization"]]
    mode: ClassVar[Literal["online", "offline"]] = "online"
    Params: ClassVar[type]
    summary: ClassVar[str] = ""

    def __init__(self, **params: object):
        self.params = self.Params(**params)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError on parameters outside their domain."""

    @property
    def spec(self) -> str:
        """The canonical spec string (every parameter spelled out)."""
        fields = dataclasses.asdict(self.params)
        return f"{self.name}:" + ",".join(f"{k}={v}" for k, v in fields.items())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"

    def compress(self, full: FullKV, obs: Observation | None = None) -> CompressedKV:
        layers = [
            self.compress_layer(i, k, v, obs) for i, (k, v) in enumerate(full.layers)
        ]
        return CompressedKV(full.layout, self.spec, layers)

    @abstractmethod
    def compress_layer(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, obs: Observation | None
    ) -> CompressedLayer:
        """Compress one layer's exact KV ``[kv_heads, tokens, head_dim]`` (positions 0..tokens-1)."""

    def update(
        self,
        ckv: CompressedKV,
        layer_idx: int,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        q: torch.Tensor | None = None,
    ) -> None:
        """Fold committed tokens' exact K/V ``[kv_heads, n, head_dim]`` into layer ``layer_idx``.

        ``positions`` are their absolute positions; ``q`` their queries, for online scorers.
        """
        ckv.layers[layer_idx] = self.update_layer(ckv.layers[layer_idx], k, v, positions, q)

    @abstractmethod
    def update_layer(
        self,
        layer: CompressedLayer,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        q: torch.Tensor | None,
    ) -> CompressedLayer:
        """Return the layer with the new tokens folded in (it may be the same object)."""


class DroppedLayer(CompressedLayer):
    """A token-dropping layer: the kept tokens' exact K/V and their positions, same count per head."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        if positions.shape != keys.shape[:2]:
            raise ValueError(f"positions {tuple(positions.shape)} do not match keys {tuple(keys.shape)}")
        self.keys = keys
        self.values = values
        self.positions = positions

    @classmethod
    def gather(cls, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> DroppedLayer:
        """Keep the positions ``keep`` (``[kv_heads, n]``, sorted per head) of a full layer."""
        idx = keep.unsqueeze(-1).expand(-1, -1, k.shape[-1])
        return cls(k.gather(1, idx).contiguous(), v.gather(1, idx).contiguous(), keep.to(torch.int32))

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes + self.positions.nbytes

    @property
    def num_tokens(self) -> int:
        return self.keys.shape[1]

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def exact_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.positions, self.keys, self.values

    def append(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        pos = positions.to(torch.int32).to(self.positions.device).expand(k.shape[0], -1)
        self.keys = torch.cat([self.keys, k], dim=1)
        self.values = torch.cat([self.values, v], dim=1)
        self.positions = torch.cat([self.positions, pos], dim=1)

    def keep_columns(self, cols: torch.Tensor) -> None:
        """Keep the columns ``cols`` (``[kv_heads, n]`` indices into this layer's tokens)."""
        idx = cols.unsqueeze(-1).expand(-1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(1, idx).contiguous()
        self.values = self.values.gather(1, idx).contiguous()
        self.positions = self.positions.gather(1, cols).contiguous()


def check_ratio(name: str, ratio: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"{name}: ratio must be in (0, 1], got {ratio}")
