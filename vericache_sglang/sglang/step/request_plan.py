"""How the worker serves each request, decided once when its prefill completes.

- **drafted** (the VeriCache path): ``horizon`` drafts over the compressed KV each step, verified
  by the core: greedy, or a position-keyed sampler for temperature / top_k / top_p / a seed (with
  ``--enable-deterministic-inference`` SGLang's own seeded draw, ``seeded_draw``, so the tokens are
  stock's; without it stock ignores seeds and the core's sampler draws); a grammar
  (``response_format``, regex, EBNF) masks drafts and verification alike (``grammar_masks``). The
  first token, drawn at prefill, is that sampler's draw too.
- **own**: settings only SGLang's own sampler applies (penalties, ``min_p``, ``logit_bias``,
  ``min_new_tokens``, a custom logit processor, a watermark): the request is decoded one
  verified token per step, its token chosen by SGLang's sampler from the full-KV logits at its
  seed position, exactly as a stock decode step chooses it (horizon 0 for that request; the others
  in its batch keep drafting).

A request the compressed pool has no row for is decoded one verified token per step by the core
(``Plan.drafts`` stays, the worker sees it has no row).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vericache_sglang.core.sampling import Sampler, SamplingParams
from vericache_sglang.sglang.step.seeded_draw import DEFAULT_SEED, BatchPath, SGLangSeededSampler

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary" top_k


@dataclass(frozen=True)
class Plan:
    own: tuple[str, ...]  # settings that make SGLang's sampler choose this request's tokens (empty: drafted)
    sampler: Sampler  # the core's sampler (drafted requests)

    @property
    def drafts(self) -> bool:
        return not self.own


def core_sampling(params: SGLangSamplingParams, rid: str, default_seed: int | None = None) -> SamplingParams:
    """The core's sampling parameters for an SGLang request's ``SamplingParams``.

    SGLang encodes temperature 0 as ``top_k=1``. A request without a ``sampling_seed`` gets
    ``default_seed`` or, without one, a seed from its id, so its draws are keyed by (seed, position)
    like all."""
    if int(params.top_k) == 1:
        return SamplingParams()
    top_k = int(params.top_k)
    seed = params.sampling_seed
    if seed is None:
        seed = default_seed if default_seed is not None else zlib.crc32(rid.encode())
    return SamplingParams(
        temperature=float(params.temperature),
        top_k=0 if top_k <= 0 or top_k >= TOP_K_ALL else top_k,
        top_p=float(params.top_p),
        seed=int(seed),
    )


def own_settings(req: Req) -> tuple[str, ...]:
    """The request settings the core's verifier does not apply, by name (empty when none)."""
    params = req.sampling_params
    own = [
        name
        for name, value, neutral in (
            ("frequency_penalty", params.frequency_penalty, 0.0),
            ("presence_penalty", params.presence_penalty, 0.0),
            ("repetition_penalty", params.repetition_penalty, 1.0),
            ("min_p", params.min_p, 0.0),
            ("min_new_tokens", params.min_new_tokens, 0),
        )
        if float(value) != neutral
    ]
    if params.logit_bias:
        own.append("logit_bias")
    if getattr(params, "watermark", None) is not None:
        own.append("watermark")
    if getattr(req, "custom_logit_processor", None):
        own.append("custom_logit_processor")
    return tuple(own)


def plan_request(req: Req, seeded: BatchPath | None = None) -> Plan:
    """``seeded``: SGLang's deterministic inference is on; drafted requests draw as its sampler does."""
    if seeded is None:
        return Plan(own_settings(req), Sampler(core_sampling(req.sampling_params, req.rid)))
    params = req.sampling_params
    core = core_sampling(params, req.rid, DEFAULT_SEED)
    return Plan(own_settings(req), SGLangSeededSampler(core, int(params.top_k), float(params.top_p), seeded))
