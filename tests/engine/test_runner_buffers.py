"""The runner's batched costs follow its bytes: compressed layers grow in place, a draft window's
tokens are written into the room after them (no per-step concatenation of the compressed KV),
and one head GEMM serves every row that wants logits. Each is checked against what it replaces."""

from __future__ import annotations

import pytest
import torch

from remote_store.backends.memory import MemoryStore
from vericache_sglang.core.compress import parse_spec
from vericache_sglang.core.compress.base import DroppedLayer
from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.kv import FullKV
from vericache_sglang.core.rows import MIN_ROOM_ROWS, GrowingRows
from vericache_sglang.engine.fetch import FullKVFetch, ResidentFeed
from vericache_sglang.engine.runner import DraftKV, ResidentKV, Segment, StreamedKV
from vericache_sglang.full_kv.store import FullKVStore


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    return torch.randint(0, 512, (300,), generator=torch.Generator().manual_seed(3)).tolist()


def rows(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.float32).view(1, n, 1).expand(2, n, 3).contiguous()


def test_growing_rows_append_and_a_window_tail_survive_reallocation():
    g = GrowingRows(rows(4))
    assert g.capacity == 4
    g.append(rows(2, 4))
    assert torch.equal(g.view, rows(6)) and g.capacity >= 6 + MIN_ROOM_ROWS
    # a draft window: its rows are visible to the window only, and carried over if the buffer grows
    first = g.with_tail(0, rows(1, 100))
    assert torch.equal(first, torch.cat([rows(6), rows(1, 100)], dim=1)) and g.length == 6
    big = g.with_tail(1, rows(200, 101))  # forces a reallocation mid-window
    assert torch.equal(big, torch.cat([rows(6), rows(201, 100)], dim=1))
    assert torch.equal(g.view, rows(6))
    g.append(rows(3, 6))  # a commit overwrites the window's rows
    assert torch.equal(g.view, rows(9)) and g.reserved_nbytes == (g.capacity - 9) * 2 * 3 * 4


def test_dropped_layer_counts_content_bytes_and_appends_in_place():
    layer = DroppedLayer(rows(5), rows(5), torch.arange(5, dtype=torch.int32).expand(2, -1).contiguous())
    content = layer.nbytes
    layer.append(rows(1, 5), rows(1, 5), torch.tensor([5]))
    buffer = layer._keys_rows._buf.data_ptr()
    layer.append(rows(1, 6), rows(1, 6), torch.tensor([6]))
    assert layer._keys_rows._buf.data_ptr() == buffer  # no reallocation per commit
    assert layer.num_tokens == 7 and layer.positions[0].tolist() == list(range(7))
    assert layer.nbytes == content * 7 // 5 and layer.reserved_nbytes > 0


@pytest.mark.parametrize(
    "spec",
    [
        "snapkv:ratio=0.25",
        "streamingllm:sink=2,window=20",
        "kivi:bits=2,group=16",
        "kivi:bits=2,group=16,residual=32",
        "snapkv:ratio=0.5+kivi:bits=4,group=16",
        "snapkv:ratio=0.5+kivi:bits=4,group=16,residual=16",
    ],
)
def test_a_draft_window_attends_to_what_concatenation_gave(tiny_runner, spec):
    """In place (droppers) or assembled in a workspace (quantizers: the dequantized blocks, the
    residual, the window): every draft token attends to the compressed KV followed by the
    window's earlier tokens, bit for bit, and a commit after the window sees none of them."""
    g = torch.Generator().manual_seed(0)
    lay = tiny_runner.layout
    full = FullKV(
        lay,
        [
            (
                torch.randn(lay.num_kv_heads, 80, lay.head_dim, generator=g),
                torch.randn(lay.num_kv_heads, 80, lay.head_dim, generator=g),
            )
            for _ in range(lay.num_layers)
        ],
    )
    obs = Observation(
        queries=[torch.randn(tiny_runner.num_heads, 32, lay.head_dim, generator=g) for _ in range(lay.num_layers)]
    )
    compressor = parse_spec(spec)
    ckv = compressor.compress(full, obs)
    before = [layer.read() for layer in ckv.layers]
    window = DraftKV(ckv)
    new = [
        (
            torch.randn(lay.num_kv_heads, 1, lay.head_dim, generator=g),
            torch.randn(lay.num_kv_heads, 1, lay.head_dim, generator=g),
        )
        for _ in range(3)
    ]
    for step, (k, v) in enumerate(new):
        for li in range(lay.num_layers):
            keys, values = window.attend_kv(li, k, v)
            want_k = torch.cat([before[li][0], *(kk for kk, _ in new[: step + 1])], dim=1)
            want_v = torch.cat([before[li][1], *(vv for _, vv in new[: step + 1])], dim=1)
            assert torch.equal(keys, want_k) and torch.equal(values, want_v)
    row = torch.full((lay.num_kv_heads, 1, lay.head_dim), 7.0)
    compressor.commit(ckv, [(row, row)] * lay.num_layers, torch.tensor([80]))
    for li, layer in enumerate(ckv.layers):
        k, _ = layer.read()
        if not spec.startswith("streamingllm"):  # a sliding window drops its oldest row instead
            assert torch.equal(k[:, :-1], before[li][0])
        assert torch.equal(k[:, -1:], row)  # the commit (KIVI's residual is exact), not a draft row
    with pytest.raises(RuntimeError, match="newer draft window"):
        DraftKV(ckv)
        window.attend_kv(0, *new[0])


