"""Every SGLang name the worker reads exists in sglang 0.5.23, on real objects.

The end-to-end tests (``test_sglang_e2e*.py``) run the worker in real servers, but only along the
paths their requests take; a renamed attribute on another path would show only there (one did:
``req.req_pool_idx``, which 0.5.23 keeps on ``req.kv``). This pins the surface the worker, its host
offload and its forward, plan and output modules touch; their source is scanned so a new use
without a check here fails, in seconds, before any server starts.
"""

from __future__ import annotations

import dataclasses
import re
from array import array
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.managers.schedule_batch", reason="sglang is not installed")

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.sampling.sampling_params import SamplingParams

SGLANG_DIR = Path(__file__).resolve().parents[2] / "vericache_sglang" / "sglang"
WORKER_FILES = (
    "step/worker.py",
    "step/admission.py",
    "full_kv/offload.py",
    "step/forward.py",
    "step/passes.py",
    "step/request_plan.py",
    "step/step_output.py",
    "step/lookup_windows.py",
    "step/seeded_draw.py",
    "step/prefix_repair.py",
)

# the attribute paths the worker reads, by the object they hang off
REQ = {
    "grammar",
    "kv.cache_protected_len",
    "kv.req_pool_idx",
    "lock",  # the tree lock a store-mode request gives back once its prefix is offloaded
    "origin_input_ids",
    "positional_embed_overrides",  # SGLang's own bar from the tree, kept when a prompt is published
    "prefix_len",
    "return_logprob",
    "rid",
    "sampling_params",
    "skip_radix_cache_insert",
    "to_finish",
    "logprob.token_ids_logprob",
    "logprob.top_logprobs_num",
    "output_ids",
    "eos_token_ids",
    "sampling_params.ignore_eos",
    "sampling_params.stop_token_ids",
}
BATCH = {
    "extend_lens",
    "forward_mode",
    "has_grammar",
    "req_pool_indices",
    "reqs",
    "return_logprob",
    "sampling_info",
    "seq_lens",
    "spec_algorithm",
    "spec_info",
}
# what the seeded draw reads off ``batch.sampling_info`` to follow stock's sampling path
SAMPLING_INFO = {"need_top_k_sampling", "need_top_p_sampling", "need_min_p_sampling"}
RESULT = {"logits_output", "new_seq_lens", "next_draft_input", "next_token_ids"}
SAMPLING = {
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "sampling_seed",
    "temperature",
    "top_p",
}


def _uses(prefix: str) -> set[str]:
    found = set()
    for name in WORKER_FILES:
        for m in re.finditer(rf"\b{prefix}\.([a-z_]+(?:\.[a-z_]+)?)", (SGLANG_DIR / name).read_text()):
            found.add(m.group(1))
    return found


def test_the_worker_reads_only_what_is_pinned_here():
    assert _uses("req") <= REQ, _uses("req") - REQ
    batch = {u.split(".")[0] for u in _uses("batch")}
    assert batch <= BATCH, batch - BATCH
    result = {u.split(".")[0] for u in _uses("result")}
    assert result <= RESULT | {"logits_output"}, result - RESULT
    assert _uses("info") <= SAMPLING_INFO, _uses("info") - SAMPLING_INFO


def test_sampling_info_and_the_seeded_draw_exist_as_the_worker_uses_them():
    from sglang.srt.layers import sampler
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    fields = {f.name for f in dataclasses.fields(SamplingBatchInfo)}
    assert SAMPLING_INFO <= fields, SAMPLING_INFO - fields
    for name in ("sampling_from_probs_torch", "top_k_top_p_min_p_sampling_from_probs_torch"):
        assert callable(getattr(sampler, name, None)), f"sglang.srt.layers.sampler has no {name}"


def test_a_real_request_has_every_attribute_the_worker_reads():
    req = Req("r", "", array("l", [1, 2, 3]), SamplingParams(max_new_tokens=4))
    for path in sorted(REQ):
        obj = req
        for part in path.split("."):
            assert hasattr(obj, part), f"Req has no {path}"
            obj = getattr(obj, part)
    for name in sorted(SAMPLING):
        assert hasattr(req.sampling_params, name), f"SamplingParams has no {name}"


def test_batches_and_results_have_the_fields_the_worker_reads():
    batch_fields = set(ScheduleBatch.__annotations__) | {f.name for f in dataclasses.fields(ScheduleBatch)}
    missing = {name for name in BATCH if name not in batch_fields and not hasattr(ScheduleBatch, name)}
    assert not missing, f"ScheduleBatch lacks {sorted(missing)}"
    result_fields = {f.name for f in dataclasses.fields(GenerationBatchResult)}
    assert RESULT | {"accept_lens", "speculative_num_draft_tokens", "can_run_cuda_graph"} <= result_fields
    forward_fields = {f.name for f in dataclasses.fields(ForwardBatch)}
    assert {
        "forward_mode",
        "batch_size",
        "input_ids",
        "req_pool_indices",
        "seq_lens",
        "seq_lens_cpu",
        "seq_lens_sum",
        "out_cache_loc",
        "positions",
        "spec_info",
        "spec_algorithm",
        "capture_hidden_mode",
    } <= forward_fields
    assert "next_token_logits" in {f.name for f in dataclasses.fields(LogitsProcessorOutput)}
