"""Offloaded requests' full KV in SGLang's host pool, loaded back per layer for verification.

The pieces are SGLang's own HiCache machinery, driven per request instead of per radix node:

- ``MHATokenToKVPoolHost`` (layer-first, one-token pages) holds each offloaded request's full KV
  as a row of host slots in token order;
- ``L2TransferEngine`` moves it: device-to-host on its D2H stream when tokens are offloaded (the
  prompt after prefill, committed tokens after each verification), host-to-device on its H2D stream
  when a verification needs them, one layer at a time;
- ``LayerDoneCounter``, registered on the device pool, marks each layer loaded, and the pool's
  waiting accessors (``get_key_buffer``/``get_value_buffer``, what attention reads) wait on it: a
  verify pass starts once its first layer is in and overlaps the rest of the load. With HiCache on,
  its controller's counter is the pool's (it loads cached prefixes back per layer); this tier's
  loads are then waited for whole before the verify pass (``per_layer=False``).

Copies: on CUDA with sgl_kernel, SGLang's ``kernel`` (or ``direct``) io backend. Where
sgl_kernel's kvcacheio ops do not exist (CPU), the ``torch`` io backend copies with torch indexing
into the same buffers; the engine, streams, events and counter around it are SGLang's. Only the
``torch`` backend has run (CPU, in real SGLang servers and unit tests); the CUDA kernels and the
overlap of a load with a verify pass are **unverified** (no machine here has a GPU with sglang).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from sglang.srt.managers.cache_controller import LayerDoneCounter
from sglang.srt.mem_cache.l2_transfer import L2Transfer, L2TransferEngine, TransferCompletion
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

IO_BACKENDS = ("torch", "kernel", "direct")


class HostTierFull(RuntimeError):
    """The host pool has no room for the tokens being offloaded (nothing was written)."""


class _HostPool(MHATokenToKVPoolHost):
    """SGLang's MHA host pool, plus a ``torch`` io backend for devices without sgl_kernel."""

    def load_to_device_per_layer(
        self,
        device_pool: MHATokenToKVPool,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        io_backend: str,
        *,
        is_draft: bool = False,
    ) -> None:
        if io_backend != "torch":
            return super().load_to_device_per_layer(
                device_pool, host_indices, device_indices, layer_id, io_backend, is_draft=is_draft
            )
        dst = device_indices.to(self.device_k_buffers[layer_id].device)
        for host, device in ((self.k_buffer, self.device_k_buffers), (self.v_buffer, self.device_v_buffers)):
            device[layer_id][dst] = host[layer_id][host_indices].to(device[layer_id].device, non_blocking=True)

    def backup_from_device_all_layer(
        self, device_pool: MHATokenToKVPool, host_indices: torch.Tensor, device_indices: torch.Tensor, io_backend: str
    ) -> None:
        if io_backend != "torch":
            return super().backup_from_device_all_layer(device_pool, host_indices, device_indices, io_backend)
        src = device_indices.to(self.device_k_buffers[0].device)
        for layer in range(self.target_layer_num):
            for host, device in ((self.k_buffer, self.device_k_buffers), (self.v_buffer, self.device_v_buffers)):
                host[layer][host_indices] = device[layer][src].to(host.device)


def default_io_backend(device: torch.device | str) -> str:
    """``kernel`` on CUDA where sgl_kernel's transfer ops import, else ``torch``."""
    if torch.device(device).type != "cuda":
        return "torch"
    try:
        import sgl_kernel.kvcacheio  # noqa: F401
    except ImportError:
        return "torch"
    return "kernel"


