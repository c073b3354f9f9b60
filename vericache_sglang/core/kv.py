"""KV layout and the two KV containers: the exact full KV and a compressor's compressed KV.

Tensors are per request and per layer, shaped ``[kv_heads, tokens, head_dim]``; keys are stored
after RoPE, so a kept token keeps its original rotation wherever it sits in a compressed cache.
"""

from __future__ import annotations

import copy
import hashlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float64: "float64",
}
DTYPES_BY_NAME = {name: dtype for dtype, name in _DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported KV dtype {dtype}; supported: {sorted(DTYPES_BY_NAME)}") from None


@dataclass(frozen=True)
class KVLayout:
    """What one token's KV looks like for one model: enough to size, key and check it."""

    model_id: str  # model name plus a digest of its weights
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token_layer(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def bytes_per_token(self) -> int:
        return self.num_layers * self.bytes_per_token_layer

    def describe(self) -> str:
        return f"{self.model_id}|L{self.num_layers}|H{self.num_kv_heads}|D{self.head_dim}|{dtype_name(self.dtype)}"

    def digest(self) -> str:
        """A short stable digest of the layout (model identity included), for store keys."""
        return hashlib.blake2b(self.describe().encode(), digest_size=8).hexdigest()

    def check_layer(self, k: torch.Tensor, v: torch.Tensor) -> None:
        for name, t in (("keys", k), ("values", v)):
            if t.dim() != 3 or t.shape[0] != self.num_kv_heads or t.shape[2] != self.head_dim:
                raise ValueError(
                    f"{name} of shape {tuple(t.shape)} do not match the layout "
                    f"[{self.num_kv_heads}, tokens, {self.head_dim}]"
                )
            if t.dtype != self.dtype:
                raise ValueError(f"{name} dtype {t.dtype} does not match the layout dtype {self.dtype}")
        if k.shape != v.shape:
            raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} differ in shape")


class FullKV:
    """The exact KV of a token span, all layers. Lives off the accelerator (store) or transiently on it."""

    def __init__(self, layout: KVLayout, layers: list[tuple[torch.Tensor, torch.Tensor]]):
        if len(layers) != layout.num_layers:
            raise ValueError(f"{len(layers)} layers given, layout has {layout.num_layers}")
        lengths = set()
        for k, v in layers:
            layout.check_layer(k, v)
            lengths.add(k.shape[1])
        if len(lengths) > 1:
            raise ValueError(f"layers hold different token counts: {sorted(lengths)}")
        self.layout = layout
        self.layers = layers

    @property
    def num_tokens(self) -> int:
        return self.layers[0][0].shape[1]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)

    def slice(self, start: int, end: int) -> FullKV:
        return FullKV(self.layout, [(k[:, start:end], v[:, start:end]) for k, v in self.layers])


class CompressedLayer(ABC):
    """One layer of a compressed KV, in whatever form its compressor keeps it."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """True bytes held on the device for this layer (packed codes, scales, indices)."""

    @property
    @abstractmethod
    def num_tokens(self) -> int:
        """Tokens each KV head attends to (the same for every head of the layer)."""

    @abstractmethod
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[kv_heads, num_tokens, head_dim]`` in the model dtype, for attention."""

    def read_for(self, query: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """What the draft queries ``[q_heads, n, head_dim]`` attend to; query-aware layers (Quest)
        read a subset, the others everything."""
        return self.read()

    def exact_kv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(positions [kv_heads, m], keys, values [kv_heads, m, head_dim])`` of the tokens this layer
        holds bit-exactly, or None. What the device holds exactly need not cross the link again."""
        return None

    def held_positions(self) -> torch.Tensor | None:
        """Positions ``[kv_heads, m]`` of every token this layer holds in any form, exact or
        approximated (a row added beside one of them would count that token twice in attention),
        or None. By default the exact ones; a composition says which tokens it holds quantized. (A
        quantizer alone holds every token, and refresh, the caller, refuses it.)"""
        exact = self.exact_kv()
        return None if exact is None else exact[0]

    @property
    def reserved_nbytes(self) -> int:
        """Bytes held past the content as room for appends and draft rows (not in ``nbytes``)."""
        return 0

    def read_with_drafts(
        self, offset: int, k: torch.Tensor, v: torch.Tensor, query: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """What a draft window's new tokens attend to, this layer's keys/values followed by the
        window's own (``offset`` written before, then ``k``/``v`` ``[kv_heads, n, head_dim]``),
        written in place into room after this layer's rows; None where the layer keeps no such
        room (the caller concatenates). The window's rows vanish at the next commit."""
        return None


@dataclass
class CompressedKV:
    """A request's compressed KV: what drafting attends to, kept on the accelerator."""

    layout: KVLayout
    spec: str
    layers: list[CompressedLayer]
    # Bumped by each draft window opened over this KV: a window's rows live in the layers' room,
    # so only the newest window may draft (an older one would read the newer one's rows).
    draft_epoch: int = 0

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def tokens_per_layer(self) -> list[int]:
        return [layer.num_tokens for layer in self.layers]

    def clone(self) -> CompressedKV:
        """A deep copy (a shared prefix's compressed KV is copied into each request that uses it)."""
        return copy.deepcopy(self)
