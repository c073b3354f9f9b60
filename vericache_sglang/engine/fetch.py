"""Full-KV fetches for verification: on a background thread, from the start of drafting.

The thread first writes the previous verification's committed KV (so reads see it), then fetches
the request's full KV layer by layer; the verify pass waits on each layer as it needs it, so it
computes layer 0 while later layers are still on the link.
"""

from __future__ import annotations

import functools
import threading
import time
import traceback
from collections.abc import Callable

import torch

from remote_store.backends.base import StoreError
from vericache_sglang.core.kv import FullKV
from vericache_sglang.engine.runner import ResidentKV
from vericache_sglang.full_kv.store import RequestKV
from vericache_sglang.full_kv.subset import Held


class FetchError(StoreError):
    """A full-KV fetch for verification failed; no token of that verification is committed."""


def release_frames(error: BaseException | None) -> None:
    """Clear the locals of the finished frames in ``error``'s tracebacks (its causes' too): a kept
    error would otherwise keep every tensor those frames held, and the objects that keep the
    error, in a cycle through them. The traceback's lines stay."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


class RoomyLayers:
    """Each layer's full KV in a buffer with ``room`` rows after it, so the verify pass writes its
    new tokens' K/V there and attends to one view instead of concatenating the whole full KV."""

    def __init__(self, num_layers: int, room: int):
        self.room = room
        self.layers: list[tuple[torch.Tensor, torch.Tensor, int] | None] = [None] * num_layers

    def adopt(self, layer: int, k_buf: torch.Tensor, v_buf: torch.Tensor, n: int) -> None:
        """Use buffers that already hold the layer's ``n`` rows with room after them."""
        self.layers[layer] = (k_buf, v_buf, n)

    def allocate(
        self, layer: int, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's buffers; returns the views its ``shape[1]`` rows are written into."""
        h, n, d = shape
        k_buf, v_buf = (torch.empty((h, n + self.room, d), dtype=dtype, device=device) for _ in range(2))
        self.layers[layer] = (k_buf, v_buf, n)
        return k_buf[:, :n], v_buf[:, :n]

    def place(self, layer: int, k: torch.Tensor, v: torch.Tensor, device: torch.device) -> None:
        """Copy the layer into its buffer (on ``device``: the host-to-device copy lands there)."""
        for buf, t in zip(self.allocate(layer, tuple(k.shape), k.dtype, device), (k, v), strict=True):
            buf.copy_(t, non_blocking=device.type != "cpu")

    def view(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        held = self.layers[layer]
        return None if held is None else (held[0][:, : held[2]], held[1][:, : held[2]])

    def with_new(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        held = self.layers[layer]
        if held is None or k.shape[1] > self.room:
            return None
        bk, bv, n = held
        end = n + k.shape[1]
        bk[:, n:end], bv[:, n:end] = k, v
        return bk[:, :end], bv[:, :end]


class FullKVFetch:
    def __init__(
        self,
        request: RequestKV,
        upto: int,
        num_layers: int,
        pending_write: tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None,
        timeout_s: float = 120.0,
        held: Callable[[int], Held | None] | None = None,
        device: torch.device | str = "cpu",
        room: int = 0,
    ):
        """``room``: rows kept free after each layer for the verify pass's new tokens (0: it
        concatenates)."""
        self.request = request
        self.upto = upto
        self.held = held
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self._layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * num_layers
        self._roomy = RoomyLayers(num_layers, room) if room else None
        self._ready = [threading.Event() for _ in range(num_layers)]
        self.arrival: list[float | None] = [None] * num_layers
        self.wait_s = 0.0  # time the verify pass spent waiting for layers
        self.error: BaseException | None = None
        self.started = time.monotonic()
        self.finished: float | None = None
        self._pending = pending_write
        self.bytes_written = 0
        self._thread = threading.Thread(target=self._run, name="vericache-fetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._pending is not None:
                before = self.request.stats.put_bytes
                self.request.write(*self._pending)
                self.bytes_written = self.request.stats.put_bytes - before
                self._pending = None  # a first fetch's is the whole prompt's KV
            # On the host the chunks are decoded straight into the roomy buffers; on an accelerator
            # the store's bytes land in host memory and the link is the copy to the device (into
            # the roomy buffer where there is one: no second copy on the verify's path).
            roomy = self._roomy
            into = (
                functools.partial(roomy.allocate, dtype=self.request.store.layout.dtype)
                if roomy is not None and self.device.type == "cpu"
                else None
            )
            for layer, k, v in self.request.fetch_layers(self.upto, held=self.held, into=into):
                if roomy is not None and into is None:
                    roomy.place(layer, k, v, self.device)
                    k, v = roomy.view(layer)
                elif self.device.type != "cpu":
                    k, v = k.to(self.device, non_blocking=True), v.to(self.device, non_blocking=True)
                if self.device.type != "cpu":
                    torch.cuda.current_stream(self.device).synchronize()
                self._layers[layer] = (k, v)
                self.arrival[layer] = time.monotonic()
                self._ready[layer].set()
        except BaseException as e:  # surfaced to the verify pass by wait_layer
            self.error = e
        finally:
            # The callback refers to the request, which refers to this fetch: dropped once read,
            # so a finished request and its full KV are freed at once, not by the cycle collector.
            self.held = None
            self.finished = time.monotonic()
            for event in self._ready:
                event.set()

    def wait_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        t = time.monotonic()
        if not self._ready[layer].wait(self.timeout_s):
            raise FetchError(f"full KV of layer {layer} did not arrive within {self.timeout_s:.0f} s")
        self.wait_s += time.monotonic() - t
        kv = self._layers[layer]
        if kv is None:
            raise FetchError(f"full-KV fetch failed at layer {layer}: {self.error}") from self.error
        return kv

    def with_new(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The layer's full KV followed by the new tokens' ``k``/``v``, written into its room; None
        without room for them (the caller concatenates)."""
        self.wait_layer(layer)
        return None if self._roomy is None else self._roomy.with_new(layer, k, v)

    def join(self) -> None:
        self._thread.join(self.timeout_s)
        if not self._thread.is_alive():
            release_frames(self.error)  # its frames held this fetch, its request and their KV

    @property
    def bytes_fetched(self) -> int:
        return self.request.stats.last_fetch_bytes

    @property
    def bytes_moved(self) -> int:
        """Everything this fetch put on the link: the commit it wrote and the KV it read."""
        return self.bytes_written + self.bytes_fetched


class ResidentFeed:
    """A full KV already in memory, served like a fetch (the recompute fallback)."""

    def __init__(self, full: FullKV):
        self.full = full
        self.wait_s = 0.0
        self.bytes_fetched = 0
        self.arrival: list[float | None] = []
        self._roomy: RoomyLayers | None = None

    @classmethod
    def of_resident(cls, resident: ResidentKV) -> ResidentFeed:
        """A resident KV's own buffers, their room past its length taking the verify pass's
        tokens (nothing copied; the resident's next append overwrites them)."""
        feed = cls(resident.to_full())
        room = resident.k[0].shape[1] - resident.length
        if room:
            feed._roomy = RoomyLayers(resident.layout.num_layers, room)
            for layer, (k, v) in enumerate(zip(resident.k, resident.v, strict=True)):
                feed._roomy.adopt(layer, k, v, resident.length)
        return feed

    def wait_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.full.layers[layer]

    def with_new(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        return None if self._roomy is None else self._roomy.with_new(layer, k, v)

    def join(self) -> None:
        pass
