"""Every place VeriCache patches SGLang, in one file. Each hook exists because 0.5.23 has no
extension point for what it does; everything else goes through SGLang's registries (plugin.py).

1. ``ServerArgs.add_cli_args`` (AFTER): adds ``--enable-vericache`` and ``--vericache-config``.
   ``ServerArgs`` is a sealed msgspec record built from fixed field namespaces; a plugin cannot add
   a field, so the flags live on the parser and their values ride on the record as bookkeeping.
2. ``ServerArgs.from_cli_args`` (AFTER): parses the flags into ``VeriCacheConfig``, stores it as
   ``server_args._vericache`` (underscore bookkeeping survives the pickle to the scheduler
   processes) and sets the SGLang flags VeriCache implies, refusing contradictory ones. This is
   the last moment the record may be written: ``resolve_once`` seals it.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from vericache_sglang.sglang.config import VeriCacheConfig, VeriCacheConfigError

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

ALGORITHM = "VERICACHE"
BACKEND = "vericache"  # the radix-cache and draft attention backend name
ATTR = "_vericache"  # the parsed config on the ServerArgs record


def add_cli_args_hook(result: Any, parser: argparse.ArgumentParser) -> Any:
    group = parser.add_argument_group("VeriCache (lossless decoding on a compressed KV cache)")
    group.add_argument(
        "--enable-vericache",
        action="store_true",
        help="Draft with the compressed KV, verify with the full KV (VeriCache). Implies "
        "--speculative-algorithm VERICACHE and --radix-cache-backend vericache.",
    )
    group.add_argument(
        "--vericache-config",
        type=str,
        default=None,
        help="JSON object (or @file): compressor, horizon, full_kv (device|store|host), store URL, "
        "verification (exact|rejection), reload_room and host_pool_ratio (full_kv=host).",
    )
    return result


def _args_namespace(args: tuple[Any, ...], kwargs: dict[str, Any]) -> argparse.Namespace:
    ns = kwargs.get("args")
    if ns is None:
        ns = next(a for a in reversed(args) if isinstance(a, argparse.Namespace))
    return ns


def from_cli_args_hook(result: ServerArgs, *args: Any, **kwargs: Any) -> ServerArgs:
    ns = _args_namespace(args, kwargs)
    enabled = bool(getattr(ns, "enable_vericache", False))
    raw = getattr(ns, "vericache_config", None)
    if not enabled:
        if raw:
            raise VeriCacheConfigError("--vericache-config is given without --enable-vericache")
        return result
    cfg = VeriCacheConfig.parse(raw)
    apply_implied_flags(result, cfg)
    if cfg.full_kv == "store" and not cfg.store.startswith("memory://"):
        # a store the server cannot use fails the launch here, in seconds, naming it and why,
        # before any scheduler loads the model (each scheduler connects again for itself, and sets
        # an emulated link's rate against its own device: the launcher only opens the store)
        from remote_store import connect_store

        connect_store(cfg.store, memory_bandwidth=lambda: 1.0).close()
    setattr(result, ATTR, cfg)
    return result


def implied_flags(cfg: VeriCacheConfig) -> dict[str, Any]:
    """The SGLang settings VeriCache needs, by ServerArgs field."""
    return {
        "speculative_algorithm": ALGORITHM,
        "speculative_num_draft_tokens": cfg.num_draft_tokens,
        "speculative_num_steps": cfg.horizon,
        "speculative_eagle_topk": 1,  # a chain: one draft per position
        "speculative_use_rejection_sampling": cfg.verification == "rejection",
        "radix_cache_backend": BACKEND,
        # The worker verifies synchronously on the V2 schema; its verify input is not captured.
        "disable_overlap_schedule": True,
        "cuda_graph_backend_decode": "disabled",
    }


# Settings VeriCache cannot serve yet, each with why.
def _unsupported(server_args: ServerArgs, cfg: VeriCacheConfig) -> list[str]:
    problems = []
    if cfg.full_kv in ("host", "store"):
        if int(getattr(server_args, "page_size", 1) or 1) > 1:
            problems.append(f"--page-size > 1 with full_kv={cfg.full_kv}: offloaded rows are moved token by token")
        if str(getattr(server_args, "disaggregation_mode", "null")) not in ("null", "None"):
            problems.append(
                f"prefill/decode disaggregation with full_kv={cfg.full_kv}: a retraction backup would read "
                "rows whose KV is off the device"
            )
    if cfg.verification == "rejection" and getattr(server_args, "enable_deterministic_inference", False):
        problems.append(
            "--enable-deterministic-inference with verification 'rejection': rejection sampling draws its own "
            "noise, so the tokens would not be SGLang's seeded ones (use 'exact')"
        )
    if int(getattr(server_args, "tp_size", 1) or 1) > 1:
        problems.append("tensor parallelism (--tp-size > 1): the compressed pool is not sharded yet")
    if int(getattr(server_args, "pp_size", 1) or 1) > 1:
        problems.append("pipeline parallelism (--pp-size > 1)")
    if getattr(server_args, "enable_lora", None) or getattr(server_args, "lora_paths", None):
        problems.append("LoRA: drafts and verification would need the same adapter routing")
    if getattr(server_args, "disable_radix_cache", False):
        problems.append("--disable-radix-cache: compressed copies live next to the radix tree")
    return problems


def apply_implied_flags(server_args: ServerArgs, cfg: VeriCacheConfig) -> None:
    # ServerArgs' own default lookup (0.5.23): a field still at its default was not given.
    from sglang.srt.server_args import _declared_default

    problems = _unsupported(server_args, cfg)
    if problems:
        raise VeriCacheConfigError("--enable-vericache cannot be combined with: " + "; ".join(problems))
    for name, value in implied_flags(cfg).items():
        current = getattr(server_args, name)
        if current == value:
            continue
        if current != _declared_default(name):
            flag = "--" + name.replace("_", "-")
            raise VeriCacheConfigError(
                f"--enable-vericache sets {flag} {value!r}, but {flag} {current!r} was given; drop one of them"
            )
        setattr(server_args, name, value)


def config_of(server_args: Any) -> VeriCacheConfig | None:
    """The VeriCache config riding on a ServerArgs record, or on a view or stand-in of one that
    resolution hands to callbacks (None when VeriCache is off)."""
    obj = server_args
    for _ in range(4):  # stand-in -> resolving view -> record
        try:
            cfg = object.__getattribute__(obj, ATTR)
        except AttributeError:
            cfg = None
        if isinstance(cfg, VeriCacheConfig):
            return cfg
        inner = None
        for slot in ("_cfg", "_server_args"):
            try:
                inner = object.__getattribute__(obj, slot)
                break
            except AttributeError:
                continue
        if inner is None:
            return None
        obj = inner
    return None


def register_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register("sglang.srt.server_args.ServerArgs.add_cli_args", add_cli_args_hook, HookType.AFTER)
    HookRegistry.register("sglang.srt.server_args.ServerArgs.from_cli_args", from_cli_args_hook, HookType.AFTER)
