"""The full KV off the device between verifications, inside the worker: each request's full KV
leaves the device after prefill and after every verification, and comes back, per layer, only for
its verifications. Where it lives is the *tier*: ``full_kv: "host"``, SGLang's host pool
(``host_tier.HostFullKV``); ``full_kv: "store"``, the full-KV store only (``store_tier.StoreFullKV``:
our gRPC store, Redis, LMCache), fetched while the draft passes run.

One scheduler step of the worker is a run of *iterations* on the core scheduler's clock: the
``horizon`` draft passes (every request drafts in each), then verify passes, each over the group of
requests the scheduler placed there. Every request verifies once per step (SGLang emits tokens
for every running request at every step), so its verification is placed at or after the last
draft pass (``not_before``); its reload starts earlier, while drafting runs, on the link and
memory rings. Groups verify one after another, so the device holds the full KV of the requests
verifying next, not of the whole batch.

What can fail, and what happens (never an unverified token):

- the tier does not take an offload (host pool full, store down or refusing): those positions stay
  on the device (no saving for them, still exact), counted;
- a reload does not deliver (store down, a record evicted, missing or corrupt): the worker
  recomputes those positions from the request's committed tokens into the reload's slots, a
  forward pass over them, counted; before the group's verify pass where the failure is known by
  then, else after it (the pass read the reload per layer as it arrived), and the pass runs again.

Pieces: the tier, ``RequestOffload`` (which row positions are off the device; the vericache radix
cache consults it when SGLang frees a row), ``SlotArena`` (the reload room, taken from the
scheduler's allocator while any request is offloaded and given back when none is, so SGLang's idle
leak check holds) and ``StaggeredReloads`` (the core scheduler's plan carried out).

Tested on CPU inside real SGLang servers (tests/sglang/test_sglang_e2e_modes.py: answers identical to
stock SGLang, the device pool's peak usage below stock's) and piece by piece on SGLang's objects
(tests/sglang/test_sglang_host_tier.py, test_sglang_offload.py, test_sglang_store_tier.py); on a GPU unverified.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from remote_store import StoreError
from vericache_sglang.core.schedule import StaggeredScheduler
from vericache_sglang.sglang.config import VeriCacheConfig
from vericache_sglang.sglang.draft.radix_cache import tree_for
from vericache_sglang.sglang.full_kv.host_tier import HostFullKV, HostTierFull
from vericache_sglang.sglang.full_kv.offload_rows import RequestOffload, SlotArena, register_offload
from vericache_sglang.sglang.full_kv.reloads import StaggeredReloads

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.allocator.base import BaseTokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.model_executor.model_runner import ModelRunner

    from vericache_sglang.core.kv import KVLayout
    from vericache_sglang.sglang.full_kv.store_tier import StoreFullKV
    from vericache_sglang.sglang.metrics import WorkerMetrics

logger = logging.getLogger(__name__)
LINK_PROBE_BYTES = 64 << 20
# what an offload the tier did not take raises (nothing was recorded; the slots stay); anything
# else is a bug and propagates
NOT_TAKEN = (HostTierFull, StoreError)
Recompute = Callable[[int, int, torch.Tensor], None]  # (batch index, first position, slots)


def measure_link(device: torch.device | str) -> float:
    """Host-to-device bytes/s of one pinned copy (the scheduler's first estimate; reloads refine it)."""
    device = torch.device(device)
    pinned = device.type == "cuda"
    src = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=pinned)
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=pinned)  # warm-up
    if pinned:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    dst.copy_(src, non_blocking=pinned)
    if pinned:
        torch.cuda.synchronize(device)
    return LINK_PROBE_BYTES / max(time.perf_counter() - t0, 1e-9)


