"""Offloaded requests' full KV in the full-KV store only (``full_kv: "store"``), fetched per layer
into device slots for each verification while the draft passes run.

The tier the worker's offload (``offload.FullKVOffload``) drives, beside the host pool
(``host_tier.HostFullKV``), with the same calls:

- ``open`` a request after its prefill: its prompt's tokens name its store records (content-keyed
  chunks, ``vericache_sglang.full_kv.store``); the prefix the radix tree already holds on the
  device is written too, so every whole prompt chunk is in the store for any server to find. With
  ``from_start`` that prefix is the request's to fetch like its own positions (``streams_prefix``):
  the caller unpins it from the tree, whose device copy becomes an evictable cache of the store.
- ``offload`` the request's own positions (the prompt after prefill, committed tokens after each
  verification): read from the device pool, written to the store; only then are their device
  slots freed by the caller. A write that fails raises, and the caller keeps those slots.
- ``reload`` starts fetching a request's positions, layer by layer, on a fetch thread, straight
  into the device slots of the reload arena: the store's reads overlap the draft passes that run on
  the scheduler's thread meanwhile (they read the private draft pool, never these slots).
  ``consume`` makes the verify pass wait per layer on what is still arriving (``layer_loads``), so
  it starts on the first fetched layer; a fetch that failed (store down, record missing, evicted or
  corrupt: every record is checked against its key, model layout and tokens) is ``failed``, and the
  caller recomputes those positions from the committed tokens and runs the pass again.
- ``start_prefix_load`` loads a prompt prefix the store holds (``stored_prefix``) into the device
  slots the radix tree promised it, on the same thread, each layer as it arrives, while the
  prefill pass that reads it runs (the pass waits per layer too).

With HiCache on, its controller owns the pool's layer counter and its tree loads prefixes: this
tier then only moves running requests' full KV, and a fetch lands whole before its pass. On CPU
every path here runs (tests, real servers). On a GPU a layer is marked done once the fetch
thread's stream has completed its copy: unverified, no GPU with sglang here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from remote_store import StoreError
from remote_store.codec import ChunkError
from vericache_sglang.sglang.full_kv.layer_loads import Fetch, LayerLoads, PrefixLoad
from vericache_sglang.sglang.pool_kv import read_full_kv, write_layer

if TYPE_CHECKING:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    from vericache_sglang.core.kv import KVLayout
    from vericache_sglang.full_kv.store import FullKVStore, RequestKV

logger = logging.getLogger(__name__)

MAX_BAD_PREFIXES = 4096  # prefixes remembered as failing to load (a store can be mended; forget then)


class StoreFullKV:
    streams_prefix = True  # a request's matched prefix can be fetched per verification (``open``)

    def __init__(self, device_pool: MHATokenToKVPool, store: FullKVStore, load_prefixes: bool = True):
        self.device_pool = device_pool
        self.store = store
        self.layout = store.layout
        self.bytes_per_token = store.layout.bytes_per_token
        self._handles: dict[str, RequestKV] = {}
        self._spans: dict[str, tuple[int, int]] = {}  # rid -> positions [start, end) offloaded to the store
        # One fetch thread: fetches run one after another, as the staggered plan orders them on the link.
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vericache-fetch")
        self._jobs: dict[str, Future] = {}  # rid -> its latest fetch
        self._fetches: dict[str, Fetch] = {}  # rid -> its latest fetch's progress, per layer
        self.fetch_s = 0.0  # time the fetch thread spent fetching verifications' full KV
        self._whole_wait_s = 0.0  # time passes waited for whole fetches (no layer counter of ours)
        self._loads: dict[int, list[str]] = {}  # producer -> the requests it fetches
        self._next_producer = 0
        self.prefix_hits = 0  # prompts whose prefix was loaded from the store instead of computed
        self.prefix_tokens_loaded = 0
        self.prefix_errors = 0
        self._bad_prefixes: set[int] = set()  # hashes of prefixes whose load failed
        # With HiCache on (``load_prefixes=False``) its tree loads cached prefixes through its own L3
        # backend and its LayerDoneCounter owns the pool's per-layer waits; this tier then moves
        # only running requests' full KV, each fetch landing whole before its verify pass.
        self.layer_loads: LayerLoads | None = None
        if load_prefixes:
            # prefill and verify passes wait per layer on what is still arriving (SGLang's pool calls it)
            if getattr(device_pool, "layer_transfer_counter", None) is not None:
                raise ValueError("the device pool already waits on another layer counter (HiCache is on)")
            self.layer_loads = LayerLoads(device_pool.layer_num)
            device_pool.register_layer_transfer_counter(self.layer_loads)

    @classmethod
    def connect(
        cls, url: str, device_pool: MHATokenToKVPool, layout: KVLayout, device: str, load_prefixes: bool = True
    ) -> StoreFullKV:
        """The tier over the store at ``url`` (``vericache --store``'s URLs, credentials and TLS): a
        store that cannot be used as configured fails here, naming it and why; an emulated link
        (``?link_ratio=R``) is set against ``device``'s memory bandwidth. ``load_prefixes``: this
        tier loads stored prompt prefixes into the radix tree (False under HiCache, whose tree does)."""
        from remote_store import connect_store
        from vericache_sglang.engine.hardware import memory_bandwidth
        from vericache_sglang.full_kv.store import FullKVStore

        backend = connect_store(url, memory_bandwidth=lambda: memory_bandwidth(device))
        return cls(device_pool, FullKVStore(backend, layout, namespace="sglang"), load_prefixes)

    # -- what is held ----------------------------------------------------------------------------

    def __contains__(self, rid: str) -> bool:
        return rid in self._spans

    def num_tokens(self, rid: str) -> int:
        start, end = self._span(rid)
        return end - start

    def nbytes(self, rid: str) -> int:
        return self.num_tokens(rid) * self.bytes_per_token

    def available_tokens(self) -> int:
        return 1 << 62  # the store's own capacity and eviction decide; a lost record is recomputed

    # -- device to store -------------------------------------------------------------------------

    def open(
        self,
        rid: str,
        tokens: Sequence[int],
        prefix_slots: torch.Tensor,
        shared: bool = True,
        from_start: bool = False,
    ) -> None:
        """A prefilled request of prompt ``tokens``; ``prefix_slots``: the device slots of the prefix
        it matched in the radix tree (written to the store for other servers where it is not there).
        ``from_start``: that prefix is offloaded too, fetched with the request's own positions for
        each verification; else it stays the tree's, on the device. ``shared=False`` (a request
        SGLang keeps apart: cache salt, adapter): its records are its own."""
        self.release(rid)  # a retracted request prefilling again starts over
        handle = self.store.open_request(tokens, request_id=rid, shared=shared)
        n = int(prefix_slots.numel())
        try:
            adopted = self._adopt(handle, n) if shared else 0
            if n > adopted:
                handle.write(adopted, read_full_kv(self.device_pool, prefix_slots[adopted:], self.layout).layers)
        except BaseException:
            handle.release()
            raise
        self._handles[rid] = handle
        self._spans[rid] = (0 if from_start else n, n)

    def _adopt(self, handle: RequestKV, n: int) -> int:
        """Take the whole shared chunks of the first ``n`` positions that the store already holds
        (a prefix loaded from it, or one this server wrote) in one check, not chunk by chunk;
        returns how many positions that is (0: not all there, they are written)."""
        whole = min(n, handle.shared_end) // self.store.chunk_tokens * self.store.chunk_tokens
        if not whole:
            return 0
        try:
            handle.adopt_prefix(whole)
        except StoreError:
            return 0
        return whole

    def extend(self, rid: str, tokens: Sequence[int]) -> None:
        """``tokens`` were committed after the request's known ones (their KV is offloaded next)."""
        handle = self._handles.get(rid)
        if handle is not None:
            handle.extend_tokens(tokens)

    def accepts(self, rid: str) -> bool:
        """Whether ``rid``'s positions can be offloaded: it was opened (its tokens name its records)."""
        return rid in self._handles

    def offload(self, rid: str, device_slots: torch.Tensor) -> None:
        """Write the KV at ``device_slots`` (the request's next positions, in order) to the store;
        raises StoreError without recording anything when the store does not take it."""
        handle = self._handles.get(rid)
        if handle is None:
            raise KeyError(f"request {rid} was not opened in the store tier")
        start, end = self._spans[rid]
        if handle.stored != end:
            raise RuntimeError(f"request {rid}: the store holds [0, {handle.stored}), the tier expected {end}")
        full = read_full_kv(self.device_pool, device_slots, self.layout)
        handle.write(end, full.layers)
        self._spans[rid] = (start, end + full.num_tokens)

    @staticmethod
    def wait_offloaded(done: None) -> None:
        return None  # ``offload`` returns once the store has the records

    # -- store to device -------------------------------------------------------------------------

    def reload(self, targets: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Start fetching each ``(rid, device_slots)`` request's offloaded positions into
        ``device_slots`` on the fetch thread; returns the producer to ``consume`` before the pass."""
        if not targets:
            raise ValueError("nothing to reload")
        for rid, slots in targets:
            start, end = self._span(rid)
            if slots.numel() != end - start:
                raise ValueError(f"request {rid}: {slots.numel()} device slots for {end - start} offloaded tokens")
        for rid, slots in targets:
            start, end = self._spans[rid]
            progress = self._fetches[rid] = Fetch()
            self._jobs[rid] = self._fetcher.submit(self._fetch, self._handles[rid], start, end, slots, progress)
        producer = self._next_producer
        self._next_producer += 1
        self._loads[producer] = [rid for rid, _ in targets]
        return producer

    def _fetch(
        self, handle: RequestKV, start: int, end: int, slots: torch.Tensor, progress: Fetch
    ) -> tuple[int, float]:
        t0 = time.perf_counter()
        try:
            for layer, k, v in handle.fetch_layers(upto=end, start=start):
                write_layer(self.device_pool, slots, layer, k, v)
                self._landed()
                if self.layer_loads is not None:
                    self.layer_loads.layer_done(progress, layer)
        except BaseException as e:  # the pass waiting on it goes on, to be run again (``failed``)
            if self.layer_loads is not None:
                self.layer_loads.end(progress, e)
            raise
        if self.layer_loads is not None:
            self.layer_loads.end(progress, None)
        seconds = time.perf_counter() - t0
        self.fetch_s += seconds
        return handle.stats.last_fetch_bytes, seconds

    def _landed(self) -> None:
        """A layer written on the fetch thread is in the pool, not only issued (CUDA: unverified)."""
        if torch.device(self.device_pool.device).type == "cuda":
            torch.cuda.current_stream().synchronize()

    def consume(self, producer: int) -> None:
        """The next pass (a verify pass) reads ``producer``'s fetches: per layer as they arrive,
        or, without a layer counter of this tier's (HiCache on), once they have all ended. A failed
        fetch is ``failed``, not raised."""
        if self.layer_loads is None:
            t0 = time.perf_counter()
            self.wait_loaded(producer)
            self._whole_wait_s += time.perf_counter() - t0
            return
        self.layer_loads.consume([self._fetches[rid] for rid in self._loads.get(producer, ()) if rid in self._fetches])

    def wait_loaded(self, producer: int) -> None:
        for rid in self._loads.get(producer, ()):
            job = self._jobs.get(rid)
            if job is not None:
                job.exception()  # waits; the outcome stays on the future

    @property
    def verify_wait_s(self) -> float:
        """Time verify passes waited for their fetches: the part of ``fetch_s`` drafting did not hide."""
        return self._whole_wait_s + (self.layer_loads.verify_wait_s if self.layer_loads is not None else 0.0)

    def ended(self, rid: str) -> bool:
        """Whether ``rid``'s latest fetch has ended (delivered or failed)."""
        job = self._jobs.get(rid)
        return job is not None and job.done()

    def failed(self, rid: str) -> BaseException | None:
        """Why ``rid``'s latest fetch did not deliver its full KV (waiting for it), or None if it did."""
        job = self._jobs.get(rid)
        if job is None:
            raise KeyError(f"request {rid} has no fetch")
        error = job.exception()
        if error is not None:
            logger.warning("VeriCache: fetching request %s's full KV from the store failed: %s", rid, error)
        return error

    def link_sample(self, producer: int) -> tuple[int, float] | None:
        """``(bytes, seconds)`` of ``producer``'s fetches once all have succeeded (for the scheduler)."""
        jobs = [self._jobs.get(rid) for rid in self._loads.get(producer, ())]
        if any(j is not None and not j.done() for j in jobs):
            return None
        self._loads.pop(producer, None)
        if not jobs or any(j is None or j.exception() is not None for j in jobs):
            return None
        results = [j.result() for j in jobs]
        return sum(b for b, _ in results), sum(s for _, s in results)

    def done(self) -> None:
        """The verify pass has run: later passes do not wait on its fetches."""
        if self.layer_loads is not None:
            self.layer_loads.consume(())

    # -- prefixes other requests (or servers) wrote ---------------------------------------------

    def stored_prefix(self, tokens: Sequence[int], have: int) -> int:
        """How many leading tokens of ``tokens`` the store holds in shared whole chunks, when that
        is more than the ``have`` the caller holds (else, or when the store fails, ``have``)."""
        if self.layer_loads is None or len(tokens) - have < self.store.chunk_tokens:
            return have
        try:
            n = self.store.longest_prefix(tokens, start=have)
        except StoreError as e:
            logger.warning("VeriCache: the store could not be asked for a prefix (%s)", e)
            self.prefix_errors += 1
            return have
        if n > have and hash(tuple(tokens[:n])) in self._bad_prefixes:
            return have  # it failed to load before: computed, not promised again
        return max(have, n)

    def start_prefix_load(self, tokens: Sequence[int], have: int, slots: torch.Tensor) -> PrefixLoad:
        """Start loading the stored KV of positions ``[have, len(tokens))`` into device ``slots``
        on the fetch thread, each layer as it arrives (``layer_loads``: the prefill pass waits per
        layer); a failure (store down, record missing or bad: every record is checked) ends the
        load with its error, for the worker to recompute the positions."""
        if self.layer_loads is None:
            raise RuntimeError("this store tier does not load prefixes (HiCache's tree does)")
        load = PrefixLoad(list(tokens), have, slots)
        self.layer_loads.add(load)
        load.future = self._fetcher.submit(self._load_prefix, load)
        return load

    def _load_prefix(self, load: PrefixLoad) -> None:
        try:
            for layer, k, v in self.store.stream_prefix(load.tokens, load.end, start=load.have):
                write_layer(self.device_pool, load.slots, layer, k, v)
                self._landed()
                self.layer_loads.layer_done(load, layer)
        except (StoreError, ChunkError) as e:
            logger.warning("VeriCache: a stored prefix could not be loaded, computing it instead (%s)", e)
            self.prefix_errors += 1
            if len(self._bad_prefixes) >= MAX_BAD_PREFIXES:
                self._bad_prefixes.clear()
            self._bad_prefixes.add(hash(tuple(load.tokens)))
            self.layer_loads.end(load, e)
            return
        except BaseException as e:  # a waiter must never wait forever
            self.layer_loads.end(load, e)
            raise
        self.prefix_hits += 1
        self.prefix_tokens_loaded += load.end - load.have
        self.layer_loads.end(load, None)

    # -- lifecycle ---------------------------------------------------------------------------------

    def release(self, rid: str) -> None:
        """``rid`` left: unpin its records, delete its private ones (shared prompt chunks stay
        cached for other requests and servers)."""
        self._spans.pop(rid, None)
        self._fetches.pop(rid, None)
        job = self._jobs.pop(rid, None)
        if job is not None:
            job.exception()  # a fetch still writing into slots must end before they are reused
        handle = self._handles.pop(rid, None)
        if handle is not None:
            handle.release()  # best effort; a store that is down retries it later

    def close(self) -> None:
        self._fetcher.shutdown(wait=True)

    def _span(self, rid: str) -> tuple[int, int]:
        span = self._spans.get(rid)
        if span is None:
            raise KeyError(f"request {rid} has no full KV in the store tier")
        return span