def test_one_head_gemm_serves_every_segment_as_its_own_would(tiny_runner, prompt):
    """Rows from several segments ("last", "all", "none") through one head GEMM: each segment's
    logits are the ones it gets alone, in its own order."""

    def ctx(n):
        c = ResidentKV(tiny_runner.layout, 64)
        tiny_runner.forward([Segment(prompt[:n], list(range(n)), c, logits="none")])
        return c

    segs = [
        (prompt[20:21], 20, "last"),
        (prompt[30:34], 30, "all"),
        (prompt[40:41], 40, "none"),
        (prompt[50:53], 50, "last"),
    ]
    together = tiny_runner.forward([Segment(t, list(range(p, p + len(t))), ctx(p), logits=mode) for t, p, mode in segs])
    for (t, p, mode), out in zip(segs, together, strict=True):
        alone = tiny_runner.forward([Segment(t, list(range(p, p + len(t))), ctx(p), logits=mode)])[0]
        if mode == "none":
            assert out.logits is None
            continue
        assert out.logits.shape == alone.logits.shape == ((1 if mode == "last" else len(t)), 512)
        assert (out.logits - alone.logits).abs().max() < 1e-5


@pytest.mark.parametrize("room", [0, 4, 2])
def test_a_verify_pass_over_a_fetch_with_room_writes_in_place_and_matches_concatenation(tiny_runner, room):
    """A fetch that keeps room after each layer's full KV gives the verify pass the same keys and
    values as concatenation (and the same logits), without copying the full KV on its path; too
    little room (2 for 4 tokens) falls back to concatenation."""
    g = torch.Generator().manual_seed(1)
    lay = tiny_runner.layout
    kv = [
        (
            torch.randn(lay.num_kv_heads, 50, lay.head_dim, generator=g),
            torch.randn(lay.num_kv_heads, 50, lay.head_dim, generator=g),
        )
        for _ in range(lay.num_layers)
    ]
    store = FullKVStore(MemoryStore(), lay, chunk_tokens=16)
    req = store.open_request(list(range(50)))
    req.write(0, kv)
    fetch = FullKVFetch(req, 50, lay.num_layers, room=room)
    new = torch.randn(lay.num_kv_heads, 4, lay.head_dim, generator=g)
    for layer in range(lay.num_layers):
        keys, values = StreamedKV(fetch).attend_kv(layer, new, new)
        assert torch.equal(keys, torch.cat([kv[layer][0], new], dim=1))
        assert torch.equal(values, torch.cat([kv[layer][1], new], dim=1))
        in_place = fetch.with_new(layer, new, new)
        assert (in_place is not None) == (room >= 4)
    fetch.join()
    # the logits of a verify pass are those over a resident full KV
    tokens = [5, 6, 7, 8]
    over_fetch = tiny_runner.forward(
        [Segment(tokens, list(range(50, 54)), StreamedKV(FullKVFetch(req, 50, lay.num_layers, room=room)))]
    )[0]
    resident = ResidentKV.from_full(FullKV(lay, kv), 60)
    over_resident = tiny_runner.forward([Segment(tokens, list(range(50, 54)), resident)])[0]
    assert torch.equal(over_fetch.logits, over_resident.logits)


def test_a_resident_kv_serves_verify_passes_from_its_own_room(tiny_runner, prompt):
    """The recompute fallback's feed: the resident KV's buffers, the verify pass's tokens in the
    room past its length (not copied, not kept: its length does not move)."""
    resident = ResidentKV(tiny_runner.layout, 64)
    tiny_runner.forward([Segment(prompt[:40], list(range(40)), resident, logits="none")])
    feed = ResidentFeed.of_resident(resident)
    out = tiny_runner.forward([Segment(prompt[40:44], list(range(40, 44)), StreamedKV(feed))])[0]
    assert resident.length == 40 and feed.with_new(0, *resident.to_full().layers[0]) is None  # 40 rows > room
    copied = ResidentKV.from_full(resident.to_full(), 64)
    want = tiny_runner.forward([Segment(prompt[40:44], list(range(40, 44)), copied)])[0]
    assert torch.equal(out.logits, want.logits)


