"""The ``VERICACHE`` speculative worker: draft with the target model over the compressed pool,
verify with one TARGET_VERIFY pass over the full KV, commit what the core's acceptance decides.

UNVERIFIED: this module needs a CUDA GPU with sglang installed to run, and this project's
machines have neither together (the CPU machines cannot run SGLang models; the lent GPU machines
have no sglang). What does run on CPU, against SGLang's own objects, is tested: the private pool
(``draft_pool``), the pool/KV bridge (``pool_kv``), the acceptance (``acceptance``, checked against
SGLang's verification kernel), the registration and flags. ``benchmarks/sglang_gpu.sh`` is the
check an operator with a GPU runs first.

Per decode step, for every running request (one synchronous step; overlap scheduling is off):

1. ``horizon`` draft passes, each one token per request, through the private draft backend
   (``ForwardContext`` override, UNO's pattern) over ``CompressedDraftPool``; drafted K/V goes to
   scratch slots.
2. One TARGET_VERIFY pass over the target pool: the seed and the drafts as a chain (causal; an
   ``NgramVerifyInput`` with no tree), writing their exact K/V at the slots SGLang reserved.
   With ``full_kv=host`` (``host_offload``), the requests' own KV is not on the device between
   verifications: the draft passes are iterations of the core's staggered scheduler, reloads
   start during them, and the verify pass runs per group of requests, each reload lent to its
   request's row for its pass.
3. The core decides (``greedy_accept``) over the whole batch; a chain needs no KV compaction: the
   seed and accepted drafts are already the front of the reserved slots, the rest is overwritten
   next step.
4. The committed tokens' exact K/V (read back from the target pool) goes to the store (when
   ``full_kv=store``), into the compressed KV through the compressor's ``update``, and with
   ``full_kv=host`` to the host tier, its device slots freed.

Sampled requests (temperature, top_k, top_p, a seed) draw drafts and verification with the core's
position-keyed sampler (``acceptance``): with ``verification: "greedy"`` the verifier's own draw at
each position decides (exactly what the core's full-KV sampling draws there; the first token is
SGLang's own sample at prefill, also from the full KV); with
``"rejection"``, speculative rejection sampling (lossless in distribution). Requests the worker
cannot verify (penalties, min_p, logit_bias, a grammar, logprobs) end after their first token
(SGLang's own full-KV sample) with the reason.

Not done yet: with ``full_kv=host``, moving KV off the device asynchronously (the worker
waits for each device-to-host copy before freeing the slots) and sharing a matched prefix's host
copy between requests (each offloaded request keeps its own rows; a prefix it matched in the
radix tree stays on the device, owned by the tree).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from functools import partial
from http import HTTPStatus
from typing import Any

import torch
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

from vericache_sglang.core.compress import Observation, parse_spec
from vericache_sglang.core.sampling import Sampler
from vericache_sglang.sglang.acceptance import (
    UnsupportedSampling,
    core_sampling,
    draft_tokens,
    greedy_verdicts,
    pack,
    sampled_verdicts,
)
from vericache_sglang.sglang.attention import RUNNER_ATTR, create_draft_backend
from vericache_sglang.sglang.draft_pool import CompressedDraftPool
from vericache_sglang.sglang.hooks import config_of
from vericache_sglang.sglang.metrics import WorkerMetrics, metrics_enabled
from vericache_sglang.sglang.pool_kv import pool_layout, read_full_kv

logger = logging.getLogger(__name__)
OBS_WINDOW = 64  # prefill queries kept per request for scoring compressors (SnapKV)


@dataclass
class VeriCacheDraftInput(SpecInput):
    """Carried between steps: each request's seed (last committed token, no KV yet)."""

    seeds: torch.Tensor

    def __post_init__(self) -> None:
        super().__init__(SpecInputType.EAGLE_DRAFT)  # a closed enum: reuse the draft-state type
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu: Any = None) -> None:
        self.seeds = self.seeds[new_indices]

    def merge_batch(self, other: VeriCacheDraftInput) -> None:
        self.seeds = torch.cat([self.seeds, other.seeds])