class HostFullKV:
    """The full KV of offloaded requests, by request id, in a host pool bound to ``device_pool``.

    ``device_pool`` is the pool verification reads (its slots come from that pool's allocator,
    which the caller owns: this class never allocates or frees device slots).
    """

    streams_prefix = False  # a request's matched prefix stays the radix tree's, on the device

    def __init__(
        self,
        device_pool: MHATokenToKVPool,
        capacity_tokens: int,
        io_backend: str | None = None,
        pin_memory: bool | None = None,
        per_layer: bool = True,
    ):
        """``per_layer``: register this tier's layer counter on ``device_pool``, so a verify pass
        starts on the first loaded layer; False with HiCache on, whose controller owns the pool's
        counter: a verify pass then waits for its whole load."""
        if not isinstance(device_pool, MHATokenToKVPool):
            raise TypeError(f"the host tier serves MHA KV pools, got {type(device_pool).__name__}")
        if per_layer and getattr(device_pool, "layer_transfer_counter", None) is not None:
            raise ValueError(
                "the device pool already waits on another layer counter (HiCache is on); "
                "the VeriCache host tier needs its own"
            )
        if capacity_tokens <= 0:
            raise ValueError(f"host capacity must be > 0 tokens, got {capacity_tokens}")
        self.io_backend = io_backend or default_io_backend(device_pool.device)
        if self.io_backend not in IO_BACKENDS:
            raise ValueError(f"io backend must be one of {', '.join(IO_BACKENDS)}, got {self.io_backend!r}")
        on_cuda = torch.device(device_pool.device).type == "cuda"
        self.device_pool = device_pool
        self.host_pool = _HostPool(
            device_pool.get_device_pool_infos()[0].buffer_info,
            1.0,
            0,
            1,
            "layer_first",
            pin_memory=on_cuda if pin_memory is None else pin_memory,
            device_capacity_tokens=device_pool.size,
            start_layer=device_pool.start_layer,
            end_layer=device_pool.end_layer,
            host_token_capacity=capacity_tokens,
        )
        self.engine = L2TransferEngine(self.io_backend)
        self.counter = LayerDoneCounter(device_pool.layer_num)  # its events time and order the loads
        self.per_layer = per_layer
        if per_layer:
            device_pool.register_layer_transfer_counter(self.counter)
        self.bytes_per_token = self.host_pool.get_size_per_token()
        self._rows: dict[str, torch.Tensor] = {}  # request id -> host slots, in token order
        self._loads: dict[int, tuple[TransferCompletion, int]] = {}  # producer -> its completion, bytes

    def _indices(self, host: torch.Tensor, device: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Indices where the io backend reads them (HiCache's controller does the same): both on
        the device for ``kernel``, both on the host, sorted by host slot, for ``direct``."""
        device = device.to(torch.int64)
        if self.io_backend == "kernel":
            return host.to(self.device_pool.device, non_blocking=True), device
        if self.io_backend == "direct":
            host, order = host.sort()
            return host, device.cpu().index_select(0, order)
        return host, device

    # -- what is held ---------------------------------------------------------------------------

    def __contains__(self, rid: str) -> bool:
        return rid in self._rows

    def num_tokens(self, rid: str) -> int:
        return int(self._row(rid).numel())

    def nbytes(self, rid: str) -> int:
        """Bytes a reload of ``rid`` moves host-to-device (and holds on the device)."""
        return self.num_tokens(rid) * self.bytes_per_token

    def available_tokens(self) -> int:
        return int(self.host_pool.available_size())

    # -- device to host -------------------------------------------------------------------------

    def open(
        self,
        rid: str,
        tokens: Sequence[int],
        prefix_slots: torch.Tensor,
        shared: bool = True,
        from_start: bool = False,
    ) -> None:
        """A prefilled request (the host tier holds KV by slot, not by token: nothing to note). Its
        matched prefix stays the tree's (``streams_prefix`` is False: no copy of it is here)."""
        if from_start:
            raise ValueError("the host tier does not hold a request's matched prefix")

    def extend(self, rid: str, tokens: Sequence[int]) -> None:
        """Tokens committed after the request's known ones (nothing to note)."""

    def accepts(self, rid: str) -> bool:
        """Whether ``rid``'s positions can be offloaded (any request's, while there is room)."""
        return True

    def offload(self, rid: str, device_slots: torch.Tensor) -> TransferCompletion:
        """Append the KV at ``device_slots`` (the request's next tokens, in order) to ``rid``'s row.

        The copy is queued on the D2H stream; the slots may be reused once the returned
        completion's ``finish_event`` has completed (``wait_offloaded``)."""
        n = int(device_slots.numel())
        if n == 0:
            raise ValueError(f"request {rid}: nothing to offload")
        host = self.host_pool.alloc(n)
        if host is None:
            raise HostTierFull(
                f"request {rid}: {n} tokens to offload, the host pool has "
                f"{self.available_tokens()} free of {self.host_pool.size}"
            )
        try:
            done = self.engine.submit_device_to_host(
                [L2Transfer(self.host_pool, self.device_pool, *self._indices(host, device_slots))]
            )
        except Exception:
            self.host_pool.free(host)
            raise
        old = self._rows.get(rid)
        self._rows[rid] = host if old is None else torch.cat([old, host])
        return done

    @staticmethod
    def wait_offloaded(done: TransferCompletion) -> None:
        done.finish_event.synchronize()

    # -- host to device -------------------------------------------------------------------------

    def reload(self, targets: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Load each ``(rid, device_slots)`` request's full KV into ``device_slots`` (one slot per
        held token), layer by layer on the H2D stream; returns the producer id to pass to
        ``consume`` before the verify pass that reads them."""
        if not targets:
            raise ValueError("nothing to reload")
        hosts, devices = [], []
        for rid, slots in targets:
            row = self._row(rid)
            if slots.numel() != row.numel():
                raise ValueError(f"request {rid}: {slots.numel()} device slots for {row.numel()} held tokens")
            hosts.append(row)
            devices.append(slots.to(torch.int64))
        # The counter rotates over a few event sets; one still loading must finish before reuse.
        upcoming = (self.counter.producer_index + 1) % self.counter.num_counters
        self.counter.events[upcoming].finish_event.synchronize()
        producer = self.counter.update_producer()
        event = self.counter.events[producer]
        event.start_event.record()
        host = torch.cat(hosts)
        done = self.engine.submit_host_to_device(
            [L2Transfer(self.host_pool, self.device_pool, *self._indices(host, torch.cat(devices)))],
            transfer_layer_id_max=self.device_pool.layer_num,
            start_event=event.start_event,
            on_layer_done=event.complete,
        )
        self._loads[producer] = (done, int(host.numel()) * self.bytes_per_token)
        return producer

    def consume(self, producer: int) -> None:
        """Make the device pool's readers wait per layer on reload ``producer`` (until ``done``), or,
        without this tier's counter on the pool, the current stream wait for all of it."""
        if self.per_layer:
            self.counter.set_consumer(producer)
        else:
            self.wait_loaded(producer)

    def wait_loaded(self, producer: int) -> None:
        """Make the current stream wait for all of reload ``producer`` (for a verify pass that reads
        several reloads: it waits per layer on one of them, ``consume``, and whole on the others)."""
        self.counter.events[producer].finish_event.wait()

    def link_sample(self, producer: int) -> tuple[int, float] | None:
        """``(bytes, seconds)`` reload ``producer`` took, once it has finished and where the device
        times its events (CUDA); None otherwise."""
        entry = self._loads.get(producer)
        if entry is None:
            return None
        done, nbytes = entry
        if not done.timing_enabled or not done.finish_event.query():
            return None
        del self._loads[producer]
        return nbytes, done.start_event.elapsed_time(done.finish_event) / 1e3

    def failed(self, rid: str) -> BaseException | None:
        """A host-to-device copy does not fail once issued."""
        return None

    def ended(self, rid: str) -> bool:
        """Whether ``rid``'s reload is known not to fail (always: see ``failed``)."""
        return True

    def done(self) -> None:
        """The verify pass has been issued: later passes (prefill, drafts) do not wait."""
        self.counter.set_consumer(-1)

    # -- lifecycle -----------------------------------------------------------------------------

    def release(self, rid: str) -> None:
        row = self._rows.pop(rid, None)
        if row is not None:
            self.host_pool.free(row)

    def _row(self, rid: str) -> torch.Tensor:
        row = self._rows.get(rid)
        if row is None:
            raise KeyError(f"request {rid} has no full KV in the host tier")
        return row
