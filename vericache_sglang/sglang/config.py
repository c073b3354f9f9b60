"""``--vericache-config``: what VeriCache adds to an SGLang server, parsed and checked once.

Pure Python (no sglang import): the launcher, the scheduler subprocesses and the tests all read the
same dataclass. The JSON object may be given inline or as ``@path``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from vericache_sglang.core.accept import VERIFICATIONS, Verification
from vericache_sglang.core.compress import COMPRESSORS, Compressor, SpecError, parse_spec

# Where a request's full KV lives between verifications. "device": in SGLang's own KV pool
# (self-speculation; no memory saved). "store": only in the full-KV store (``store``: our gRPC
# store, Redis, LMCache), written after prefill and after each verification, its device slots
# freed, and fetched for each verification while the draft passes run; what the store does not
# deliver is recomputed from the committed tokens. "host": the same with SGLang's host pool as the
# tier. Both reload at the time the staggered scheduler plans (tested on CPU in real servers; on a
# GPU unverified).
FullKVPlace = Literal["device", "store", "host"]
FULL_KV_PLACES: tuple[str, ...] = get_args(FullKVPlace)
MAX_HORIZON = 64
# How each attention backend verifies a chain (``forward.py``): its own TARGET_VERIFY with SGLang's
# custom mask ("masked", GPU), or through the plugin's chain backend ("chain", CPU).
MASKED_VERIFY_BACKENDS = ("flashinfer", "triton", "fa3")
CHAIN_VERIFY_BACKENDS = ("torch_native", "vericache_torch_native")


def verify_convention(backend: str | None) -> str:
    """``"masked"`` or ``"chain"`` for an attention backend name; VeriCacheConfigError for any other."""
    if backend in MASKED_VERIFY_BACKENDS:
        return "masked"
    if backend in CHAIN_VERIFY_BACKENDS:
        return "chain"
    raise VeriCacheConfigError(
        f"VeriCache verifies with the attention backends "
        f"{', '.join(MASKED_VERIFY_BACKENDS + CHAIN_VERIFY_BACKENDS)}; got {backend!r}"
    )


class VeriCacheConfigError(ValueError):
    """A ``--vericache-config`` that cannot be served, with the reason."""


def check_layer_budgets(compressor: Compressor, backend: str | None) -> None:
    """Per-layer budgets draft through backends that read each layer's row at its call
    (``draft/layer_rows.py``); the masked GPU backends precompute one set of indices a pass."""
    if not compressor.uniform_layers and backend not in CHAIN_VERIFY_BACKENDS:
        raise VeriCacheConfigError(
            f"vericache-config compressor {compressor.spec!r} keeps different token counts per layer, which "
            f"the draft pass reads through {', '.join(CHAIN_VERIFY_BACKENDS)} only, not {backend!r}; "
            "pick a uniform budget (kvzip: layerwise=true; snapkv) or --decode-attention-backend torch_native"
        )


def _unsupported_by_worker(compressor: Compressor | type[Compressor]) -> str:
    """Why the SGLang worker cannot run ``compressor`` (empty when it can)."""
    extra = compressor.needs - {"window", "probe"}  # probe: step/probe.py
    inner = getattr(compressor, "inner", None)
    if getattr(compressor, "refreshes", False) and inner is not None and not inner.update_queries:
        extra -= {"update_queries"}  # refresh's alone: the worker captures the verify pass's queries
    if extra:
        return (
            f"it needs {', '.join(sorted(extra))} from the model, and the worker captures only the "
            "prefill's last queries and probe forwards"
        )
    return ""


# What the draft pool holds: kept exact rows (a dropper) or codes dequantized a layer at a time
# (a quantizer, alone or after a dropper: ``draft/dequant_pool.py``).
WORKER_KINDS = ("dropping", "quantization", "composed")


def sglang_compressors() -> list[str]:
    """The registered compressors the SGLang worker can draft with (quantizers also after a dropper)."""
    return [
        name
        for name, cls in sorted(COMPRESSORS.items())
        if cls.kind in WORKER_KINDS and not _unsupported_by_worker(cls)
    ]


@dataclass(frozen=True)
class VeriCacheConfig:
    compressor: str = "snapkv:ratio=0.25"
    horizon: int = 16  # drafted tokens per verification
    full_kv: FullKVPlace = "store"
    store: str = "memory://"  # full-KV store URL (remote_store.open_store)
    verification: Verification = "exact"
    reload_room: float = 0.25  # full_kv host or store: share of the KV pool held for reloads
    host_pool_ratio: float = 4.0  # full_kv=host: host pool tokens per device pool token

    def __post_init__(self) -> None:
        try:
            compressor = parse_spec(self.compressor)
        except SpecError as e:
            raise VeriCacheConfigError(f"vericache-config compressor: {e}") from None
        if compressor.kind not in WORKER_KINDS:
            # a sparse (query-aware) layer reads a different subset per query: no one KV row per request
            raise VeriCacheConfigError(
                f"vericache-config compressor {compressor.spec!r} is a {compressor.kind} compressor; the SGLang "
                f"worker drafts over token droppers and quantizers ({', '.join(sglang_compressors())})"
            )
        why = _unsupported_by_worker(compressor)
        if why:
            raise VeriCacheConfigError(
                f"vericache-config compressor {compressor.spec!r}: {why}; the SGLang worker "
                f"supports {', '.join(sglang_compressors())}"
            )
        object.__setattr__(self, "compressor", compressor.spec)
        if isinstance(self.horizon, bool) or not isinstance(self.horizon, int):
            raise VeriCacheConfigError(f"vericache-config horizon must be an integer, got {self.horizon!r}")
        if not 1 <= self.horizon <= MAX_HORIZON:
            raise VeriCacheConfigError(f"vericache-config horizon must be in [1, {MAX_HORIZON}], got {self.horizon}")
        for name, lo, hi in (("reload_room", 0.0, 1.0), ("host_pool_ratio", 0.0, float("inf"))):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not lo < value < hi:
                raise VeriCacheConfigError(f"vericache-config {name} must be a number in ({lo}, {hi}), got {value!r}")
        if self.full_kv not in FULL_KV_PLACES:
            raise VeriCacheConfigError(
                f"vericache-config full_kv must be one of {', '.join(FULL_KV_PLACES)}, got {self.full_kv!r}"
            )
        if compressor.lookup is not None and not compressor.lookup.model:
            # lookup alone drafts with no pass at all over a compressed KV the worker still keeps
            raise VeriCacheConfigError(
                f"vericache-config compressor {compressor.spec!r}: the SGLang worker runs +lookup composed with "
                "compressed-KV drafts (model=True)"
            )
        if self.verification not in VERIFICATIONS:
            renamed = " ('greedy' is now 'exact', the engine's name)" if self.verification == "greedy" else ""
            raise VeriCacheConfigError(
                f"vericache-config verification must be one of {', '.join(VERIFICATIONS)}, "
                f"got {self.verification!r}{renamed}"
            )
        if not isinstance(self.store, str) or "://" not in self.store:
            raise VeriCacheConfigError(f"vericache-config store must be a store URL, got {self.store!r}")
        from remote_store import SCHEMES

        scheme = self.store.split("://", 1)[0]
        if scheme not in SCHEMES:
            raise VeriCacheConfigError(f"vericache-config store scheme {scheme!r} is not one of {', '.join(SCHEMES)}")

    @property
    def num_draft_tokens(self) -> int:
        """SGLang's ``speculative_num_draft_tokens``: the verify width, the drafts plus the seed."""
        return self.horizon + 1

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def parse(cls, text: str | None) -> VeriCacheConfig:
        """From the flag's value: a JSON object, ``@file`` holding one, or empty for the defaults."""
        if text is None or not str(text).strip():
            return cls()
        text = str(text).strip()
        if text.startswith("@"):
            path = Path(text[1:])
            try:
                text = path.read_text()
            except OSError as e:
                raise VeriCacheConfigError(f"vericache-config file {path}: {e.strerror}") from None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise VeriCacheConfigError(f"vericache-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise VeriCacheConfigError(f"vericache-config must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise VeriCacheConfigError(
                f"vericache-config has unknown keys {unknown}; known keys: {', '.join(sorted(known))}"
            )
        return cls(**raw)