class FullKVOffload:
    def __init__(
        self,
        cfg: VeriCacheConfig,
        model_runner: ModelRunner,
        allocator: BaseTokenToKVPoolAllocator,
        on_release: Callable[[str], None],
        tier: StoreFullKV | None = None,
        on_error: Callable[[BaseException], None] | None = None,
        hicache: bool = False,
    ):
        """``tier``: where the full KV goes (default: a host pool of ``cfg.host_pool_ratio`` times the
        device pool); ``on_error``: told of each offload the tier did not take; ``hicache``: SGLang's
        HiCache tree is the radix cache (``admit`` publishes prompts to it, and the host tier leaves
        the pool's layer counter to HiCache's controller)."""
        pool = model_runner.token_to_kv_pool
        if pool.page_size != 1:
            raise ValueError(f"full_kv={cfg.full_kv} needs --page-size 1 (offloaded rows move token by token)")
        self.horizon = cfg.horizon
        self.allocator = allocator
        self.arena_slots = max(1, int(pool.size * cfg.reload_room))
        self.tier = tier or HostFullKV(
            pool, capacity_tokens=max(1, int(pool.size * cfg.host_pool_ratio)), per_layer=not hicache
        )
        self.publish_prompts = hicache
        self.ledger = RequestOffload(self.tier, model_runner.req_to_token_pool, allocator)
        self.ledger.on_release.append(self._released)
        self._on_release = on_release
        self._on_error = on_error
        register_offload(allocator, self.ledger)
        if model_runner.token_to_kv_pool_allocator is not allocator:
            register_offload(model_runner.token_to_kv_pool_allocator, self.ledger)
        # the window: the drafts, then room for verify groups past them
        self.window = 4 * (cfg.horizon + 1)
        self.scheduler = StaggeredScheduler(
            window=self.window,
            iteration_s=0.0,
            link_bytes_s=measure_link(pool.device),
            memory_capacity=self.arena_slots * self.tier.bytes_per_token,
        )
        self.offloaded_bytes = 0  # totals, for the worker's metrics
        self.reloaded_bytes = 0
        self.recomputed = 0  # reloads the tier did not deliver, recomputed instead
        self.passes_rerun = 0  # verify passes run again: a reload they read per layer failed mid-pass
        self.prefixes_streamed = 0  # matched prefixes unpinned from the tree, fetched per verification
        self._counted: tuple[float, ...] | None = None  # what count_into has already added to the metrics
        self._verify_from = 0
        self._unplanned: list[str] = []
        self._planned: set[str] = set()
        self.arena: SlotArena | None = None
        self.reloads: StaggeredReloads | None = None

    @classmethod
    def for_server(
        cls,
        cfg: VeriCacheConfig,
        model_runner: ModelRunner,
        allocator: BaseTokenToKVPoolAllocator,
        layout: KVLayout,
        hicache: bool,
        on_release: Callable[[str], None],
        on_error: Callable[[BaseException], None],
    ) -> FullKVOffload:
        """The offload of a server's worker: ``cfg.full_kv``'s tier (a store that cannot be used as
        configured fails the launch here). With HiCache on, its controller owns the pool's layer
        counter (registered after this) and its tree loads prefixes."""
        tier = None  # the host pool
        if cfg.full_kv == "store":
            from vericache_sglang.sglang.full_kv.store_tier import StoreFullKV

            pool, device = model_runner.token_to_kv_pool, str(model_runner.device)
            tier = StoreFullKV.connect(cfg.store, pool, layout, device, load_prefixes=not hicache)
        return cls(cfg, model_runner, allocator, on_release, tier=tier, on_error=on_error, hicache=hicache)

    # -- after prefill and after each verification --------------------------------------------

    def admit(self, req: Req, prompt_len: int) -> int:
        """A prefilled request: the tier learns its prompt and the radix-tree prefix it matched, then
        its own positions leave the device; returns tokens moved. With a tier that can fetch the
        matched prefix too (``streams_prefix``: the store holds it), it leaves with them: the request
        is unpinned from the tree and each verification fetches its whole context, so a running
        request pins no device KV; the tree's copy stays as an evictable cache for later prompts."""
        if self.publish_prompts:
            self._publish(req, prompt_len)
        start = int(req.kv.cache_protected_len)
        idx = int(req.kv.req_pool_idx)
        row = self.ledger.req_to_token[idx]
        apart = getattr(req, "cache_salt", None) is not None or getattr(req, "extra_key", None) is not None
        tree = self._prefix_tree(req, start, prompt_len, apart)
        try:
            # a retracted request prefills again over its prompt and what it had generated
            tokens = [*req.origin_input_ids, *req.output_ids][:prompt_len]
            self.tier.open(req.rid, tokens, row[:start].to(torch.int64), not apart, from_start=tree is not None)
        except NOT_TAKEN as e:
            self._not_taken(req.rid, e)
            self._close_idle_arena()
            return 0
        if tree is not None:
            req.skip_radix_cache_insert = True
            self.ledger.take_prefix(req.rid, idx, start)
            tree.unlock(req.lock)  # the tree's nodes become evictable: no running request reads them
            req.lock = None
            req.kv.cache_protected_len = 0  # the whole row is the request's (offloaded from 0)
            self.prefixes_streamed += 1
        return self.offload(req, prompt_len)

    def _publish(self, req: Req, prompt_len: int) -> None:
        """Insert ``req``'s prompt into the radix tree (SGLang's checkpoint: the row then points at
        the tree's slots, and the request's matched prefix is the whole prompt). HiCache writes what
        its tree holds through to its host pool and L3 store, which is how other servers find a
        prompt: an offloaded request is barred from the tree afterwards, so it is now or never."""
        tree = tree_for(self.allocator)
        # the worker bars every offloaded request from the tree at its first chunk; SGLang's own bar
        # (KV the token ids alone do not determine) still holds
        if tree is None or getattr(req, "lock", None) is None or req.positional_embed_overrides is not None:
            return
        tree.checkpoint(req, up_to=prompt_len)

    def _prefix_tree(self, req: Req, start: int, prompt_len: int, apart: bool) -> BasePrefixCache | None:
        """The radix tree to unpin ``req``'s matched prefix from, when it is to be fetched per
        verification instead: the tier can, one reload can carry the whole prompt, and the arena
        is there; else None (the prefix stays pinned on the device, still exact)."""
        if start <= 0 or apart or not self.tier.streams_prefix or prompt_len > self.arena_slots:
            return None
        tree = tree_for(self.allocator)
        if tree is None or getattr(req, "lock", None) is None or not self._ensure_arena():
            return None
        return tree

    def offload(self, req: Req, through: int, tokens: list[int] | None = None) -> int:
        """Move ``req``'s own positions up to ``through`` off the device (at most what one reload
        can bring back); ``tokens``: those committed since the last call. Returns tokens moved. A
        request the reload room cannot take, or whose positions the tier does not take, stays on
        the device (no saving for it, still exact)."""
        if tokens:
            self.tier.extend(req.rid, tokens)
        held = self.ledger.held(req.rid)
        start = int(req.kv.cache_protected_len) if held is None else held[0]
        end = min(through, start + self.arena_slots)
        if end <= (start if held is None else held[1]) or not self.tier.accepts(req.rid) or not self._ensure_arena():
            return 0
        req.skip_radix_cache_insert = True  # its rows are no longer the tree's to take
        try:
            moved = self.ledger.offload_through(req.rid, int(req.kv.req_pool_idx), start, end)
        except NOT_TAKEN as e:
            self._not_taken(req.rid, e)
            self._close_idle_arena()
            return 0
        self.offloaded_bytes += moved * self.tier.bytes_per_token
        return moved

    def _not_taken(self, rid: str, e: BaseException) -> None:
        logger.warning("VeriCache: request %s's full KV stays on the device for now (%s)", rid, e)
        if self._on_error is not None:
            self._on_error(e)

    # -- one step --------------------------------------------------------------------------------

    def plan(self, reqs: list[Req]) -> None:
        """This step's offloaded requests verify at or after its last draft pass; they are placed
        on the scheduler before the first pass (once an iteration has been timed)."""
        self._verify_from = self.scheduler.now + self.horizon
        self._unplanned = [req.rid for req in reqs if self._offloaded(req.rid)]
        self._planned = set()

    def draft_pass(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        """One draft pass as one iteration: this step's requests are placed (from the first pass
        that has an iteration time), the reloads due start, and the pass is timed."""
        if self.reloads is not None and self.scheduler.iteration_s > 0:
            self._admit_unplanned()
        if self.reloads is not None:
            self.scheduler.retry_waiting()
            self.reloads.start_due()
        t0 = time.perf_counter()
        out = run()
        seconds = time.perf_counter() - t0
        if self.scheduler.iteration_s > 0:
            self.scheduler.observe_iteration(seconds)
        else:
            self.scheduler.iteration_s = seconds  # the first pass ever: its own time is the estimate
        self.scheduler.tick()
        return out

    def _admit_unplanned(self) -> None:
        for rid in self._unplanned:
            gap = max(1, self._verify_from - self.scheduler.now)
            self.reloads.admit(rid, anchor_gap=gap, not_before=self._verify_from)
            self._planned.add(rid)
        self._unplanned = []

    def _offloaded(self, rid: str) -> bool:
        held = self.ledger.held(rid)
        return held is not None and held[1] > held[0]

    def verify(
        self,
        reqs: list[Req],
        verify: Callable[[torch.Tensor], torch.Tensor],
        width: int,
        lent: Callable[[list[int], torch.Tensor], None] | None = None,
        recompute: Recompute | None = None,
    ) -> torch.Tensor:
        """Run ``verify(batch_indices) -> logits [len * width, vocab]`` over groups: first the
        requests with nothing offloaded, then each group the scheduler placed, its reloads lent to
        its rows for the pass. Returns the logits of the whole batch, in batch order.

        ``lent(batch_indices, logits)``: called after each group's pass, its reloads still lent
        (``+refresh`` reads the requests' whole full KV then). ``recompute(batch_index, start,
        slots)``: computes a request's full KV of positions from ``start`` into its lent ``slots``
        when the tier did not deliver it."""
        if self._unplanned and self.reloads is not None:
            self._admit_unplanned()  # a step with no timed pass yet (horizon 0 never happens)
        index = {req.rid: i for i, req in enumerate(reqs)}
        pending = {rid for rid in index if rid in self._planned}
        out: torch.Tensor | None = None

        def run(rows: list[int], logits: torch.Tensor | None = None) -> None:
            nonlocal out
            if logits is None:
                logits = verify(torch.tensor(rows, dtype=torch.int64))
            if lent is not None:
                lent(rows, logits)
            if out is None:
                out = logits.new_empty(len(reqs) * width, logits.shape[-1])
            at = (torch.tensor(rows)[:, None] * width + torch.arange(width)[None]).reshape(-1).to(logits.device)
            out[at] = logits

        resident = [i for rid, i in index.items() if rid not in pending]
        if resident:
            run(resident)
        for _ in range(2 * self.window + len(reqs)):
            if not pending:
                break
            self.scheduler.retry_waiting()
            self.reloads.start_due()
            group = [r for r in self.reloads.verifying() if r.rid in pending]
            if group:
                for r in group:
                    self.ledger.lend(r.rid, r.slots)
                try:
                    rows = [index[r.rid] for r in group]
                    # a reload known to have failed is recomputed first; the pass reads the others per
                    # layer as they arrive, and runs again if one of them turns out not delivered
                    ended = {r.rid: self.tier.ended(r.rid) for r in group}  # asked once: fetches go on
                    for r in group:
                        if ended[r.rid]:
                            self._delivered(r.rid, index[r.rid], r.slots, recompute)
                    arriving = [r for r in group if not ended[r.rid]]
                    self.reloads.before_verify(group)
                    logits = verify(torch.tensor(rows, dtype=torch.int64))
                    # a list, not a generator: every failed reload is recomputed before the pass runs again
                    if not all([self._delivered(r.rid, index[r.rid], r.slots, recompute) for r in arriving]):
                        logits = verify(torch.tensor(rows, dtype=torch.int64))
                        self.passes_rerun += 1
                    run(rows, logits)
                finally:
                    for r in group:
                        self.ledger.unlend(r.rid)
                    self.reloads.after_verify(group)
                pending -= {r.rid for r in group}
            self.scheduler.tick()
        if pending:
            # never emit unverified tokens: the step fails and the scheduler aborts these requests
            raise RuntimeError(f"full_kv offloaded: {len(pending)} verifications found no reload slot this step")
        assert out is not None
        return out

    def _delivered(self, rid: str, i: int, slots: torch.Tensor, recompute: Recompute | None) -> bool:
        """Whether ``rid``'s reload is in ``slots`` (waiting for it); where the tier did not
        deliver it, it is recomputed there (False)."""
        error = self.tier.failed(rid)
        if error is None:
            self.reloaded_bytes += int(slots.numel()) * self.tier.bytes_per_token
            return True
        if recompute is None:
            raise RuntimeError(f"request {rid}: its full KV was not delivered ({error}) and nothing recomputes it")
        if self._on_error is not None:
            self._on_error(error)
        recompute(i, self.ledger.held(rid)[0], slots)
        self.recomputed += 1
        return False

    def count_into(self, metrics: WorkerMetrics) -> None:
        """Add what moved since the last call to the worker's metrics."""
        now = (
            self.offloaded_bytes,
            self.reloaded_bytes,
            self.recomputed,
            getattr(self.tier, "prefix_hits", 0),
            getattr(self.tier, "prefix_tokens_loaded", 0),
            getattr(self.tier, "prefix_errors", 0),
            self.prefixes_streamed,
            getattr(self.tier, "fetch_s", 0.0),
            getattr(self.tier, "verify_wait_s", 0.0),
            self.passes_rerun,
        )
        counters = (
            metrics.full_kv_written,
            metrics.full_kv_fetched,
            metrics.full_kv_recomputes,
            metrics.store_prefix_hits,
            metrics.store_prefix_tokens,
            metrics.store_prefix_fallbacks,
            metrics.prefixes_streamed,
            metrics.fetch_seconds,
            metrics.link_wait,
            metrics.verify_passes_rerun,
        )
        for counter, value, seen in zip(counters, now, self._counted or (0,) * len(now), strict=True):
            counter.inc(value - seen)
        self._counted = now

    # -- lifecycle ---------------------------------------------------------------------------------

    def _ensure_arena(self) -> bool:
        if self.arena is not None:
            return True
        try:
            self.arena = SlotArena(self.allocator, self.arena_slots)
        except ValueError as e:
            logger.warning("VeriCache: no reload room now (%s); this request's full KV stays on the device", e)
            return False
        self.reloads = StaggeredReloads(self.tier, self.scheduler, self.arena)
        return True

    def forget(self, rid: str) -> None:
        """``rid`` finished or left: the tier drops what it holds for it, unless SGLang has yet to
        free its row (the ledger's release does it then)."""
        if rid not in self.ledger:
            self.tier.release(rid)

    def _released(self, rid: str) -> None:
        """SGLang freed ``rid``'s row (finished, aborted or retracted)."""
        if self.reloads is not None:
            self.reloads.cancel(rid)
        self._on_release(rid)
        self._close_idle_arena()

    def _close_idle_arena(self) -> None:
        if self.arena is not None and len(self.ledger) == 0 and not self.reloads.inflight:
            self.arena.close()  # idle: SGLang's leak check counts every slot back in its allocator
            self.arena, self.reloads = None, None
