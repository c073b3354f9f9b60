"""The compressor interface (the paper's Listing 1, in this project's words).

A compressor turns a request's exact full KV into the compressed KV that drafting attends to
(``compress``), keeps it current as verified tokens are committed (``update``), and decides how
attention reads it (each layer's ``CompressedLayer.read``). It never sees drafted KV: drafts are
scratch, and only the verifier's exact K/V of committed tokens reaches ``update``.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

import torch

from vericache_sglang.core.kv import CompressedKV, CompressedLayer, FullKV
from vericache_sglang.core.lookup import LookupParams
from vericache_sglang.core.rows import GrowingRows, RowsField


@dataclass(frozen=True)
class Rope:
    """A Llama-style rotary embedding as plain tensors (cheap to copy with a compressed KV)."""

    inv_freq: torch.Tensor  # [head_dim / 2], float32
    scaling: float = 1.0

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` shaped ``[*positions.shape, head_dim]`` (float32)."""
        freqs = positions.to(torch.float32).unsqueeze(-1) * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self.scaling, emb.sin() * self.scaling

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE ``x`` ``[..., n, d]`` at ``positions`` ``[..., n]`` to post-RoPE (float32 math)."""
        cos, sin = self.cos_sin(positions)
        return apply_rope(x.float(), cos, sin).to(x.dtype)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(positions)
        return unapply_rope(x.float(), cos, sin).to(x.dtype)


class ObservationSource(Protocol):
    """The model behind a prefill, for compressors that need more than the observation window.

    Implemented by the engine (``vericache_sglang.engine.observe``); the SGLang path has none, so
    compressors that need it are refused there at configuration time.
    """

    def prompt_queries(self) -> list[torch.Tensor]:
        """Post-RoPE queries ``[q_heads, tokens, head_dim]`` of every prompt token, per layer."""
        ...

    def tail_queries(self, n: int) -> list[torch.Tensor]:
        """Post-RoPE queries of the prompt's last ``n`` tokens, per layer."""
        ...

    @property
    def tokens(self) -> list[int]:
        """The prompt's token ids."""
        ...

    def rope(self) -> Rope:
        """The model's rotary embedding."""
        ...

    def probe(self, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run ``tokens`` after the prompt over its exact KV (nothing is kept); per layer, their
        post-RoPE queries ``[q_heads, m, head_dim]`` and keys ``[kv_heads, m, head_dim]``."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens); raises ValueError without a tokenizer."""
        ...


@dataclass
class Observation:
    """What the prefill saw that a scoring compressor may use.

    ``queries[layer]`` holds the post-RoPE queries ``[q_heads, window, head_dim]`` of the last
    prompt tokens (SnapKV's observation window); ``source`` reaches the model for more. With
    ``follows`` the queries are of tokens *after* the KV being compressed (a shared prefix scored
    by the request that continues it): they see all of it, no causal mask applies within it.
    """

    queries: list[torch.Tensor] | None = None
    source: ObservationSource | None = None
    follows: bool = False

    def window_queries(self, layer: int, window: int) -> torch.Tensor:
        kept = 0 if self.queries is None else self.queries[layer].shape[1]
        if kept < window and self.source is not None:
            # The prefill computed fewer tokens than the window (a stored prefix was reused): the
            # model recomputes the queries of the prompt's last tokens.
            self.queries = self.source.tail_queries(window)
            kept = self.queries[layer].shape[1]
        if self.queries is None:
            raise ValueError("this compressor needs the prefill's observation queries")
        if kept < window:
            raise ValueError(f"observation window of {window} tokens asked, prefill kept {kept}")
        q = self.queries[layer]
        return q[:, kept - window :]

    def model(self, who: str) -> ObservationSource:
        if self.source is None:
            raise ValueError(f"{who} needs the model behind the prefill (prompt queries, rotary embedding), "
                             "which this path does not provide")
        return self.source


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[..., n, d]`` to the positions of ``cos, sin`` ``[..., n, d]`` (Llama RoPE)."""
    return x * cos + rotate_half(x) * sin


def unapply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The inverse rotation: post-RoPE back to pre-RoPE."""
    return x * cos - rotate_half(x) * sin


class Compressor(ABC):
    """Base class. Subclasses declare ``name``, ``kind`` and a ``Params`` dataclass of defaults."""

    name: ClassVar[str]
    kind: ClassVar[Literal["dropping", "sparse", "quantization", "composed"]]
    mode: ClassVar[Literal["online", "offline"]] = "online"
    Params: ClassVar[type]
    summary: ClassVar[str] = ""
    # What a shared document (compressed before any question, remote prefix caching) is scored by.
    document_scoring: ClassVar[str] = "the document's own queries (no question yet: KVzip's query-agnostic setting)"
    # What the compressor reads besides the KV: "window" (the prefill's last queries), "prompt"
    # (every prompt query), "rope", "probe" (extra forwards), "update_queries" (committed tokens'
    # queries in ``update``). The SGLang path provides "window" only.
    needs: ClassVar[frozenset[str]] = frozenset()
    # Every layer keeps the same token count (one slot set serves all layers in a paged pool).
    uniform_layers: ClassVar[bool] = True
    # ``update`` may drop tokens it kept before (sliding windows, online eviction).
    evicts: ClassVar[bool] = False
    # Re-chooses rows at each verification (``refresh``): verification-guided refresh.
    refreshes: ClassVar[bool] = False
    # Prompt-lookup drafts composed with this compressor's drafts (``+lookup`` in the spec).
    lookup: LookupParams | None = None

    def __init__(self, **params: object):
        self.params = self.Params(**params)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError on parameters outside their domain."""

    @property
    def spec(self) -> str:
        """The canonical spec string (every parameter spelled out), drafting modifiers included."""
        return self.base_spec if self.lookup is None else f"{self.base_spec}+{self.lookup.spec}"

    @property
    def base_spec(self) -> str:
        """The spec of what the compressed KV holds (without drafting modifiers)."""
        fields = dataclasses.asdict(self.params)
        return f"{self.name}:" + ",".join(f"{k}={v}" for k, v in fields.items())

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"

    def refresh(self, ckv: CompressedKV, full: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
                queries: Sequence[torch.Tensor]) -> None:
        """Re-choose rows from a verification (only where ``refreshes``); see ``refresh.py``."""
        raise NotImplementedError(f"{self.name} does not refresh")

    def compress(self, full: FullKV, obs: Observation | None = None) -> CompressedKV:
        layers = [
            self.compress_layer(i, k, v, obs) for i, (k, v) in enumerate(full.layers)
        ]
        return CompressedKV(full.layout, self.base_spec, layers)

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

    @torch.inference_mode()  # entered once here, not by each in-place write below
    def commit(self, ckv: CompressedKV, kv: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor,
               queries: list[torch.Tensor] | None = None) -> None:
        """Fold committed tokens into every layer: ``kv[layer]`` their exact K/V, ``queries[layer]``
        their post-RoPE queries (required when ``"update_queries" in needs``)."""
        if queries is None and "update_queries" in self.needs:
            raise ValueError(f"{self.name} scores committed tokens online: commit needs their queries")
        for layer, (k, v) in enumerate(kv):
            self.update(ckv, layer, k, v, positions, None if queries is None else queries[layer])

    @property
    def update_queries(self) -> bool:
        """Whether ``commit`` needs the committed tokens' queries (callers keep them only then)."""
        return "update_queries" in self.needs

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


class QuantizingCompressor(Compressor):
    """A quantizer; ``quantize_layer`` takes the tokens' positions so it can follow a dropper."""

    kind = "quantization"
    document_scoring = "none needed (every token kept, quantized)"

    def compress_layer(self, layer_idx, k, v, obs: Observation | None) -> CompressedLayer:
        positions = torch.arange(k.shape[1], dtype=torch.int32, device=k.device).expand(k.shape[0], -1)
        return self.quantize_layer(layer_idx, k, v, positions, obs)

    @abstractmethod
    def quantize_layer(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                       obs: Observation | None) -> CompressedLayer:
        """Quantize tokens at ``positions`` ``[kv_heads, n]``; the layer's ``exact_kv`` gives rows by
        column index (the same as positions when nothing was dropped)."""


class KeepingDropper(Compressor):
    """A token dropper that chooses once, at ``compress``: committed tokens are appended unscored."""

    kind = "dropping"

    def update_layer(self, layer: CompressedLayer, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     q: torch.Tensor | None) -> CompressedLayer:
        assert isinstance(layer, DroppedLayer)
        layer.append(k, v, positions)
        return layer


class DroppedLayer(CompressedLayer):
    """A token-dropping layer: the kept tokens' exact K/V and their positions, same count per head."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor):
        if positions.shape != keys.shape[:2]:
            raise ValueError(f"positions {tuple(positions.shape)} do not match keys {tuple(keys.shape)}")
        self.keys, self.values, self.positions = keys, values, positions

    # The kept rows, as views of buffers with room after them (commits append in place).
    keys = RowsField()
    values = RowsField()
    positions = RowsField()

    def _rows(self) -> tuple[GrowingRows, GrowingRows, GrowingRows]:
        return self._keys_rows, self._values_rows, self._positions_rows

    @property
    def reserved_nbytes(self) -> int:
        return sum(r.reserved_nbytes for r in self._rows())

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
        for rows, new in zip(self._rows(), (k, v, pos), strict=True):
            rows.append(new)

    def read_with_drafts(self, offset: int, k: torch.Tensor, v: torch.Tensor,
                         query: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values, _ = self._rows()
        return keys.with_tail(offset, k), values.with_tail(offset, v)

    def keep_columns(self, cols: torch.Tensor) -> None:
        """Keep the columns ``cols`` (``[kv_heads, n]`` indices into this layer's tokens), in place."""
        for rows in self._rows():
            rows.keep(cols)

    def drop_columns(self, first: int, count: int) -> None:
        """Drop columns ``first .. first + count`` of every head, in place, the rest in order."""
        for rows in self._rows():
            rows.drop(first, count)


def check_ratio(name: str, ratio: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"{name}: ratio must be in (0, 1], got {ratio}")