def test_growing_rows_drop_and_keep_work_in_place_and_keep_the_order():
    """A sliding window's eviction moves the sinks on (no copy of the window, no reallocation);
    a drop nearer the end moves the tail back; ``keep`` gathers into the same buffer; and rows
    dropped at the front are reused when the content outgrows the buffer's end."""
    g = GrowingRows(rows(10))
    g.append(rows(1, 10))
    buffer = g._buf.data_ptr()
    g.drop(2, 1)  # sinks 0, 1 move on over row 2
    assert torch.equal(g.view, torch.cat([rows(2), rows(8, 3)], dim=1)) and g.start == 1
    g.drop(7, 2)  # values 8 and 9 go: the one row after them moves back, not the seven before
    assert g.view[0, :, 0].tolist() == [0, 1, 3, 4, 5, 6, 7, 10] and g.start == 1
    g.keep(torch.tensor([[0, 2, 7], [0, 2, 7]]))
    assert g.view[0, :, 0].tolist() == [0, 3, 10] and g.view[1, :, 0].tolist() == [0, 3, 10]
    last = 10 + g.capacity  # past the buffer's end: the content moves to its front, not to a new one
    for t in range(11, last + 1):
        g.append(rows(1, t))
        g.drop(1, 1)
    assert g._buf.data_ptr() == buffer and g.start < 10
    assert g.view[0, :, 0].tolist() == [0, last - 1, last]
    with pytest.raises(ValueError, match="cannot drop"):
        g.drop(2, 5)


def test_a_sliding_window_layer_matches_compressing_the_whole_sequence(tiny_runner):
    """StreamingLLM updated commit by commit (in place) holds exactly the rows, in the order,
    that compressing the whole sequence at once keeps, and its buffer is not reallocated."""
    g = torch.Generator().manual_seed(4)
    lay = tiny_runner.layout
    n, extra = 40, 30
    full = [
        (
            torch.randn(lay.num_kv_heads, n + extra, lay.head_dim, generator=g),
            torch.randn(lay.num_kv_heads, n + extra, lay.head_dim, generator=g),
        )
        for _ in range(lay.num_layers)
    ]
    compressor = parse_spec("streamingllm:sink=3,window=20")
    ckv = compressor.compress(FullKV(lay, [(k[:, :n], v[:, :n]) for k, v in full]))
    buffers = None
    for t in range(n, n + extra):
        compressor.commit(ckv, [(k[:, t : t + 1], v[:, t : t + 1]) for k, v in full], torch.tensor([t]))
        buffers = buffers or [layer._keys_rows._buf.data_ptr() for layer in ckv.layers]  # room made once
    whole = compressor.compress(FullKV(lay, full))
    for layer, want in zip(ckv.layers, whole.layers, strict=True):
        assert torch.equal(layer.keys, want.keys) and torch.equal(layer.values, want.values)
        assert torch.equal(layer.positions, want.positions)
    assert [layer._keys_rows._buf.data_ptr() for layer in ckv.layers] == buffers


def test_the_runner_counts_the_keys_each_row_attends_and_their_flops(tiny_runner, prompt):
    """Cost accounting for the benchmarks: a segment of n rows over c cached tokens scores n x
    (c + n) keys per layer (the causal mask's zeros included: the kernel computes them)."""
    layers = tiny_runner.layout.num_layers
    resident = ResidentKV(tiny_runner.layout, 64)
    before = tiny_runner.attended_keys
    tiny_runner.forward([Segment(prompt[:40], list(range(40)), resident, logits="none")])
    tiny_runner.forward(
        [
            Segment(prompt[40:44], list(range(40, 44)), resident),
            Segment(prompt[:1], [0], ResidentKV(tiny_runner.layout, 4)),
        ]
    )
    assert tiny_runner.attended_keys - before == layers * (40 * 40 + 4 * 44 + 1 * 1)
    one_row = tiny_runner.flops(1, 0)
    params = (
        sum(p.numel() for p in tiny_runner.layers.parameters() if p.dim() == 2) + tiny_runner.lm_head.weight.numel()
    )
    assert (
        one_row == 2 * params
        and tiny_runner.flops(3, 10) == 3 * one_row + 4 * tiny_runner.num_heads * tiny_runner.head_dim * 10
    )
