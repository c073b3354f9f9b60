"""The ``VERICACHE`` speculative algorithm as SGLang's scheduler sees it.

``SpeculativeAlgorithm.register`` stores a ``CustomSpecAlgo``; 0.5.23's scheduler also calls
``carries_draft_hidden_states`` (disaggregation init), ``create_future_map`` (the always-on
FutureMap) and ``need_topk`` (overlap utils), which ``CustomSpecAlgo`` lacks. This subclass adds
them, mirroring the enum's versions for an algorithm with no draft model and a chain (topk 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang.srt.speculative.spec_registry import CustomSpecAlgo

from vericache_sglang.sglang.config import VeriCacheConfigError, verify_convention
from vericache_sglang.sglang.hooks import ALGORITHM, config_of

if TYPE_CHECKING:
    import torch
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.server_args import ServerArgs


class VeriCacheSpecAlgo(CustomSpecAlgo):
    def carries_draft_hidden_states(self) -> bool:
        return False  # drafts come from the target model itself; no hidden states travel

    def need_topk(self) -> bool:
        return False  # chain drafting

    def has_draft_kv(self) -> bool:
        return False  # the compressed pool is private to the worker, not a draft KV in SGLang's pool

    def create_future_map(
        self,
        device: torch.device | str,
        req_to_token_pool: ReqToTokenPool,
        needs_cpu_seq_lens: bool = True,
        needs_confidence_relay: bool = False,
    ) -> FutureMap:
        from sglang.srt.managers.overlap_utils import FutureMap

        return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens, needs_confidence_relay)


def validate_server_args(server_args: Any) -> None:
    """Runs during SGLang's resolution: the checks that need the model's configuration."""
    cfg = config_of(server_args)
    if cfg is None:
        raise VeriCacheConfigError(
            f"--speculative-algorithm {ALGORITHM} is set by --enable-vericache; pass that flag instead"
        )
    _check_attention_backends(server_args)
    if str(getattr(server_args, "model_path", "")).lower() in ("", "none", "dummy"):
        return
    from sglang.srt.arg_groups.model_override_base import model_config_of
    from sglang.srt.configs.model_config import AttentionArch

    model = model_config_of(server_args)
    hf = model.hf_text_config
    problems = []
    if model.attention_arch == AttentionArch.MLA:
        problems.append("MLA attention (a latent KV the compressors do not read)")
    if (
        model.attention_arch == AttentionArch.SSM
        or getattr(model, "is_hybrid_ssm", False)
        or getattr(model, "mamba2_config", None) is not None
    ):
        problems.append("Mamba / state-space layers (no KV to compress)")
    window = getattr(hf, "sliding_window", None)
    if getattr(model, "is_hybrid_swa", False) or (window and getattr(hf, "use_sliding_window", True)):
        problems.append(f"sliding-window attention (window {window}): the verifier would not read the full KV")
    if problems:
        raise VeriCacheConfigError(f"VeriCache cannot serve {model.model_path}: " + "; ".join(problems))


def _check_attention_backends(server_args: Any) -> None:
    """One backend prefills, drafts and verifies, and it must be one VeriCache can verify with.
    A backend left for SGLang to choose is checked when the worker starts (``forward.py``)."""
    from sglang.srt.arg_groups.model_override_base import attention_backends_of

    prefill, decode = attention_backends_of(server_args)
    if prefill and decode and prefill != decode:
        raise VeriCacheConfigError(
            f"VeriCache needs one attention backend for prefill, drafting and verification; got prefill {prefill!r}, "
            f"decode {decode!r}"
        )
    if prefill or decode:
        verify_convention(prefill or decode)


def worker_factory(server_args: ServerArgs) -> type:
    from vericache_sglang.sglang.step.worker import VeriCacheWorker

    return VeriCacheWorker
