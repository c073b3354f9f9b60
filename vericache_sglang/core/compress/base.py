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
from typing import ClassVar, Literal

import torch

from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.kv import CompressedKV, CompressedLayer, FullKV
from vericache_sglang.core.lookup import LookupParams
from vericache_sglang.core.rows import GrowingRows, RowsField

# dataclass field metadata: the parameter is spelled in the canonical spec only when set
UNSET_OMITTED = "unset_omitted"


class Compressor(ABC):
    """Base class. A new compressor subclasses it (or ``KeepingDropper``, ``QuantizingCompressor``) and is
    added to ``COMPRESSORS`` in ``compress/__init__.py``.

    Class-level settings, declared on the class (``describe_compressors`` and the SGLang config's
    ``sglang_compressors`` read them from the class, without an instance):

    - ``name`` (required): the registry key and the spec's prefix (``snapkv:ratio=...``); read by
      ``COMPRESSORS``, ``base_spec`` and the error messages.
    - ``kind`` (required; ``KeepingDropper`` and ``QuantizingCompressor`` set it): ``"dropping"``,
      ``"sparse"``, ``"quantization"`` or ``"composed"``. ``Composed`` takes a ``"dropping"`` first part,
      ``Refreshed`` refuses ``"quantization"``, ``sglang/config.py`` lets the SGLang worker draft over
      all but ``"sparse"``; reported by ``describe_compressors``.
    - ``Params`` (required): a dataclass, one field per spec parameter with its default, documented as the
      ``*Params`` classes here are. ``__init__`` builds ``self.params`` from it; ``parse_spec`` converts each
      ``key=value`` by the field's type (so ``int``, ``float``, ``str`` or ``bool``); ``base_spec`` spells
      every field out; ``describe_compressors`` (``vericache compressors``) lists them.
    - ``mode`` (``"online"``): ``"offline"`` where compressing runs extra model forwards (KVzip). Reported by
      ``describe_compressors``, carried by ``Composed`` and ``Refreshed``; nothing branches on it.
    - ``summary`` (``""``): one line, reported by ``describe_compressors``.
    - ``document_scoring``: what a shared document, compressed before any question, is scored by; reported
      by ``describe_compressors``.
    - ``needs`` (empty): what compressing or committing reads besides the KV, through ``Observation``:
      ``"window"`` (the prefill's last queries), ``"prompt"`` (every prompt query), ``"rope"``, ``"probe"``
      (extra forwards), ``"update_queries"`` (committed tokens' queries in ``update``). Read by ``commit``
      and ``update_queries`` here, by ``sglang/config.py`` (the SGLang worker provides ``"window"`` and ``"probe"`` and
      refuses the rest, save refresh's own ``"update_queries"``) and by ``describe_compressors``.
    - ``uniform_layers`` (``True``): every layer keeps the same token count (an instance may set it from its
      parameters, as KVzip's ``layerwise``). The SGLang worker drafts ``False`` through torch_native only
      (``sglang/draft/layer_rows.py``, ``config.check_layer_budgets``); reported by ``describe_compressors``.
    - ``evicts`` (``False``): ``update`` may drop tokens it kept before. ``Composed`` refuses an evicting
      dropper before a quantizer; reported by ``describe_compressors`` as ``evicts_while_decoding``.
    - ``refreshes`` (``False``): rows re-chosen at each verification by ``refresh``, which the engine
      (``engine/request.py``), the SGLang worker and ``bench/acceptance.py`` then call. Only
      ``Refreshed`` sets it.
    - ``lookup`` (``None``; an instance attribute, not a ClassVar): the ``+lookup`` drafting parameters,
      set by ``parse_spec``; read by ``spec``, ``engine/request.py``, the SGLang worker and
      ``sglang/config.py``. A compressor leaves it alone.

    Derived, not overridden: ``update_queries`` (``"update_queries" in needs``: whether callers keep the
    committed tokens' queries for ``commit``; read by the engine, ``Refreshed``, ``sglang/config.py`` and
    ``bench/acceptance.py``) and ``spec``. ``base_spec`` is overridden only where the parameters live in the
    parts (``Composed``, ``Refreshed``). ``Composed`` and ``Refreshed`` also set the settings per instance,
    from their parts.

    Methods a new compressor implements:

    - ``validate()``: raise ValueError on parameters outside their domain (``parse_spec`` reports it as a
      SpecError); ``check_ratio`` checks a ``ratio``.
    - ``compress_layer(layer_idx, k, v, obs)``: one layer's exact KV ``[kv_heads, tokens, head_dim]`` to a
      ``CompressedLayer``. A quantizer implements ``quantize_layer`` (the same, with ``positions``) instead;
      where the layers' budgets depend on each other (PyramidKV, KVzip), override ``compress(full, obs)``
      and make ``compress_layer`` raise NotImplementedError.
    - ``update_layer(layer, k, v, positions, q)``: fold committed tokens' exact K/V into a layer
      (``KeepingDropper`` appends them unscored); ``q`` may be None unless ``"update_queries" in needs``.
    - ``refresh(ckv, full, queries)``: only with ``refreshes``.
    - Its layer: ``DroppedLayer`` for kept exact rows, else a ``CompressedLayer`` subclass (``core/kv.py``)
      with ``nbytes``, ``num_tokens`` and ``read``, and ``read_for``, ``exact_kv``, ``held_positions``,
      ``reserved_nbytes``, ``read_with_drafts`` where the defaults do not fit.
    """

    name: ClassVar[str]
    kind: ClassVar[Literal["dropping", "sparse", "quantization", "composed"]]
    mode: ClassVar[Literal["online", "offline"]] = "online"
    Params: ClassVar[type]
    summary: ClassVar[str] = ""
    # What a shared document (compressed before any question, remote prefix caching) is scored by.
    document_scoring: ClassVar[str] = "the document's own queries (no question yet: KVzip's query-agnostic setting)"
    # What the compressor reads besides the KV: "window" (the prefill's last queries), "prompt"
    # (every prompt query), "rope", "probe" (extra forwards), "update_queries" (committed tokens'
    # queries in ``update``). The SGLang path provides "window" and "probe".
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
        """The spec of what the compressed KV holds (without drafting modifiers). A parameter marked
        ``UNSET_OMITTED`` is left out at its default, so adding one keeps existing specs' strings
        (stored compressed copies are keyed by them)."""
        params = self.params
        spelled = (
            f"{f.name}={getattr(params, f.name)}"
            for f in dataclasses.fields(params)
            if not (f.metadata.get(UNSET_OMITTED) and getattr(params, f.name) == f.default)
        )
        return f"{self.name}:" + ",".join(spelled)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.spec}>"

    def refresh(
        self,
        ckv: CompressedKV,
        full: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
        queries: Sequence[torch.Tensor],
    ) -> None:
        """Re-choose rows from a verification (only where ``refreshes``); see ``refresh.py``."""
        raise NotImplementedError(f"{self.name} does not refresh")

    def compress(self, full: FullKV, obs: Observation | None = None) -> CompressedKV:
        layers = [self.compress_layer(i, k, v, obs) for i, (k, v) in enumerate(full.layers)]
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
    def commit(
        self,
        ckv: CompressedKV,
        kv: list[tuple[torch.Tensor, torch.Tensor]],
        positions: torch.Tensor,
        queries: list[torch.Tensor] | None = None,
    ) -> None:
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
    def quantize_layer(
        self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, obs: Observation | None
    ) -> CompressedLayer:
        """Quantize tokens at ``positions`` ``[kv_heads, n]``; the layer's ``exact_kv`` gives rows by
        column index (the same as positions when nothing was dropped)."""


class KeepingDropper(Compressor):
    """A token dropper that chooses once, at ``compress``: committed tokens are appended unscored."""

    kind = "dropping"

    def update_layer(
        self, layer: CompressedLayer, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, q: torch.Tensor | None
    ) -> CompressedLayer:
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

    def read_with_drafts(
        self, offset: int, k: torch.Tensor, v: torch.Tensor, query: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
