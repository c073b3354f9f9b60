"""Compressors by spec string: ``name[:key=value[,key=value...]]``, e.g. ``snapkv:ratio=0.125``, or a
dropper then a quantizer joined by ``+``: ``snapkv:ratio=0.25+kivi:bits=4``. Drafting modifiers
follow, joined by ``+`` too: ``refresh`` (rows re-chosen at each verification, its own ratio of
the prompt on top of the compressor's) then ``lookup`` (prompt-lookup drafts composed with the
compressed KV's): ``snapkv:ratio=0.0625+refresh:ratio=0.0625+lookup``."""

from __future__ import annotations

import dataclasses
import typing

from vericache_sglang.core.compress.base import Compressor, DroppedLayer
from vericache_sglang.core.compress.compose import Composed
from vericache_sglang.core.compress.drop.adakv import AdaKV
from vericache_sglang.core.compress.drop.expected_attention import ExpectedAttention
from vericache_sglang.core.compress.drop.h2o import H2O
from vericache_sglang.core.compress.drop.knorm import KNorm
from vericache_sglang.core.compress.drop.kvzip import KVzip
from vericache_sglang.core.compress.drop.pyramidkv import PyramidKV
from vericache_sglang.core.compress.drop.quest import Quest
from vericache_sglang.core.compress.drop.snapkv import SnapKV
from vericache_sglang.core.compress.drop.streamingllm import StreamingLLM
from vericache_sglang.core.compress.drop.tova import TOVA
from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.compress.quant.kivi import KIVI
from vericache_sglang.core.compress.quant.kvquant import KVQuant
from vericache_sglang.core.compress.quant.tokenquant import Int4, Int8, RotateKV
from vericache_sglang.core.compress.refresh import Refreshed
from vericache_sglang.core.lookup import LookupParams

COMPRESSORS: dict[str, type[Compressor]] = {
    cls.name: cls
    for cls in (
        StreamingLLM,
        H2O,
        SnapKV,
        PyramidKV,
        AdaKV,
        ExpectedAttention,
        TOVA,
        KNorm,
        KVzip,
        Quest,
        KIVI,
        Int8,
        Int4,
        KVQuant,
        RotateKV,
    )
}

__all__ = [
    "COMPRESSORS",
    "MODIFIERS",
    "MODIFIER_SUMMARIES",
    "RECOMMENDED",
    "Compressor",
    "DroppedLayer",
    "Observation",
    "SpecError",
    "describe_compressors",
    "parse_spec",
]


# Drafting modifiers, in the order a spec gives them, after the compressor: name -> parameters.
MODIFIERS: dict[str, type] = {"refresh": Refreshed.Params, "lookup": LookupParams}
MODIFIER_SUMMARIES = {
    "refresh": "verification-guided refresh: its ratio of the prompt in rows re-chosen at each verification "
    "from the verify pass's attention, swapped in from the full KV already on the device",
    "lookup": "prompt-lookup drafts: the continuation of a recurring n-gram of the context, composed with the "
    "compressed KV's drafts: one forward checks a whole chain, so drafts cost fewer forwards "
    "(trust=n: a match of n+ tokens is drafted even where the model disagrees)",
}


# The configuration the README recommends, chosen on the deployment measure (at most 1/8 of a
# 16-bit full KV's bytes, scales, residual and positions counted) on the tuning prompts and
# measured once on the held-out ones (benchmarks/results/drafting_deploy.md): SnapKV's choice of
# 27% of the prompt in KIVI 4-bit codes, 3% refreshed in full precision at each verification, and
# prompt lookup checked by the model (drafts unchanged, fewer draft forwards). The SGLang worker
# runs it too (quantized draft pool).
RECOMMENDED = "snapkv:ratio=0.27+kivi:bits=4,group=64,residual=64+refresh:ratio=0.03,span=16+lookup:trust=0"


class SpecError(ValueError):
    """An unknown or malformed compressor spec."""


