"""Measured hardware figures the link emulator is set against (DESIGN.md: emulate links by ratio)."""

from __future__ import annotations

import functools
import time

import torch


@functools.cache
def memory_bandwidth(device: str = "cpu", nbytes: int = 256 << 20, repeats: int = 5) -> float:
    """The engine's device-memory bandwidth in bytes/s: the median of timed large copies,
    counting the bytes read and written (what a bandwidth-bound decode step moves)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 1):
        if device != "cpu":
            torch.cuda.synchronize()
        t = time.perf_counter()
        dst.copy_(src)
        if device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times = sorted(times[1:])  # the first copy warms the pages
    return 2 * nbytes / times[len(times) // 2]
