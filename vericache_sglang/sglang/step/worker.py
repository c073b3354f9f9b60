"""The ``VERICACHE`` speculative worker: draft with the target model over the compressed pool,
verify with one TARGET_VERIFY pass over the full KV, commit what the core's acceptance decides.

SGLang's scheduler calls ``forward_batch_generation`` once per step (overlap scheduling is off:
the step is synchronous). A prefill (EXTEND) runs the target model as is, captures each prompt's
last queries for the scoring compressors, compresses the prompt's exact KV into the private draft
pool and plans the request (``request_plan``). A decode step, for every running request:

1. ``horizon`` draft passes over ``CompressedDraftPool`` (``passes``), one token per drafting
   request each, masked by its grammar (``grammar_masks``); with ``+lookup``, the core's
   ``DraftWindow`` per request (``lookup_windows``): prompt-lookup chains checked by the model.
2. One verify pass over the target pool (``forward``, ``passes``), writing the chain's exact K/V
   at the slots SGLang reserved. With ``full_kv`` "host" or "store" (``full_kv.offload``) each
   request's own KV is off the device between verifications: the draft passes are iterations of
   the core's staggered scheduler, reloads (fetches) start during them, the verify pass runs per
   group, each reload lent to its request's row, and what the store did not deliver is
   recomputed from the committed tokens first.
3. The core decides per request (``core.accept``: greedy, or a position-keyed sampler, SGLang's
   own seeded draw under deterministic inference; the same grammar masks on the full-KV logits).
   Requests whose settings only SGLang's sampler applies ("own" in ``request_plan``) take its
   sample at their seed position: one verified token per step, a stock decode step's choice.
4. The committed tokens' exact K/V goes into the compressed KV (the compressor's ``update``; with
   ``+refresh`` rows re-chosen by the verify pass's queries over the full KV, still in the pool or
   lent) and, offloaded, leaves the device for its tier. The correction or bonus token is the
   next seed (no K/V yet), as in SGLang's own spec-v2 convention.

Tested on CPU in real SGLang servers (torch_native; triton under Triton's interpreter). On a GPU
unverified: no machine here has a GPU with sglang. Not done: offloading asynchronously.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Container
from functools import partial
from typing import TYPE_CHECKING

import torch
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker

from vericache_sglang.core.accept import Verdict
from vericache_sglang.core.compress import parse_spec
from vericache_sglang.core.sampling import Sampler
from vericache_sglang.sglang.draft.attention import RUNNER_ATTR
from vericache_sglang.sglang.draft.pool import CompressedDraftPool, draft_capacity
from vericache_sglang.sglang.hooks import config_of
from vericache_sglang.sglang.metrics import WorkerMetrics, metrics_enabled
from vericache_sglang.sglang.pool_kv import PoolParts, pool_layout, read_full_kv
from vericache_sglang.sglang.step.acceptance import PackedVerdicts, draws, pack, verdict
from vericache_sglang.sglang.step.admission import PromptAdmission
from vericache_sglang.sglang.step.draft_state import QueryCapture, VeriCacheDraftInput
from vericache_sglang.sglang.step.forward import ForwardBuilder
from vericache_sglang.sglang.step.grammar_masks import ChainMasks
from vericache_sglang.sglang.step.passes import Passes
from vericache_sglang.sglang.step.prefix_repair import PrefixRepair
from vericache_sglang.sglang.step.probe import pool_probes
from vericache_sglang.sglang.step.request_plan import Plan, plan_request
from vericache_sglang.sglang.step.seeded_draw import BatchPath
from vericache_sglang.sglang.step.step_output import step_output

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.server_args import ServerArgs

    from vericache_sglang.core.kv import FullKV, KVLayout
    from vericache_sglang.sglang.full_kv.offload import FullKVOffload
    from vericache_sglang.sglang.step.lookup_windows import LookupWindows

logger = logging.getLogger(__name__)


class VeriCacheWorker(BaseSpecWorker):
    def __init__(self, server_args: ServerArgs, gpu_id: int, nccl_port: int, target_worker: TpModelWorker):
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
        # deterministic inference: SGLang's seeded draw, on the path the running batch takes in stock
        self._seeded = BatchPath() if server_args.enable_deterministic_inference else None
        # set up by alloc_memory_pool and init_attention_backends, in the order the scheduler calls them
        self.layout: KVLayout | None = None
        self.draft_pool: CompressedDraftPool | None = None
        self.forwards: ForwardBuilder | None = None
        self.passes: Passes | None = None
        self._capture: QueryCapture | None = None
        self._admission: PromptAdmission | None = None
        self.offload: FullKVOffload | None = None  # full_kv "host" or "store"
        self.lookup: LookupWindows | None = None  # +lookup
        self._plans: dict[str, Plan] = {}  # rid -> how the request is served
        self.metrics: WorkerMetrics | None = None
        if metrics_enabled(server_args):
            self.metrics = WorkerMetrics(
                {
                    "model_name": str(server_args.served_model_name or server_args.model_path),
                    "tp_rank": str(getattr(target_worker, "tp_rank", 0)),
                }
            )

    @property
    def draft_worker(self) -> None:
        return None  # the target model drafts; there is no draft model

    # -- set-up, in the order the scheduler calls it ------------------------------------------------

    def alloc_memory_pool(
        self,
        memory_pool_config: object = None,
        req_to_token_pool: ReqToTokenPool | None = None,
        token_to_kv_pool_allocator: BaseTokenToKVPoolAllocator | None = None,
    ) -> None:
        super().alloc_memory_pool(
            memory_pool_config=memory_pool_config,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        )
        runner = self.model_runner
        target_pool = runner.token_to_kv_pool
        self.layout = pool_layout(target_pool, str(runner.model_config.model_path))
        capacity = draft_capacity(self.compressor, target_pool.size)
        self.draft_pool = CompressedDraftPool(
            layout=self.layout,
            capacity_tokens=capacity,
            max_requests=req_to_token_pool.size,
            max_context_len=req_to_token_pool.max_context_len,
            horizon=self.horizon,
            compressor=self.compressor,
            device=str(self.device),
            scratch=2 * self.horizon + 1 if self.compressor.lookup else None,
        )
        setattr(runner, RUNNER_ATTR, self.draft_pool.pools)
        if self.cfg.full_kv in ("host", "store"):
            from vericache_sglang.sglang.full_kv.offload import FullKVOffload

            self.offload = FullKVOffload.for_server(
                self.cfg,
                runner,
                token_to_kv_pool_allocator or runner.token_to_kv_pool_allocator,
                self.layout,
                hicache=bool(getattr(self.server_args, "enable_hierarchical_cache", False)),
                on_release=self._forget,
                on_error=self._store_error,
            )

    def init_attention_backends(self) -> None:
        runner = self.model_runner
        self.forwards = ForwardBuilder(runner, runner.prefill_attention_backend_str)
        lookup = self.compressor.lookup is not None
        self.passes = Passes(self.target_worker, self.forwards, self.draft_pool, lookup, self.offload)
        if lookup:
            from vericache_sglang.sglang.step.lookup_windows import LookupWindows

            self.lookup = LookupWindows(
                self.compressor.lookup,
                self.horizon,
                self.draft_pool,
                self.forwards,
                runner.model_config.vocab_size,
                self.cfg.verification == "rejection",
                self.device,
                self.passes.draft,
                self.passes.chain,
            )
        self._capture = QueryCapture(self.model_runner.model, self.model_runner.model_config.head_dim)
        self._admission = PromptAdmission(
            runner,
            self.layout,
            self.compressor,
            self.draft_pool,
            self._capture,
            on_release=self._forget,
            count=self._count,
            probe=pool_probes(self.passes, self.target_worker.tokenizer, self.compressor.needs),
        )
        self._prefixes = PrefixRepair(
            self.offload, self.passes.recompute, self._admission.tree, runner.req_to_token_pool
        )

    def init_cuda_graphs(self) -> None:
        return None  # --enable-vericache disables decode CUDA graphs; nothing of ours is captured

    # -- one scheduler step ---------------------------------------------------------------------------

    def forward_batch_generation(
        self,
        batch: ScheduleBatch,
        on_publish: Callable | None = None,
        grammar_barrier: object = None,
        pp_proxy_tensors: object = None,
    ) -> GenerationBatchResult:
        if pp_proxy_tensors is not None:
            raise RuntimeError("VERICACHE does not run with pipeline parallelism")
        if batch.forward_mode == ForwardMode.EXTEND:
            return self._prefill(batch, on_publish)
        if batch.forward_mode == ForwardMode.DECODE:
            result = self._decode(batch, on_publish)
            self._prefixes.settle(None)  # a load started for a request still waiting ends with the step
            return result
        raise RuntimeError(f"VERICACHE runs EXTEND and DECODE batches, got {batch.forward_mode}")

    def _prefill(self, batch: ScheduleBatch, on_publish: Callable | None) -> GenerationBatchResult:
        self._admission.tree()  # its release listener, before a request keeps anything here (a plan, query tails)
        while True:  # again only when a stored prefix it read failed to load, and was recomputed
            fb = self.forwards.prefill(batch)
            # the verify backend: on CPU the chain one (new tokens over a cached prefix attend from their rows only)
            with self._capture.capturing(), self.passes.using(self.passes.verify_backend, fb), self._prefixes.reading():
                result = self.target_worker.forward_batch_generation(batch=None, forward_batch=fb, is_verify=True)
            if not self._prefixes.settle(batch):
                break
        # SGLang's sampler rewrites the logits in place (temperature, softmax): keep them for the core's draws
        logits = result.logits_output.next_token_logits.clone()
        next_ids = result.next_token_ids = self.model_runner.sample(result.logits_output, fb)
        offset = 0
        for i, (req, seq_len, ext) in enumerate(
            zip(batch.reqs, batch.seq_lens.tolist(), batch.extend_lens, strict=True)
        ):
            offset += ext
            if self.offload is not None:
                # before SGLang checkpoints the first chunk into the tree: the rows stay the request's
                req.skip_radix_cache_insert = True
            if seq_len - ext == 0 or req.rid not in self._capture.tails:
                self._forget(req.rid)  # a new request, or a retracted one that prefills again from scratch
            self._capture.keep(req.rid, offset - ext, offset)
            if seq_len < len(req.origin_input_ids):
                continue  # a chunk of a chunked prefill: compress once the whole prompt has KV
            plan = self._plans[req.rid] = plan_request(req, self._seeded)
            if plan.own:
                self._capture.forget(req.rid)
                own = ", ".join(plan.own)
                logger.info("VeriCache: request %s: one verified token a step (SGLang samples %s)", req.rid, own)
                continue
            if not plan.sampler.params.greedy and self._seeded is None:  # seeded: SGLang's draw above
                # the first token is the core's draw at its position, as in full-KV sampling
                token = plan.sampler.sample(logits[i : i + 1].float(), [seq_len])[0]
                next_ids[i] = token.to(next_ids.dtype)
                if req.return_logprob:
                    row = torch.log_softmax(logits[i].float() / plan.sampler.params.temperature, dim=-1)
                    result.logits_output.next_token_logprobs[i] = row[token]
            self._admission.admit(batch, req, seq_len, ext)
            if self.lookup is not None and self.draft_pool.has(req.rid):
                self.lookup.admit(req.rid, [*req.origin_input_ids, *req.output_ids, int(next_ids[i])])
            if self.offload is not None:
                self.offload.admit(req, seq_len)
        if self.offload is not None and self.metrics is not None:  # what prefill moved, counted now
            self.offload.count_into(self.metrics)
        self._capture.clear()
        result.next_draft_input = VeriCacheDraftInput(seeds=next_ids.reshape(-1).to(torch.int64))
        result.new_seq_lens = batch.seq_lens
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        return result

    def _draft(
        self,
        batch: ScheduleBatch,
        rows: list[int],
        seeds: torch.Tensor,
        committed: torch.Tensor,
        samplers: list[Sampler],
        masks: ChainMasks,
    ) -> tuple[torch.Tensor, list[list[torch.Tensor | None]]]:
        """``horizon`` draft passes for the requests at batch indices ``rows``; returns their drafts
        ``[len(rows), x]`` and, per pass, each one's draft distribution (rejection sampling only)."""
        rids = [batch.reqs[i].rid for i in rows]
        private = torch.tensor([self.draft_pool.row_index(r) for r in rids], dtype=torch.int64, device=self.device)
        kept = torch.tensor([self.draft_pool.kept_len(r) for r in rids], dtype=torch.int64, device=self.device)
        scratch = torch.stack([self.draft_pool.scratch_slots(r) for r in rids]).to(self.device)
        rejection = self.cfg.verification == "rejection"
        seed_positions = committed[rows].tolist()  # once: a per-pass .tolist() would sync the device each pass
        tokens, drafts, probs = seeds[rows], [], []
        for j in range(self.horizon):
            fb = self.forwards.draft(batch, tokens, private, kept + j + 1, scratch[:, j], committed[rows] + j)
            logits = self.passes.draft(fb).float()
            masks.fill(j, rows)
            masks.apply(logits, j, rows)
            tokens, q = draws(logits, [samplers[i] for i in rows], [p + j + 1 for p in seed_positions], rejection)
            for r, i in enumerate(rows):
                masks.advance(i, int(tokens[r]))
            drafts.append(tokens)
            probs.append(q)
        masks.fill(self.horizon, rows)  # the bonus position
        if self.metrics is not None:
            self.metrics.draft_passes.inc(self.horizon)
        return torch.stack(drafts, dim=1), probs

    def _decode(self, batch: ScheduleBatch, on_publish: Callable | None) -> GenerationBatchResult:
        started = time.perf_counter()
        reqs, bs = batch.reqs, len(batch.reqs)
        seeds = batch.spec_info.seeds.to(self.device)
        committed = batch.seq_lens.to(torch.int64)
        plans = [self._plans[req.rid] for req in reqs]
        if self._seeded is not None:
            self._seeded.follow(batch.sampling_info)
        drafting = [
            i
            for i, (req, plan) in enumerate(zip(reqs, plans, strict=True))
            if plan.drafts and self.draft_pool.has(req.rid)
        ]
        x = self.horizon if drafting else 0
        width = x + 1
        samplers = [plan.sampler for plan in plans]
        grammars = {i: req.grammar for i, req in enumerate(reqs) if req.grammar is not None and plans[i].drafts}
        masks = ChainMasks(grammars, width, self.model_runner.model_config.vocab_size, self.device)
        if self.offload is not None:
            self.offload.plan(reqs)
        drafts = torch.zeros((bs, x), dtype=torch.int64, device=self.device)
        counts: dict[int, int] = {}  # batch index -> its drafts (the rest of its row is padding)
        draft_q: dict[int, list[torch.Tensor | None]] = {}  # ... and their distributions (rejection)
        windowed = [i for i in drafting if self.lookup is not None and reqs[i].rid in self.lookup]
        stepped = [i for i in drafting if i not in windowed]
        if stepped:
            drafts[stepped], probs = self._draft(batch, stepped, seeds, committed, samplers, masks)
            for r, i in enumerate(stepped):
                counts[i], draft_q[i] = x, [probs[j][r] for j in range(x)]
        if windowed:
            windows, passes = self.lookup.draft(
                batch, windowed, seeds, committed, samplers, {i: grammars[i] for i in windowed if i in grammars}
            )
            for i, window in zip(windowed, windows, strict=True):
                counts[i], draft_q[i] = len(window.drafts), window.draft_probs
                drafts[i, : counts[i]] = torch.tensor(window.drafts, dtype=torch.int64, device=self.device)
                if window.grammar is not None:
                    masks.adopt(i, window)
            if self.metrics is not None:
                self.metrics.draft_passes.inc(passes)
                self.metrics.lookup_drafted.inc(sum(w.sources.count("lookup") for w in windows))
        masks.fill(0)  # requests verified without drafts
        masks.restore()
        chain = torch.cat([seeds[:, None], drafts], dim=1)  # [bs, x + 1]
        positions = committed[:, None] + torch.arange(width, device=self.device)[None]
        req_to_token = self.model_runner.req_to_token_pool.req_to_token
        slots = req_to_token[batch.req_pool_indices.to(torch.int64)[:, None], positions].to(torch.int64)

        def verify(rows: torch.Tensor) -> torch.Tensor:
            rows = rows.to(self.device)
            return self.passes.verify(self.forwards.verify(batch, rows, chain[rows], committed[rows], slots[rows]))

        def decide(i: int, chain_logits: torch.Tensor) -> Verdict:
            k = counts.get(i, 0)
            return verdict(
                drafts[i, :k].tolist(),
                draft_q.get(i, []),
                chain_logits[: k + 1],
                int(committed[i]),
                samplers[i],
                self.cfg.verification == "rejection",
            )

        refreshing = self.compressor.refreshes and bool(drafting)
        folded: dict[int, Verdict] = {}  # offloaded: decided and folded in while the reload was lent

        def fold_while_lent(rows: list[int], group: torch.Tensor) -> None:
            """Refresh reads a request's whole full KV, which when offloaded is on the device
            only while its reload is lent to the verify pass: decide and fold its rows then."""
            group = group.view(len(rows), width, -1).float()
            for r, i in enumerate(rows):
                if i in counts:
                    masks.apply_chain(i, group[r])
                    folded[i] = v = decide(i, group[r])
                    self._fold(
                        reqs[i],
                        int(committed[i]),
                        slots[i, : v.accepted + 1],
                        self._capture.rows(r * width, v.accepted + 1),
                    )

        with self._capture.capturing() if refreshing else contextlib.nullcontext():
            flat = (
                verify(torch.arange(bs))
                if self.offload is None
                else self.offload.verify(
                    reqs,
                    verify,
                    width,
                    fold_while_lent if refreshing else None,
                    partial(self.passes.recompute, batch, committed),
                )
            )
        logits = flat.view(bs, width, -1).float()
        masks.apply_chains(logits, done=folded)
        own_ids, own = (
            self.passes.own_tokens(batch, flat.view(bs, width, -1)[:, 0], slots)
            if any(p.own for p in plans)
            else (None, None)
        )
        verdicts = [
            Verdict(0, [int(own_ids[i])]) if plan.own else folded[i] if i in folded else decide(i, logits[i])
            for i, plan in enumerate(plans)
        ]
        packed = pack(verdicts, width, committed)
        self._commit(batch, packed, chain, committed, slots, width if refreshing else 0, set(folded))
        self._capture.clear()
        if self.metrics is not None:
            accepted = [v.accepted for i, v in enumerate(verdicts) if i in counts]
            self.metrics.verified(
                accepted,
                [counts[i] for i in sorted(counts)],
                time.perf_counter() - started,
                undrafted=len(verdicts) - len(accepted),
            )
            self.metrics.compressed_kv.set(self.draft_pool.nbytes())
            self.metrics.target_verify_forwards(self.passes.drain_target_verify_forwards())
            if self.offload is not None:
                self.offload.count_into(self.metrics)
        batch.forward_mode = ForwardMode.DECODE
        if on_publish is not None:
            on_publish(packed.new_seq_lens)
        return GenerationBatchResult(
            logits_output=step_output(flat, logits, reqs, plans, verdicts, own),
            next_token_ids=packed.output_ids.reshape(-1),
            accept_lens=packed.accept_lens,
            new_seq_lens=packed.new_seq_lens,
            next_draft_input=VeriCacheDraftInput(seeds=packed.next_seeds),
            speculative_num_draft_tokens=width,
            can_run_cuda_graph=False,
        )

    def _commit(
        self,
        batch: ScheduleBatch,
        packed: PackedVerdicts,
        chain: torch.Tensor,
        committed: torch.Tensor,
        slots: torch.Tensor,
        captured_width: int = 0,
        folded: Container[int] = (),
    ) -> None:
        """The seed and the accepted drafts now have exact K/V in the target pool: fold it into the
        compressed KV (batch indices in ``folded`` already were) and the store. The correction/bonus
        token is the next seed (no K/V yet).

        ``captured_width``: the verify pass's queries were captured, ``captured_width`` rows per
        request; the compressor refreshes each drafting request's rows from its committed tokens'."""
        for i, req in enumerate(batch.reqs):
            n = packed.verdicts[i].accepted + 1
            if self.draft_pool.has(req.rid) and i not in folded:
                queries = self._capture.rows(i * captured_width, n) if captured_width else None
                self._fold(req, int(committed[i]), slots[i, :n], queries)
            if self.lookup is not None:
                self.lookup.extend(req.rid, packed.verdicts[i].tokens)  # committed; the last is the next seed
            if self.offload is not None:
                self.offload.offload(req, int(committed[i]) + n, chain[i, :n].tolist())  # seed + accepted

    def _fold(self, req: Req, start: int, slots: torch.Tensor, queries: list[torch.Tensor] | None) -> FullKV:
        """Fold the exact K/V of ``req``'s tokens at ``slots`` (positions from ``start``) into its
        draft row; with ``queries`` (theirs, in the verify pass) the compressor refreshes the row
        from the full KV in SGLang's pool (read per layer, never copied whole). Returns that K/V."""
        pool = self.model_runner.token_to_kv_pool
        end = start + int(slots.numel())
        full = read_full_kv(pool, slots, self.layout)
        refresh = None
        if queries is not None:
            row = self.model_runner.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :end]
            refresh = (PoolParts(pool, row, self.layout.num_layers), queries)  # refresh scores in float32
            self._count("refreshes")
        self.draft_pool.commit(req.rid, full, torch.arange(start, end), refresh)
        return full

    def _count(self, name: str) -> None:
        if self.metrics is not None:
            getattr(self.metrics, name).inc()

    def _store_error(self, error: BaseException) -> None:
        from remote_store import refused

        if self.metrics is not None:
            self.metrics.store_error("refused" if refused(error) else "outage")

    def note_request_finished(self, *, rid: str, natural_stop: bool) -> None:
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        """Drop what the worker keeps for ``rid`` (it finished, left, or prefills again)."""
        if self.draft_pool is not None:
            self.draft_pool.release(rid)
        self._plans.pop(rid, None)
        if self.lookup is not None:
            self.lookup.forget(rid)
        if self._capture is not None:
            self._capture.forget(rid)
        if self.offload is not None:
            self.offload.forget(rid)
