"""The batch engine: many requests decoded together, under a device-KV budget.

Every iteration is one forward over all running requests' segments (their tokens share the
matmuls; each attends to its own KV). Modes, all on the same runner and budget:

- ``full_resident``: the full KV on the device; as many requests as their full KV fits run, the
  rest wait (continuous batching).
- ``full_offloaded``: the full KV in the store, streamed in for every decode step (layer by layer,
  double-buffered, so a request holds 2/L of its full KV on the device); link-bound.
- ``lossy``: the compressed KV alone.
- ``vericache`` with ``schedule="lockstep"``: every request drafts x tokens, then all verify in the
  same iteration (conventional speculative decoding; the reloads flood the link together).
- ``vericache`` with ``schedule="staggered"``: the core scheduler (``core/schedule.py``) spreads the
  verifications so a few reloads are in flight at once, each started early enough to finish
  before its request's verify iteration, within the link and memory rings; the batch keeps room
  for the reloads its verifications need at once.

The device here is whatever the runner runs on; "device bytes" are accounted, as a GPU's would be.
"""

from __future__ import annotations

import functools
import math
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from vericache_sglang.core.compress import Compressor
from vericache_sglang.core.schedule import StaggeredScheduler
from vericache_sglang.engine.batch_jobs import BatchConfig, BatchStats, Job, PlainRequest, union_length
from vericache_sglang.engine.fetch import FullKVFetch, release_frames
from vericache_sglang.engine.generation import GenerationConfig, GenerationResult, Prefill
from vericache_sglang.engine.prefill import recompute_full_kv
from vericache_sglang.engine.prefix import RegisteredPrefix
from vericache_sglang.engine.request import VeriCacheRequest
from vericache_sglang.engine.runner import DraftKV, ModelRunner, ResidentKV, Segment, SegmentOutput, StreamedKV
from vericache_sglang.full_kv.store import FullKVStore


