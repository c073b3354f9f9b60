"""What the device pool's readers wait on, layer by layer, while the store tier's fetch thread
writes into it: prompt prefixes under the prefill pass, a verification's fetches under its pass.

``LayerLoads`` is registered on the device pool as SGLang's ``layer_transfer_counter``: the pool's
``get_key_buffer(layer)`` (what attention reads) waits on it, as on HiCache's ``LayerDoneCounter``
for host loads, so layer ``l``'s fetch overlaps the compute of the layers before it.

- **Prefixes.** A prompt whose prefix the store holds (another server, or an earlier request, wrote
  it) is matched by the radix tree at scheduling time (``draft/radix_cache.py``): device slots are
  taken and inserted into the tree, so SGLang reports the prefix cached and prefills only the rest,
  and the load starts on the fetch thread. Only the worker's prefill pass waits on it (``reading``):
  no other pass reads a prefix being loaded. A load that fails (the store died, a record missing,
  foreign or corrupt: every record is checked) was already promised to the tree, and its slots hold
  nothing valid. After the pass (``settle``), the worker recomputes its positions where a request
  of the batch read them and runs the pass again (``step/prefix_repair.py``); where none did, its
  nodes leave the tree (``VeriCacheRadixCache.drop``).
- **Verifications.** A request's full KV is fetched into its reload slots while the draft passes
  run (``StoreFullKV.reload``); its verify pass starts once the first layer is in and waits per
  layer on what is still arriving (``consume``). A fetch that fails ends its waits; the offload
  then recomputes the request's positions and runs the pass again (``offload.FullKVOffload.verify``).

No token is ever computed from a pass that read an unfilled slot.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch


@dataclass
class Fetch:
    """One request's full KV arriving for its verification."""

    layers_done: int = 0
    error: BaseException | None = None


@dataclass
class PrefixLoad:
    tokens: list[int]  # the prompt's tokens through the loaded prefix
    have: int  # positions the tree held on the device before: the load is [have, len(tokens))
    slots: torch.Tensor  # device slots of positions [have, len(tokens))
    layers_done: int = 0
    error: BaseException | None = None
    future: Future | None = field(default=None, repr=False)

    @property
    def end(self) -> int:
        return len(self.tokens)


class LayerLoads:
    """The loads in flight and failed, behind SGLang's ``layer_transfer_counter`` interface."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.consumer_index = -1  # read by SGLang's hybrid pools; no HiCache producer here
        self._cond = threading.Condition()
        self._pending: list[PrefixLoad] = []
        self._failed: list[PrefixLoad] = []
        self._reading = False
        self._consumed: Sequence[Fetch] = ()  # the fetches the running verify pass waits on
        self.verify_wait_s = 0.0  # time verify passes waited for layers still arriving

    # -- the fetch thread ---------------------------------------------------------------------------

    def add(self, load: PrefixLoad) -> None:
        with self._cond:
            self._pending.append(load)

    def layer_done(self, load: PrefixLoad | Fetch, layer: int) -> None:
        with self._cond:
            load.layers_done = layer + 1
            self._cond.notify_all()

    def end(self, load: PrefixLoad | Fetch, error: BaseException | None) -> None:
        """The load ended; a failed one releases its waiters too (its pass is then run again)."""
        with self._cond:
            load.error = error
            load.layers_done = self.num_layers
            self._cond.notify_all()

    # -- the scheduler thread -------------------------------------------------------------------------

    def wait_until(self, layer: int) -> None:
        """SGLang's pool calls this before reading ``layer``: within the worker's prefill pass, every
        pending prefix load must have delivered it (or ended); within a verify pass, every fetch it
        consumes."""
        waited: list[PrefixLoad | Fetch] = [*self._consumed]
        if self._reading:
            waited += self._pending
        if not waited or all(p.layers_done > layer for p in waited):
            return
        t0 = time.perf_counter()
        with self._cond:
            self._cond.wait_for(lambda: all(p.layers_done > layer for p in waited))
        if self._consumed:
            self.verify_wait_s += time.perf_counter() - t0

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """The worker's prefill pass: the one that may read prefixes still arriving."""
        self._reading = True
        try:
            yield
        finally:
            self._reading = False

    def consume(self, fetches: Sequence[Fetch]) -> None:
        """The next passes (a verify pass) read ``fetches`` per layer, until ``consume(())``."""
        self._consumed = tuple(fetches)

    def pending(self) -> bool:
        return bool(self._pending)

    def settle(self) -> list[PrefixLoad]:
        """Wait for every pending load to end; the failed ones, not yet dealt with (``dealt``)."""
        with self._cond:
            pending, self._pending = self._pending, []
        for load in pending:
            if load.future is not None:
                load.future.exception()  # waits; the outcome is on the load (``end``)
            if load.error is not None:
                self._failed.append(load)
        return list(self._failed)

    def dealt(self, load: PrefixLoad) -> None:
        self._failed.remove(load)