class _QueryCapture:
    """Keeps the last OBS_WINDOW post-RoPE queries of each request during a prefill."""

    def __init__(self, model: torch.nn.Module, head_dim: int):
        from sglang.srt.layers.radix_attention import RadixAttention

        self.layers = [m for m in model.modules() if isinstance(m, RadixAttention)]
        self.head_dim = head_dim
        self.queries: list[torch.Tensor | None] = [None] * len(self.layers)
        self._handles: list[Any] = []

    @contextlib.contextmanager
    def capturing(self):
        def hook(index: int):
            def fn(module, args, kwargs):
                q = args[0] if args else kwargs["q"]
                self.queries[index] = q.detach()
            return fn

        self._handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(self.layers)]
        try:
            yield
        finally:
            for h in self._handles:
                h.remove()

    def observation(self, start: int, end: int) -> Observation:
        lo = max(start, end - OBS_WINDOW)
        return Observation([q[lo:end].view(end - lo, -1, self.head_dim).transpose(0, 1).float()
                            for q in self.queries])


class VeriCacheWorker(BaseSpecWorker):
    def __init__(self, server_args: Any, gpu_id: int, nccl_port: int, target_worker: Any):
        super().__init__()
        cfg = config_of(server_args)
        if cfg is None:
            raise RuntimeError("VeriCacheWorker needs --enable-vericache")
        self.cfg = cfg
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.model_runner = target_worker.model_runner
        self.device = target_worker.device
        self.compressor = parse_spec(cfg.compressor)
        self.horizon = cfg.horizon
        # read by SGLang's speculative infrastructure
        self.speculative_num_draft_tokens = cfg.num_draft_tokens
        self.speculative_num_steps = cfg.horizon
        self.topk = 1
        self.draft_pool: CompressedDraftPool | None = None
        self.draft_backend: Any = None
        self.store: Any = None
        self._requests: dict[str, Any] = {}  # rid -> RequestKV in the full-KV store
        self._samplers: dict[str, Sampler] = {}  # rid -> the core's sampler for its draws
        self.host: Any = None  # HostOffload when full_kv=host
        self._host_bytes_seen = (0, 0)  # its byte totals already counted in the metrics
        self.metrics = None
        if metrics_enabled(server_args):
            self.metrics = WorkerMetrics({"model_name": str(server_args.served_model_name or server_args.model_path),
                                          "tp_rank": str(getattr(target_worker, "tp_rank", 0))})

    def __getattr__(self, name: str) -> Any:
        if name == "_target_worker":
            raise AttributeError(name)
        return getattr(self._target_worker, name)  # scheduler-facing methods of the target worker

    @property
    def draft_worker(self) -> None:
        return None  # the target model drafts; there is no draft model

    # -- set-up, in the order the scheduler calls it ------------------------------------------------

    def alloc_memory_pool(self, memory_pool_config: Any = None, req_to_token_pool: Any = None,
                          token_to_kv_pool_allocator: Any = None) -> None:
        super().alloc_memory_pool(memory_pool_config=memory_pool_config, req_to_token_pool=req_to_token_pool,
                                  token_to_kv_pool_allocator=token_to_kv_pool_allocator)
        target_pool = self.model_runner.token_to_kv_pool
        model_id = str(self.model_runner.model_config.model_path)
        self.layout = pool_layout(target_pool, model_id)
        # The compressed pool gets the share of the target pool the compressor's ratio implies.
        capacity = max(4096, int(target_pool.size * 0.5))
        self.draft_pool = CompressedDraftPool(
            layout=self.layout, capacity_tokens=capacity, max_requests=req_to_token_pool.size,
            max_context_len=req_to_token_pool.max_context_len, horizon=self.horizon, compressor=self.compressor,
            device=str(self.device), inner_backend=self.model_runner.server_args.attention_backend or "triton")
        setattr(self.model_runner, RUNNER_ATTR, self.draft_pool.pools)
        if self.cfg.full_kv == "store":
            from remote_store import open_store
            from remote_store.fullkv import FullKVStore

            self.store = FullKVStore(open_store(self.cfg.store), self.layout, namespace="sglang")
        if self.cfg.full_kv == "host":
            from vericache_sglang.sglang.host_offload import HostOffload

            self.host = HostOffload(self.cfg, self.model_runner,
                                    token_to_kv_pool_allocator or self.model_runner.token_to_kv_pool_allocator,
                                    on_release=self._forget)

    def init_attention_backends(self) -> None:
        self.draft_backend = create_draft_backend(self.model_runner)
        self._capture = _QueryCapture(self.model_runner.model, self.model_runner.model_config.head_dim)

    def init_cuda_graphs(self) -> None:
        return None  # --enable-vericache disables decode CUDA graphs; nothing of ours is captured

    # -- one scheduler step ---------------------------------------------------------------------------

    def forward_batch_generation(self, batch: Any, on_publish: Any = None, grammar_barrier: Any = None) -> Any:
        if batch.forward_mode.is_idle():
            raise NotImplementedError("VERICACHE does not run idle batches (no data parallel attention)")
        if batch.forward_mode == ForwardMode.DECODE and (batch.has_grammar or batch.return_logprob):
            # _prefill aborts such requests, so none reaches a decode step
            raise RuntimeError("a VERICACHE decode batch holds a request with a grammar or logprobs")
        if batch.forward_mode == ForwardMode.EXTEND:
            return self._prefill(batch, on_publish)
        if batch.forward_mode == ForwardMode.DECODE:
            return self._decode(batch, on_publish)
        raise RuntimeError(f"VERICACHE expected an EXTEND or DECODE batch, got {batch.forward_mode}")

    def _prefill(self, batch: Any, on_publish: Any) -> Any:
        with self._capture.capturing():
            result = self.target_worker.forward_batch_generation(batch)
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        offset = 0
        for req, seq_len, ext in zip(batch.reqs, batch.seq_lens.tolist(), batch.extend_lens, strict=True):
            offset += ext
            if self.host is not None:
                # before SGLang checkpoints the first chunk into the tree: the rows stay the request's
                req.skip_radix_cache_insert = True
            if seq_len < len(req.origin_input_ids):
                continue  # a chunk of a chunked prefill: compress once the whole prompt has KV
            self._forget(req.rid)  # a retracted request prefills again from scratch
            why = self._unservable(req)
            if why:
                # its first token (SGLang's own full-KV sample) is emitted, then it ends with the reason
                req.to_finish = FINISH_ABORT(f"VeriCache: {why}", HTTPStatus.BAD_REQUEST, "BadRequestError")
                continue
            slots = req_to_token[req.kv.req_pool_idx, :seq_len].to(torch.int64)
            full = read_full_kv(self.model_runner.token_to_kv_pool, slots, self.layout)
            kv = self.compressor.compress(full, self._capture.observation(offset - ext, offset))
            self.draft_pool.admit(req.rid, kv, seq_len)
            if self.store is not None:
                handle = self.store.open_request(list(req.origin_input_ids), request_id=req.rid)
                self._store_write(handle, 0, full)
                self._requests[req.rid] = handle
            if self.host is not None:
                self.host.offload(req, seq_len)
        result.next_draft_input = VeriCacheDraftInput(seeds=result.next_token_ids.reshape(-1).to(torch.int64))
        result.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        return result

    def _unservable(self, req: Any) -> str:
        """Why the worker cannot verify ``req`` (empty when it can); records its sampler."""
        if req.grammar is not None:
            return "constrained decoding (a grammar) is not verified by the VERICACHE worker"
        if req.return_logprob:
            return "the VERICACHE worker does not return logprobs"
        try:
            params = core_sampling(req.sampling_params, req.rid)
        except UnsupportedSampling as e:
            return str(e)
        self._samplers[req.rid] = Sampler(params)
        return ""

    @contextlib.contextmanager
    def _drafting(self, fb: ForwardBatch):
        saved = self.model_runner.attn_backend
        self.model_runner.attn_backend = self.draft_backend
        try:
            with forward_context(ForwardContext(attn_backend=self.draft_backend), forward_batch=fb):
                yield
        finally:
            self.model_runner.attn_backend = saved

    def _draft(self, batch: Any, seeds: torch.Tensor, committed: torch.Tensor,
               samplers: list[Sampler]) -> tuple[torch.Tensor, list[list[torch.Tensor | None]]]:
        """``horizon`` draft passes; returns the drafts ``[bs, x]`` and, per pass, each request's
        draft distribution (kept for rejection sampling only)."""
        rids = [r.rid for r in batch.reqs]
        rows = torch.tensor([self.draft_pool.row_index(r) for r in rids], dtype=torch.int64, device=self.device)
        kept = torch.tensor([self.draft_pool.kept_len(r) for r in rids], dtype=torch.int64, device=self.device)
        scratch = torch.stack([self.draft_pool.scratch_slots(r) for r in rids]).to(self.device)
        rejection = self.cfg.verification == "rejection"
        seed_positions = committed.tolist()  # once: a per-pass .tolist() would sync the device each pass
        tokens, drafts, probs = seeds, [], []
        for j in range(self.horizon):
            seq_lens = (kept + j + 1).to(torch.int32)
            fb = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(rids), input_ids=tokens,
                              req_pool_indices=rows, seq_lens=seq_lens, seq_lens_cpu=seq_lens.cpu(),
                              seq_lens_sum=int(seq_lens.sum()), out_cache_loc=scratch[:, j],
                              positions=committed + j, capture_hidden_mode=CaptureHiddenMode.NULL)
            logits = self._draft_pass(fb) if self.host is None else self.host.draft_pass(partial(self._draft_pass, fb))
            tokens, q = draft_tokens(logits, samplers, [p + j + 1 for p in seed_positions], rejection)
            drafts.append(tokens)
            probs.append(q)
        return torch.stack(drafts, dim=1), probs

    def _draft_pass(self, fb: ForwardBatch) -> torch.Tensor:
        with self._drafting(fb):
            self.draft_backend.init_forward_metadata(fb)
            return self.model_runner.forward(fb).logits_output.next_token_logits

    def _decode(self, batch: Any, on_publish: Any) -> Any:
        started = time.perf_counter()
        seeds = batch.spec_info.seeds.to(self.device)
        committed = batch.seq_lens.to(torch.int64)
        if self.host is not None:
            self.host.plan(batch.reqs)
        samplers = [self._samplers[req.rid] for req in batch.reqs]
        drafts, draft_probs = self._draft(batch, seeds, committed, samplers)
        bs, width = len(batch.reqs), self.horizon + 1
        chain = torch.cat([seeds[:, None], drafts], dim=1)  # [bs, x + 1]
        positions = committed[:, None] + torch.arange(width, device=self.device)[None]
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        slots = req_to_token[batch.req_pool_indices.to(torch.int64)[:, None], positions].to(torch.int64)

        def verify(rows: torch.Tensor) -> torch.Tensor:
            return self._verify(batch, rows.to(self.device), chain, positions, slots, committed)

        if self.host is None:
            logits = verify(torch.arange(bs))
        else:
            logits = self.host.verify(batch.reqs, verify, width)
        if all(sampler.params.greedy for sampler in samplers):
            verdicts = greedy_verdicts(drafts, logits.argmax(-1).view(bs, width))
        else:
            verdicts = sampled_verdicts(drafts, draft_probs, logits.view(bs, width, -1), committed.tolist(), samplers,
                                        rejection=self.cfg.verification == "rejection")
        packed = pack(verdicts, width, committed)
        self._commit(batch, packed, chain, committed, slots)
        if self.metrics is not None:
            self.metrics.verified([v.accepted for v in packed.verdicts], self.horizon, time.perf_counter() - started)
            self.metrics.compressed_kv.set(self.draft_pool.nbytes())
            self._count_host_bytes()
        batch.forward_mode = ForwardMode.DECODE
        if on_publish is not None:
            on_publish(packed.new_seq_lens)
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=logits), next_token_ids=packed.output_ids.reshape(-1),
            accept_lens=packed.accept_lens, new_seq_lens=packed.new_seq_lens,
            next_draft_input=VeriCacheDraftInput(seeds=packed.next_seeds),
            speculative_num_draft_tokens=width, can_run_cuda_graph=False)

    def _verify(self, batch: Any, rows: torch.Tensor, chain: torch.Tensor, positions: torch.Tensor,
                slots: torch.Tensor, committed: torch.Tensor) -> torch.Tensor:
        """One TARGET_VERIFY pass over the requests at batch indices ``rows``: their [seed, drafts]
        chains as causal chains over the target pool; returns the logits, ``[len(rows) * width, vocab]``."""
        from sglang.srt.speculative.ngram_info import NgramVerifyInput

        n, width = int(rows.numel()), self.horizon + 1
        lens = committed[rows]
        verify = NgramVerifyInput(
            draft_token=chain[rows].reshape(-1), custom_mask=None, positions=positions[rows].reshape(-1),
            retrieve_index=torch.arange(n * width, device=self.device).view(n, width),
            retrieve_next_token=torch.cat([torch.arange(1, width, device=self.device),
                                           torch.tensor([-1], device=self.device)]).repeat(n, 1),
            retrieve_next_sibling=torch.full((n, width), -1, device=self.device), draft_token_num=width)
        fb = ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=n, input_ids=chain[rows].reshape(-1),
                          req_pool_indices=batch.req_pool_indices[rows], seq_lens=lens.to(torch.int32),
                          seq_lens_cpu=lens.cpu().to(torch.int32), seq_lens_sum=int((lens + width).sum()),
                          out_cache_loc=slots[rows].reshape(-1), positions=positions[rows].reshape(-1),
                          spec_info=verify, spec_algorithm=batch.spec_algorithm,
                          capture_hidden_mode=CaptureHiddenMode.NULL)
        result = self.target_worker.forward_batch_generation(batch=None, forward_batch=fb, is_verify=True)
        return result.logits_output.next_token_logits

    def _commit(self, batch: Any, packed: Any, chain: torch.Tensor, committed: torch.Tensor,
                slots: torch.Tensor) -> None:
        """The seed and the accepted drafts now have exact K/V in the target pool: fold it into the
        compressed KV and the store. The correction/bonus token is the next seed (no K/V yet)."""
        pool = self.model_runner.token_to_kv_pool
        for i, req in enumerate(batch.reqs):
            n = packed.verdicts[i].accepted + 1
            full = read_full_kv(pool, slots[i, :n], self.layout)
            pos = torch.arange(int(committed[i]), int(committed[i]) + n)
            self.draft_pool.commit(req.rid, full, pos)
            handle = self._requests.get(req.rid)
            if handle is not None:
                handle.extend_tokens(chain[i, :n].tolist())  # the seed and the accepted drafts
                self._store_write(handle, int(committed[i]), full)
            if self.host is not None:
                self.host.offload(req, int(committed[i]) + n)

    def _store_write(self, handle: Any, start: int, full: Any) -> None:
        try:
            handle.write(start, full.layers)
        except Exception:
            if self.metrics is not None:
                self.metrics.store_errors.inc()
            raise
        if self.metrics is not None:
            self.metrics.full_kv_written.inc(full.nbytes)

    def _count_host_bytes(self) -> None:
        if self.host is None:
            return
        written, fetched = self.host.offloaded_bytes, self.host.reloaded_bytes
        self.metrics.full_kv_written.inc(written - self._host_bytes_seen[0])
        self.metrics.full_kv_fetched.inc(fetched - self._host_bytes_seen[1])
        self._host_bytes_seen = (written, fetched)

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        """Drop what the worker keeps for ``rid`` (it finished, left, or prefills again)."""
        if self.draft_pool is not None:
            self.draft_pool.release(rid)
        self._samplers.pop(rid, None)
        handle = self._requests.pop(rid, None)
        if handle is not None:
            handle.release()
