"""Per-head rows that grow in place: a compressed layer's kept K/V, appended to on every commit
and read with a draft window's rows behind them, without reallocating or concatenating per step.

The rows live in a buffer ``[heads, capacity, ...]``; rows ``start .. start + length`` are the
content. Rows past the content are room: a draft window writes its tokens there (``with_tail``)
and they vanish when the window ends (nothing moves ``length``), so a step reads one view of one
buffer. Rows before ``start`` are dropped ones: a sliding window evicts its oldest token by moving
the few rows before it (the sinks) one place on, not by copying the whole window.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)


def in_inference_mode(fn: F) -> F:
    """Run ``fn`` in inference mode, entering it only where the caller has not: these run per
    layer per request per step, and ``torch.inference_mode()`` as a decorator costs more than
    a small copy."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run  # type: ignore[return-value]


_workspace = threading.local()


def workspace(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable buffer of ``shape`` for ``slot`` (per thread): what one layer's read is assembled
    in, valid until the next call for the same slot. Its memory is one layer's worth, like an
    activation, not a copy held per request."""
    bufs = getattr(_workspace, "bufs", None)
    if bufs is None:
        bufs = _workspace.bufs = {}
    numel = math.prod(shape)
    key = (slot, dtype, torch.device(device))
    buf = bufs.get(key)
    if buf is None or buf.numel() < numel:
        with torch.inference_mode():
            buf = bufs[key] = torch.empty(numel + numel // 8, dtype=dtype, device=device)
    return buf[:numel].view(shape)


# Room added when the buffer is outgrown: an eighth of what is needed, at least this many rows
# (a draft window plus a few commits), so reallocation is rare and the room stays small.
MIN_ROOM_ROWS = 64


class GrowingRows:
    """Rows ``[heads, length, ...]`` along dim 1 of a buffer with room after them.

    Writes run in inference mode: the rows come from the model's inference-mode forwards, and a
    buffer made there may only be written there (nothing here is ever differentiated).
    """

    def __init__(self, data: torch.Tensor):
        self._buf = data
        self.start = 0
        self.length = data.shape[1]

    @property
    def view(self) -> torch.Tensor:
        """The content rows (a view: writes past them do not show in it)."""
        return self._buf[:, self.start : self.start + self.length]

    @property
    def capacity(self) -> int:
        """Rows the content may grow to without moving."""
        return self._buf.shape[1] - self.start

    @property
    def reserved_nbytes(self) -> int:
        """Bytes of the buffer beyond the content (room and dropped rows: held, not content)."""
        return self._buf.nbytes - self.view.nbytes

    def _reserve(self, need: int, keep: int) -> None:
        """Room for ``need`` rows from ``start``, the first ``keep`` carried over if they move: to the
        buffer's front where it is large enough (dropped rows made the room), else to a new one."""
        if need <= self.capacity:
            return
        cap = need + max(need // 8, MIN_ROOM_ROWS)
        kept = self._buf[:, self.start : self.start + keep]
        if cap <= self._buf.shape[1]:
            self._buf[:, :keep] = kept.clone()  # the ranges may overlap
        else:
            grown = self._buf.new_empty((self._buf.shape[0], cap, *self._buf.shape[2:]))
            grown[:, :keep] = kept
            self._buf = grown
        self.start = 0

    @in_inference_mode
    def append(self, rows: torch.Tensor) -> None:
        end = self.length + rows.shape[1]
        self._reserve(end, self.length)
        self._buf[:, self.start + self.length : self.start + end] = rows
        self.length = end

    @in_inference_mode
    def with_tail(self, offset: int, rows: torch.Tensor) -> torch.Tensor:
        """Write ``rows`` at ``length + offset`` (in the room) and return the content followed by
        the room's first ``offset + len(rows)`` rows; ``length`` does not change."""
        start = self.length + offset
        end = start + rows.shape[1]
        self._reserve(end, start)  # the window's earlier rows are carried over too
        self._buf[:, self.start + start : self.start + end] = rows
        return self._buf[:, self.start : self.start + end]

    @in_inference_mode
    def drop(self, first: int, count: int) -> None:
        """Remove content rows ``first .. first + count``, the rest keeping their order: the rows
        before them move ``count`` places on (a sliding window's sinks: a few rows), or, where
        fewer follow, those move back."""
        if not (0 <= first and count >= 0 and first + count <= self.length):
            raise ValueError(f"cannot drop rows {first}..{first + count} of {self.length}")
        if count == 0:
            return
        s, after = self.start, self.length - first - count
        if first <= after:
            self._buf[:, s + count : s + count + first] = self._buf[:, s : s + first].clone()
            self.start += count
        else:
            tail = self._buf[:, s + first + count : s + self.length].clone()
            self._buf[:, s + first : s + first + after] = tail
        self.length -= count

    @in_inference_mode
    def keep(self, cols: torch.Tensor) -> None:
        """Keep the content rows ``cols`` (``[heads, n]`` per-head indices), written back into the
        same buffer so its room survives (the next commit or draft does not reallocate)."""
        idx = cols.view(*cols.shape, *([1] * (self._buf.dim() - 2))).expand(-1, -1, *self._buf.shape[2:])
        kept = self.view.gather(1, idx)
        n = kept.shape[1]
        self._buf[:, self.start : self.start + n] = kept
        self.length = n


class RowsField:
    """A class attribute that holds a tensor as ``GrowingRows``: reading it gives the content view,
    assigning it starts new rows, and the rows themselves (to append or draft) are the instance's
    ``_<name>_rows``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = f"_{name}_rows"

    def __get__(self, obj: object, owner: type | None = None) -> torch.Tensor:
        if obj is None:
            return self  # type: ignore[return-value]
        return getattr(obj, self.slot).view

    def __set__(self, obj: object, value: torch.Tensor) -> None:
        setattr(obj, self.slot, GrowingRows(value))
