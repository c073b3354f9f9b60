"""Compressors by spec string: ``name[:key=value[,key=value...]]``, e.g. ``snapkv:ratio=0.125``, or a
dropper then a quantizer joined by ``+``: ``snapkv:ratio=0.25+kivi:bits=4``."""

from __future__ import annotations

import dataclasses
import typing

from vericache_sglang.core.compress.adakv import AdaKV
from vericache_sglang.core.compress.base import Compressor, DroppedLayer, Observation
from vericache_sglang.core.compress.compose import Composed
from vericache_sglang.core.compress.expected_attention import ExpectedAttention
from vericache_sglang.core.compress.h2o import H2O
from vericache_sglang.core.compress.kivi import KIVI
from vericache_sglang.core.compress.knorm import KNorm
from vericache_sglang.core.compress.kvquant import KVQuant
from vericache_sglang.core.compress.kvzip import KVzip
from vericache_sglang.core.compress.pyramidkv import PyramidKV
from vericache_sglang.core.compress.quest import Quest
from vericache_sglang.core.compress.snapkv import SnapKV
from vericache_sglang.core.compress.streamingllm import StreamingLLM
from vericache_sglang.core.compress.tokenquant import Int4, Int8, RotateKV
from vericache_sglang.core.compress.tova import TOVA

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (StreamingLLM, H2O, SnapKV, PyramidKV, AdaKV, ExpectedAttention, TOVA, KNorm, KVzip, Quest,
                KIVI, Int8, Int4, KVQuant, RotateKV)
}

__all__ = [
    "COMPRESSORS",
    "Compressor",
    "DroppedLayer",
    "Observation",
    "SpecError",
    "describe_compressors",
    "parse_spec",
]


class SpecError(ValueError):
    """An unknown or malformed compressor spec."""


def _choices() -> str:
    return ", ".join(sorted(COMPRESSORS))


def _param_help(cls: type[Compressor]) -> str:
    return ", ".join(f"{f.name} (default {f.default})" for f in dataclasses.fields(cls.Params))


def _convert(cls: type[Compressor], key: str, raw: str) -> object:
    hints = typing.get_type_hints(cls.Params)
    kind = hints[key]
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        return kind(raw)
    except ValueError:
        raise SpecError(f"{cls.name}: parameter {key}={raw!r} is not a valid {kind.__name__}") from None


def parse_spec(spec: str) -> Compressor:
    """Build a compressor from its spec; a bad spec raises SpecError naming the choices."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(f"empty compressor spec; choices: {_choices()}")
    parts = spec.split("+")
    if len(parts) == 1:
        return _parse_one(spec)
    if len(parts) != 2:
        raise SpecError(f"composition {spec!r}: exactly two parts, a dropper then a quantizer")
    first, second = (_parse_one(p) for p in parts)
    try:
        return Composed(first, second)
    except ValueError as e:
        raise SpecError(str(e)) from None


def _parse_one(spec: str) -> Compressor:
    if not spec.strip():
        raise SpecError(f"empty part in compressor spec; choices: {_choices()}")
    name, colon, rest = spec.strip().partition(":")
    name = name.strip().lower()
    cls = COMPRESSORS.get(name)
    if cls is None:
        raise SpecError(f"unknown compressor {name!r} in spec {spec!r}; choices: {_choices()}")
    fields = {f.name for f in dataclasses.fields(cls.Params)}
    params: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key or not raw.strip():
            raise SpecError(f"malformed parameter {item!r} in spec {spec!r}: expected key=value")
        if key not in fields:
            raise SpecError(f"{name} has no parameter {key!r}; parameters: {_param_help(cls)}")
        if key in params:
            raise SpecError(f"parameter {key!r} given twice in spec {spec!r}")
        params[key] = _convert(cls, key, raw.strip())
    if colon and not params:
        raise SpecError(f"malformed spec {spec!r}: parameters expected after ':'")
    try:
        return cls(**params)
    except ValueError as e:
        raise SpecError(str(e)) from None


def describe_compressors() -> list[dict[str, object]]:
    """Every compressor with its kind, parameters and defaults (for ``vericache compressors``)."""
    out = []
    for name, cls in sorted(COMPRESSORS.items()):
        hints = typing.get_type_hints(cls.Params)
        out.append({
            "name": name,
            "kind": cls.kind,
            "mode": cls.mode,
            "summary": cls.summary,
            "needs": sorted(cls.needs),
            "document_scoring": cls.document_scoring,
            "uniform_layers": cls.uniform_layers,
            "evicts_while_decoding": cls.evicts,
            "parameters": {
                f.name: {"type": hints[f.name].__name__, "default": f.default}
                for f in dataclasses.fields(cls.Params)
            },
        })
    return out
