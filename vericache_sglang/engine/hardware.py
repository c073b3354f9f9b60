"""Measured hardware figures the link emulator is set against (links are emulated by ratio: docs/stores.md).

A decode step streams weights and KV from device memory, so the figure is a streaming read of an
array far larger than any cache, repeated: the median is what links are set against, the spread
(slowest and fastest read) is reported beside it, since on a shared machine one read can be 2x
another and a single timed copy moved 3x between two runs of the same benchmark.
"""

from __future__ import annotations

import functools
import time
from dataclasses import asdict, dataclass

import torch

PROBE_BYTES = 2 << 30  # 2 GiB: 4x the 480 MiB L3 of these machines, a GPU's L2 many times over
PROBE_READS = 9


@dataclass(frozen=True)
class Bandwidth:
    """A streaming-read bandwidth: the median of repeated reads, with their spread."""

    bytes_s: float  # the median read
    low_bytes_s: float  # the slowest read
    high_bytes_s: float  # the fastest read
    array_bytes: int
    reads: int
    device: str

    @property
    def spread(self) -> float:
        """(fastest - slowest) / median: 0 on a quiet machine."""
        return (self.high_bytes_s - self.low_bytes_s) / self.bytes_s

    def describe(self) -> str:
        return (
            f"{self.bytes_s / 1e9:.1f} GB/s streaming read on {self.device} (median of {self.reads} reads of "
            f"{self.array_bytes / 2**30:.2f} GiB; slowest {self.low_bytes_s / 1e9:.1f}, fastest "
            f"{self.high_bytes_s / 1e9:.1f}, spread {self.spread:.0%})"
        )

    def to_dict(self) -> dict[str, float | int | str]:
        return {**asdict(self), "spread": self.spread}


def _sync(device: str) -> None:
    if device != "cpu":
        torch.cuda.synchronize()


@functools.cache
def streaming_read_bandwidth(device: str = "cpu", nbytes: int = PROBE_BYTES, reads: int = PROBE_READS) -> Bandwidth:
    """Time ``reads`` full reads (a sum) of an ``nbytes`` float32 array after one that warms its pages."""
    if reads < 1:
        raise ValueError(f"reads must be >= 1, got {reads}")
    array = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    size = array.nbytes
    times = []
    for _ in range(reads + 1):
        _sync(device)
        t = time.perf_counter()
        array.sum()
        _sync(device)
        times.append(time.perf_counter() - t)
    del array
    rates = sorted(size / t for t in times[1:])
    return Bandwidth(rates[len(rates) // 2], rates[0], rates[-1], size, reads, device)


def memory_bandwidth(device: str = "cpu") -> float:
    """The engine's device-memory bandwidth in bytes/s (the probe's median), what links are set against."""
    return streaming_read_bandwidth(device).bytes_s