def _choices() -> str:
    return ", ".join(sorted(COMPRESSORS))


def _param_help(params_cls: type) -> str:
    return ", ".join(f"{f.name} (default {f.default})" for f in dataclasses.fields(params_cls))


def _convert(name: str, params_cls: type, key: str, raw: str) -> object:
    hints = typing.get_type_hints(params_cls)
    kind = hints[key]
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError(raw)
            return raw.lower() in ("true", "1")
        return kind(raw)
    except ValueError:
        raise SpecError(f"{name}: parameter {key}={raw!r} is not a valid {kind.__name__}") from None


def parse_spec(spec: str) -> Compressor:
    """Build a compressor from its spec; a bad spec raises SpecError naming the choices."""
    if not isinstance(spec, str) or not spec.strip():
        raise SpecError(f"empty compressor spec; choices: {_choices()}")
    parts = spec.split("+")
    mods: dict[str, str] = {}
    while parts and _name(parts[-1]) in MODIFIERS:
        part = parts.pop()
        name = _name(part)
        if name in mods:
            raise SpecError(f"modifier {name!r} given twice in spec {spec!r}")
        if any(list(MODIFIERS).index(name) > list(MODIFIERS).index(m) for m in mods):
            raise SpecError(f"spec {spec!r}: modifiers go in the order {' then '.join(MODIFIERS)}")
        mods[name] = part
    if not parts:
        raise SpecError(f"spec {spec!r} names no compressor before its modifiers; choices: {_choices()}")
    if any(_name(p) in MODIFIERS for p in parts):
        raise SpecError(f"spec {spec!r}: modifiers ({', '.join(MODIFIERS)}) go after the compressor")
    compressor = _parse_compressor(spec, parts)
    try:
        if "refresh" in mods:
            compressor = Refreshed(compressor, **_params("refresh", Refreshed.Params, mods["refresh"]))
        if "lookup" in mods:
            lookup = LookupParams(**_params("lookup", LookupParams, mods["lookup"]))
            lookup.validate()
            compressor.lookup = lookup
    except ValueError as e:
        raise SpecError(str(e)) from None
    return compressor


def _name(part: str) -> str:
    return part.strip().partition(":")[0].strip().lower()


def _parse_compressor(spec: str, parts: list[str]) -> Compressor:
    if len(parts) == 1:
        return _parse_one(parts[0])
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
    name = _name(spec)
    cls = COMPRESSORS.get(name)
    if cls is None:
        raise SpecError(
            f"unknown compressor {name!r} in spec {spec!r}; choices: {_choices()}; "
            f"modifiers after it: {', '.join(MODIFIERS)}"
        )
    params = _params(name, cls.Params, spec)
    try:
        return cls(**params)
    except ValueError as e:
        raise SpecError(str(e)) from None


def _params(name: str, params_cls: type, spec: str) -> dict[str, object]:
    """``key=value`` pairs after ``name:`` in ``spec``, converted to ``params_cls``'s field types."""
    _, colon, rest = spec.strip().partition(":")
    fields = {f.name for f in dataclasses.fields(params_cls)}
    params: dict[str, object] = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq or not key or not raw.strip():
            raise SpecError(f"malformed parameter {item!r} in spec {spec!r}: expected key=value")
        if key not in fields:
            raise SpecError(f"{name} has no parameter {key!r}; parameters: {_param_help(params_cls)}")
        if key in params:
            raise SpecError(f"parameter {key!r} given twice in spec {spec!r}")
        params[key] = _convert(name, params_cls, key, raw.strip())
    if colon and not params:
        raise SpecError(f"malformed spec {spec!r}: parameters expected after ':'")
    return params


def describe_compressors() -> list[dict[str, object]]:
    """Every compressor with its kind, parameters and defaults (for ``vericache compressors``)."""
    out = []
    for name, cls in sorted(COMPRESSORS.items()):
        hints = typing.get_type_hints(cls.Params)
        out.append(
            {
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
            }
        )
    return out
