"""Fetching only the rows a verification still needs.

A token-dropping compressor keeps some tokens' K/V bit-exactly on the accelerator (per head, in
scattered positions); a quantizer keeps its full-precision residual. Those rows need not cross the
link again: the verifier's full KV is assembled from the held rows plus the fetched ones. Reads are
byte ranges of the chunk records (runs of tokens per head, nearby runs merged), each run checked
against the record's per-row checksums. The byte-accounting bound is ``(1 - r)`` of the full KV's
bytes for a drop ratio ``r``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from remote_store import codec
from vericache_sglang.full_kv.keys import ChunkRef

# (positions [kv_heads, m], keys, values [kv_heads, m, head_dim]) held exactly on the device
Held = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass
class RowPlan:
    """One chunk-layer record's partial read."""

    ref: ChunkRef
    header: codec.ChunkHeader  # the header this record must have
    runs: list[tuple[int, int, int]]  # (head, first token, end token), chunk-local, for K and V alike
    ranges: list[tuple[int, int]]  # (offset, length): the header, then per run and K/V its rows and checksums


def held_fraction(held: Held | None, heads: int, start: int, end: int) -> float:
    if held is None or end <= start:
        return 0.0
    pos = held[0]
    return float(((pos >= start) & (pos < end)).sum()) / (heads * (end - start))


def place_held(held: Held | None, k_out: torch.Tensor, v_out: torch.Tensor, start: int) -> torch.Tensor:
    """Write the held rows into ``k_out``/``v_out`` (``[heads, end - start, d]``); return the mask
    ``[heads, end - start]`` of positions filled."""
    heads, n, _ = k_out.shape
    mask = torch.zeros(heads, n, dtype=torch.bool)
    if held is None:
        return mask
    pos, hk, hv = held
    pos = pos.long().cpu()
    valid = (pos >= start) & (pos < start + n)
    # (head, column) pairs: the outputs may be views into larger buffers, so not flattened
    rows, cols = torch.arange(heads).unsqueeze(1).expand_as(pos)[valid], (pos - start)[valid]
    mask[rows, cols] = True
    k_out[rows, cols] = hk[valid].to(k_out.device)
    v_out[rows, cols] = hv[valid].to(v_out.device)
    return mask


def _runs(need: torch.Tensor, max_gap: int) -> list[tuple[int, int]]:
    edges = torch.diff(
        need.to(torch.int8), prepend=torch.zeros(1, dtype=torch.int8), append=torch.zeros(1, dtype=torch.int8)
    )
    starts = (edges == 1).nonzero().flatten().tolist()
    ends = (edges == -1).nonzero().flatten().tolist()
    runs: list[list[int]] = []
    for a, b in zip(starts, ends, strict=True):
        if runs and a - runs[-1][1] <= max_gap:
            runs[-1][1] = b
        else:
            runs.append([a, b])
    return [(a, b) for a, b in runs]


def plan(
    refs: list[ChunkRef], headers: list[codec.ChunkHeader], mask: torch.Tensor, start: int, end: int, max_gap: int = 2
) -> list[RowPlan]:
    """Byte ranges for the rows of ``[start, end)`` that ``mask`` does not cover."""
    plans = []
    for ref, header in zip(refs, headers, strict=True):
        lo, hi = max(ref.start, start), min(ref.end, end)
        runs: list[tuple[int, int, int]] = []
        for head in range(header.heads):
            need = ~mask[head, lo - start : hi - start]
            runs += [(head, a + lo - ref.start, b + lo - ref.start) for a, b in _runs(need, max_gap)]
        ranges = [(0, codec.HEADER_SIZE)]
        for kv in (0, 1):
            for head, t0, t1 in runs:
                row = header.row_index(kv, head, t0)
                ranges += [header.rows_range(row, t1 - t0), header.sums_range(row, t1 - t0)]
        plans.append(RowPlan(ref, header, runs, ranges))
    return plans


def assemble(
    plans: list[RowPlan],
    replies: list[list[bytes] | None],
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    start: int,
    check_header,
) -> None:
    """Check each reply and copy its rows into ``k_out``/``v_out``; ``check_header(header, ref)``
    raises on a record that is not the one asked for."""
    dtype, d = k_out.dtype, k_out.shape[2]
    for p, parts in zip(plans, replies, strict=True):
        if parts is None:
            raise codec.ChunkError(f"chunk {p.ref.index} (tokens [{p.ref.start}, {p.ref.end})) is missing")
        check_header(codec.decode_header(parts[0]), p.ref)
        i = 1
        for out in (k_out, v_out):
            kv = 0 if out is k_out else 1
            for head, t0, t1 in p.runs:
                rows, sums = parts[i], parts[i + 1]
                i += 2
                codec.check_rows(p.header, p.header.row_index(kv, head, t0), rows, sums)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only buffer, copied below
                    block = torch.frombuffer(rows, dtype=dtype).view(t1 - t0, d)
                a = p.ref.start + t0 - start
                out[head, a : a + (t1 - t0)] = block