class BatchEngine:
    def __init__(
        self,
        runner: ModelRunner,
        store: FullKVStore,
        compressor: Compressor,
        batch: BatchConfig,
        gen: GenerationConfig,
        tokenizer: object | None = None,
    ):
        self.runner = runner
        self.store = store
        self.compressor = compressor
        self.batch = batch
        self.gen = gen
        self.tokenizer = tokenizer
        self.per_token = runner.layout.bytes_per_token
        self.queue: deque[Job] = deque()
        self._lock = threading.Lock()  # submit() may run on other threads (a server)
        self.jobs: dict[str, Job] = {}
        self.intake: Callable[[], None] | None = None  # called every iteration: a server prefills arrivals
        self.stats = BatchStats()
        self.results: dict[str, GenerationResult] = {}
        self._fetch_intervals: list[tuple[float, float]] = []
        self._largest_reload = 0
        self._iteration_s: float | None = None  # the staggered scheduler's last estimate, kept across batches

    def submit(
        self,
        pre: Prefill,
        request_id: str,
        gen: GenerationConfig | None = None,
        compressor: Compressor | None = None,
        on_commit: Callable[[list[int]], None] | None = None,
        on_done: Callable[[GenerationResult], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        """Queue a prefilled request; ``gen`` and ``compressor`` default to the engine's."""
        if (gen or self.gen).constraint is not None and self.batch.mode != "vericache":
            raise ValueError(f"constrained decoding runs in the batch's 'vericache' mode, not {self.batch.mode!r}")
        self._queue(Job(request_id, pre, gen or self.gen, compressor or self.compressor, on_commit, on_done, on_error))

    def submit_prefixed(
        self,
        prompt: list[int],
        prefix: RegisteredPrefix,
        request_id: str,
        gen: GenerationConfig | None = None,
        on_commit: Callable[[list[int]], None] | None = None,
        on_done: Callable[[GenerationResult], None] | None = None,
        on_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        """Queue a request whose prompt starts with ``prefix``: no prefill, it drafts at once over a
        copy of the prefix's compressed KV (so it uses the prefix's compressor)."""
        if self.batch.mode != "vericache":
            raise ValueError(f"a request without a prefill needs mode 'vericache', not {self.batch.mode!r}")
        if not (len(prefix.tokens) < len(prompt) and prompt[: len(prefix.tokens)] == prefix.tokens):
            raise ValueError(f"request {request_id}: the prompt does not start with prefix {prefix.name!r}")
        self._queue(
            Job(
                request_id,
                None,
                gen or self.gen,
                prefix.compressor,
                on_commit,
                on_done,
                on_error,
                prefix=prefix,
                prompt=list(prompt),
            )
        )

    def _queue(self, job: Job) -> None:
        request_id = job.rid
        with self._lock:
            if request_id in self.jobs:
                raise ValueError(f"request id {request_id!r} is already in use")
            self.jobs[request_id] = job
            self.queue.append(job)

    # device-byte accounting
    def _full_reserve(self, job: Job) -> int:
        return (len(job.prompt) + job.gen.max_new_tokens) * self.per_token

    def _compressed_reserve(self, job: Job) -> int:
        # the compressed prompt plus every committed token's exact K/V (what an online update appends)
        if job.compressed_bytes is None and job.prefix is not None:  # its own tokens, exact, until verified
            job.compressed_bytes = (
                job.prefix.compressed_kv_bytes + (len(job.prompt) - len(job.prefix.tokens)) * self.per_token
            )
        elif job.compressed_bytes is None:
            job.ckv = job.compressor.compress(job.pre.kv, job.pre.obs)
            job.compressed_bytes = job.ckv.nbytes
        return job.compressed_bytes + job.gen.max_new_tokens * self.per_token

    def _device_need(self, job: Job) -> int:
        mode = self.batch.mode
        if mode == "full_resident":
            return self._full_reserve(job)
        if mode == "full_offloaded":  # two layers' worth of its full KV in flight (double buffering)
            return 2 * self._full_reserve(job) // self.runner.layout.num_layers
        if mode == "vericache" and self.batch.schedule == "lockstep":
            # every request's reload is on the device at once, at each common verification
            return self._compressed_reserve(job) + self._full_reserve(job)
        return self._compressed_reserve(job)

    def run(self) -> dict[str, GenerationResult]:
        """Decode everything queued to the end."""
        start = time.monotonic()
        if self.batch.mode == "vericache":
            self._run_vericache()
        else:
            self._run_plain()
        self.stats.wall_s = time.monotonic() - start
        self.stats.transfer_s = union_length(self._fetch_intervals)
        self.stats.generated_tokens = sum(len(r.tokens) for r in self.results.values())
        return self.results

    def serve(self, stop: threading.Event, idle_s: float = 0.005) -> None:
        """Decode requests as they arrive until ``stop`` is set (a server's engine thread). A failure
        inside a batch fails that batch's requests through ``on_error``; nothing unverified was
        emitted, and serving goes on."""
        while not stop.is_set():
            if self.intake is not None:
                self.intake()
            if not self.queue:
                stop.wait(idle_s)
                continue
            running: dict = {}
            self._fetch_intervals.clear()  # summed by run() alone; a server's would grow forever
            try:
                if self.batch.mode == "vericache":
                    self._run_vericache(running)
                else:
                    self._run_plain(running)
            except Exception as e:  # the failure goes to every request it touched
                release_frames(e)  # the batch's frames held every running request's KV
                for rid, (req, _) in list(running.items()):
                    running.pop(rid)
                    self._fail(rid, req, e)

    def _fail(self, rid: str, req: object, error: BaseException) -> None:
        job = self.jobs.pop(rid, None)
        release = getattr(req, "release", None)
        try:
            if release is not None:
                release()
        except Exception:  # the request has failed already; its store handle may be gone
            pass
        if job is not None and job.on_error is not None:
            job.on_error(error)

    def _finish(self, rid: str, result: GenerationResult) -> None:
        job = self.jobs.pop(rid, None)
        if job is not None and job.on_done is not None:
            job.on_done(result)
        else:
            self.results[rid] = result

    def _join(
        self, running: dict, used: int, reloads: Callable[[int, Job], int] | None = None, limit: int | None = None
    ) -> int:
        """Move queued requests into the batch while their device bytes fit; return bytes in use.
        ``reloads(n, job)``: how many full-KV reloads must also fit once ``n`` requests run (a
        staggered batch), each as large as the largest request's."""
        if self.intake is not None:
            self.intake()
        limit = self.batch.max_running if limit is None else min(limit, self.batch.max_running)
        while self.queue and len(running) < limit:
            job = self.queue[0]
            try:
                need = self._device_need(job)
                unit = max(self._largest_reload, self._full_reserve(job))
                reserve = 0 if reloads is None else unit * reloads(len(running) + 1, job)
                if used + need + reserve > self.batch.kv_budget_bytes:
                    if running:
                        break  # it waits for room
                    raise ValueError(
                        f"request {job.rid} needs {need + reserve} device bytes; the budget is "
                        f"{self.batch.kv_budget_bytes}"
                    )
                with self._lock:
                    self.queue.popleft()
                req = self._start(job)
            except Exception as e:  # this request cannot start (bad input, budget): it fails alone
                with self._lock:
                    if self.queue and self.queue[0] is job:
                        self.queue.popleft()
                self.jobs.pop(job.rid, None)
                if job.on_error is None:
                    raise
                job.on_error(e)
                continue
            if reloads is not None:
                self._largest_reload = unit
            running[job.rid] = (req, need)
            used += need
        return used

    def _start(self, job: Job):
        mode, rid, pre = self.batch.mode, job.rid, job.pre
        job.pre = None  # the request keeps what it needs of the prefill; the job lives until it ends
        if mode == "vericache" and job.prefix is not None:
            return VeriCacheRequest(
                self.runner,
                None,
                job.compressor,
                self.store,
                job.gen,
                self.tokenizer,
                job.on_commit,
                request_id=rid,
                recompute=functools.partial(recompute_full_kv, self.runner),
                prompt=job.prompt,
                prefix_ckv=job.prefix.ckv.clone(),
                prefix_len=len(job.prefix.tokens),
            )
        ckv, job.ckv = job.ckv, None
        if mode == "vericache":
            return VeriCacheRequest(
                self.runner,
                pre,
                job.compressor,
                self.store,
                job.gen,
                self.tokenizer,
                job.on_commit,
                request_id=rid,
                recompute=functools.partial(recompute_full_kv, self.runner),
                ckv=ckv,
            )
        req = PlainRequest(rid, pre, job.gen, mode, self.tokenizer, job.compressor, job.on_commit)
        if mode == "full_resident":
            req.ctx = ResidentKV.from_full(pre.kv, len(pre.tokens) + job.gen.max_new_tokens, self.runner.device)
        elif mode == "lossy":
            req.ckv = ckv if ckv is not None else job.compressor.compress(pre.kv, pre.obs)
        else:
            req.kv = self.store.open_request(pre.tokens, rid)
            req.kv.extend_tokens(req.tokens[len(pre.tokens) :])
            req.pending = (0, pre.kv.layers)
        return req

    # full-KV resident, offloaded, lossy: one token per request per iteration
    def _run_plain(self, running: dict | None = None) -> None:
        running = {} if running is None else running
        used = self._join(running, 0)
        layers = self.runner.layout.num_layers
        while running:
            segments, owners = [], []
            for req, _ in running.values():
                if req.out.stop.done:
                    continue
                pos = len(req.tokens) - 1
                if self.batch.mode == "full_resident":
                    ctx = req.ctx
                elif self.batch.mode == "lossy":
                    ctx = DraftKV(req.ckv)
                else:
                    req.feed = FullKVFetch(
                        req.kv, pos, layers, req.pending, req.cfg.fetch_timeout_s, device=self.runner.device, room=1
                    )
                    req.pending = None
                    ctx = StreamedKV(req.feed)
                keep = int(self.batch.mode == "lossy" and req.compressor.update_queries)
                segments.append(Segment([req.tokens[-1]], [pos], ctx, logits="last", keep_queries=keep))
                owners.append(req)
            outs = self._forward(segments)
            for req, out in zip(owners, outs, strict=True):
                pos = len(req.tokens) - 1
                if self.batch.mode == "lossy":
                    req.compressor.commit(req.ckv, out.kv, torch.tensor([pos]), out.queries)
                elif self.batch.mode == "full_offloaded":
                    self._account_fetch(req.feed, None, wait=True)
                    req.pending = (pos, out.kv)  # written by the next step's fetch, before it reads
                req.take(out)
                if self.batch.mode == "full_offloaded":
                    req.kv.extend_tokens(req.tokens[-1:])
            self._end_iteration(running)
            for rid in [r for r, (req, _) in running.items() if req.out.stop.done]:
                req, need = running.pop(rid)
                used -= need
                if self.batch.mode == "full_offloaded":
                    req.kv.release()
                self._finish(rid, req.result())
            used = self._join(running, used)

    def _forward(self, segments: list[Segment]) -> list[SegmentOutput]:
        if not segments:
            return []
        self.stats.rows += sum(len(s.tokens) for s in segments)
        before = self.runner.attended_keys
        try:
            return self.runner.forward(segments)
        finally:
            self.stats.attended_keys += self.runner.attended_keys - before

    def _end_iteration(self, running: dict) -> None:
        self.stats.iterations += 1
        self.stats.peak_running = max(self.stats.peak_running, len(running))
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, sum(n for _, n in running.values()))

    # VeriCache
    def _run_vericache(self, running: dict | None = None) -> None:
        running = {} if running is None else running
        if self.batch.schedule == "lockstep":
            return self._run_lockstep(running)
        self._largest_reload = 0  # the largest reload a running request may need
        used = 0
        if self._iteration_s is None:  # time one iteration (of one request) before sizing the batch on it
            used = self._finish_done(running, self._join(running, 0, reloads=lambda n, job: 1, limit=1))
            if running:
                self._iteration_s = self._time_iteration(running)
        sched = StaggeredScheduler(
            self.batch.window,
            iteration_s=self._iteration_s or 0.05,
            link_bytes_s=self._link_estimate(),
            memory_capacity=self.batch.kv_budget_bytes,
        )
        reloads = functools.partial(self._reloads_needed, sched)
        used = self._finish_done(running, self._join(running, used, reloads=reloads))
        sched.set_memory_capacity(self.batch.kv_budget_bytes - used)
        to_admit = list(running)
        while running:
            for rid in to_admit:
                self._admit(sched, rid, running)
            self._start_windows(sched, sched.retry_waiting(), running)
            t = time.monotonic()
            for res in sched.reloads_starting():
                running[res.request_id][0].start_fetch()
            verifying = {r.request_id for r in sched.verifying()}
            self.stats.max_verifies_per_iteration = max(self.stats.max_verifies_per_iteration, len(verifying))
            segments, owners = [], []
            for rid, (req, _) in running.items():
                if rid in verifying:
                    self.stats.stall_s += req.wait_fetch()
                    segments.append(req.verify_segment())
                    owners.append((rid, req, True))
                elif rid in sched.reservations:
                    if req.drafting:
                        segments.append(req.draft_segment())
                        owners.append((rid, req, False))
                else:
                    self.stats.waiting_iterations += 1
            outs = self._forward(segments)
            to_admit, finished = [], []
            for (rid, req, is_verify), out in zip(owners, outs, strict=True):
                if not is_verify:
                    req.take_draft(out)
                    continue
                self._account_fetch(req.feed, sched)
                req.take_verify(out)
                sched.complete(rid)
                self.stats.verify_passes += 1
                (finished if req.done else to_admit).append(rid)
            for rid in finished:
                req, need = running.pop(rid)
                used -= need
                req.release()
                self._finish(rid, req.result())
            before = set(running)
            used = self._finish_done(running, self._join(running, used, reloads=reloads))
            to_admit += [rid for rid in running if rid not in before]
            sched.set_memory_capacity(self.batch.kv_budget_bytes - used)
            self._end_iteration(running)
            sched.observe_iteration(time.monotonic() - t)
            self._iteration_s = sched.iteration_s
            sched.tick()

    def _reloads_needed(self, sched: StaggeredScheduler, requests: int, job: Job) -> int:
        """Reloads that must fit on the device at once for ``requests`` requests to each verify every
        horizon + 1 iterations: each holds its memory over its span and its verify iteration. A
        batch whose compressed KVs leave room for fewer makes its requests wait for verification
        slots with their memory taken, so a request joins only while this many still fit (at
        least one, or no verification could ever be scheduled; at most one per request)."""
        span, _ = sched.reload_span(self._full_reserve(job))
        return min(requests, max(1, math.ceil(requests * (span + 1) / (job.gen.horizon + 1))))

    def _time_iteration(self, running: dict) -> float:
        """Time one draft forward of the batch and discard it: the scheduler's first iteration-time
        estimate. A guess would misplace the whole first round of reloads (too short an iteration
        spreads the verifications over far more iterations than the link needs, and the requests
        draft far past their horizon meanwhile). Each window the scheduler opens starts afresh."""
        reqs = [req for req, _ in running.values()]
        for req in reqs:
            req.begin_window(max(1, req.next_horizon()))
        t = time.monotonic()
        self._forward([req.draft_segment() for req in reqs if req.drafting])
        return max(time.monotonic() - t, 1e-4)

    def _finish_done(self, running: dict, used: int) -> int:
        """Requests that ended with the prefill's token (max_new_tokens=1, EOS) leave at once."""
        for rid in [rid for rid, (req, _) in running.items() if req.done]:
            req, need = running.pop(rid)
            used -= need
            req.release()
            self._finish(rid, req.result())
        return used

    def _link_estimate(self) -> float:
        """The link's bandwidth before any fetch was measured: the emulator's setting, or a guess the
        scheduler corrects from the first measured fetches."""
        return getattr(self.store.backend, "bandwidth_bytes_s", None) or 1e10

    def _account_fetch(self, feed, sched: StaggeredScheduler | None, wait: bool = False) -> None:
        if not isinstance(feed, FullKVFetch):
            return
        feed.join()
        duration = (feed.finished or time.monotonic()) - feed.started
        self._fetch_intervals.append((feed.started, feed.started + duration))
        self.stats.fetched_bytes += feed.bytes_fetched
        if wait:
            self.stats.stall_s += feed.wait_s
        if sched is not None:
            sched.observe_link(feed.bytes_moved, duration)

    def _admit(self, sched: StaggeredScheduler, rid: str, running: dict) -> None:
        """Schedule the request's next verification; every request admitted now starts drafting."""
        req = running[rid][0]
        admitted = sched.admit(
            rid,
            req.next_reload_bytes(),
            max(1, req.next_horizon()),
            # the verify pass assembles the whole full KV on the device (held rows copied in, not fetched)
            device_bytes=req.full_kv_bytes(),
        )
        self._start_windows(sched, admitted, running)

    def _start_windows(self, sched: StaggeredScheduler, admitted: dict, running: dict) -> None:
        for res in admitted.values():
            req = running[res.request_id][0]
            gap = res.verify_at - sched.now  # iterations left to draft in before the verification
            req.begin_window(req.next_horizon(gap) if self.batch.draft_until_verify else min(gap, req.next_horizon()))

    def _run_lockstep(self, running: dict) -> None:
        used = self._finish_done(running, self._join(running, 0))
        while running:
            reqs = [req for req, _ in running.values()]
            x = max(req.next_horizon() for req in reqs)
            for req in reqs:  # every reload starts together, and they share the link
                req.start_fetch()
                req.begin_window(req.next_horizon(x))
            for _ in range(x):
                drafting = [req for req in reqs if req.drafting]
                outs = self._forward([r.draft_segment() for r in drafting])
                for req, out in zip(drafting, outs, strict=True):
                    req.take_draft(out)
                self._end_iteration(running)
            self.stats.max_verifies_per_iteration = max(self.stats.max_verifies_per_iteration, len(reqs))
            for req in reqs:
                self.stats.stall_s += req.wait_fetch()
            outs = self._forward([req.verify_segment() for req in reqs])
            for req, out in zip(reqs, outs, strict=True):
                self._account_fetch(req.feed, None)
                req.take_verify(out)
                self.stats.verify_passes += 1
            self._end_iteration(running)
            used = self._finish_done(running, self._join(running, self._finish_done(running, used)))
