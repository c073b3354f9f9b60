"""Per-head rows that grow in place: a compressed layer's kept K/V, appended to on every commit
and read with a draft window's rows behind them, without reallocating or concatenating per step.

The rows live in a buffer ``[heads, capacity, ...]``; the first ``length`` are the content. Rows
past ``length`` are room: a draft window writes its tokens there (``with_tail``) and they vanish
when the window ends (nothing moves ``length``), so a step reads one view of one buffer.
"""

from __future__ import annotations

import torch

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
        self.length = data.shape[1]

    @property
    def view(self) -> torch.Tensor:
        """The content rows (a view: writes past ``length`` do not show in it)."""
        return self._buf[:, : self.length]

    @property
    def capacity(self) -> int:
        return self._buf.shape[1]

    @property
    def reserved_nbytes(self) -> int:
        """Bytes of the room past the content (held, not counted as content)."""
        return self._buf.nbytes - self.view.nbytes

    @torch.inference_mode()
    def _reserve(self, need: int, keep: int) -> None:
        """Room for ``need`` rows, the first ``keep`` carried over if the buffer is replaced."""
        if need <= self.capacity:
            return
        cap = need + max(need // 8, MIN_ROOM_ROWS)
        grown = self._buf.new_empty((self._buf.shape[0], cap, *self._buf.shape[2:]))
        grown[:, :keep] = self._buf[:, :keep]
        self._buf = grown

    @torch.inference_mode()
    def append(self, rows: torch.Tensor) -> None:
        end = self.length + rows.shape[1]
        self._reserve(end, self.length)
        self._buf[:, self.length : end] = rows
        self.length = end

    @torch.inference_mode()
    def with_tail(self, offset: int, rows: torch.Tensor) -> torch.Tensor:
        """Write ``rows`` at ``length + offset`` (in the room) and return the content followed by
        the room's first ``offset + len(rows)`` rows; ``length`` does not change."""
        start = self.length + offset
        end = start + rows.shape[1]
        self._reserve(end, start)  # the window's earlier rows are carried over too
        self._buf[:, start:end] = rows
        return self._buf[:, :end]


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
