"""The link emulator: real bytes, the emulated transfer time slept, one transfer at a time."""

import time

import pytest

from remote_store.backends.memory import MemoryStore
from remote_store.link import LinkEmulator

GROUP_BYTES = 1 << 20
LINK_S = 0.05  # per group


def link_with_groups(n: int) -> tuple[LinkEmulator, list[list[str]]]:
    inner = MemoryStore()
    inner.put_many([(f"k{i}", bytes(GROUP_BYTES)) for i in range(n)])
    return LinkEmulator(inner, GROUP_BYTES / LINK_S), [[f"k{i}"] for i in range(n)]


@pytest.mark.parametrize("ranges", [False, True])
def test_a_stream_moves_while_its_reader_works_and_never_faster_than_the_link(ranges):
    # The reader spends one group's link time on each group it gets. A link that waited for the
    # reader would take 2 x 4 group times; a streaming one 4 + the reader's last.
    link, groups = link_with_groups(4)
    if ranges:
        stream = link.stream_get_ranges([[(key, [(0, GROUP_BYTES)])] for (key,) in groups])
    else:
        stream = link.stream_get(groups)
    started, arrived = time.monotonic(), []
    for out in stream:
        arrived.append(time.monotonic() - started)
        assert sum(len(p) for parts in out for p in (parts if ranges else [parts])) == GROUP_BYTES
        time.sleep(LINK_S)
    elapsed = time.monotonic() - started
    for i, t in enumerate(arrived):  # group i is whole only after i + 1 group times on the link
        assert t >= (i + 1) * LINK_S - 2e-3, arrived
    assert elapsed < 6.5 * LINK_S, arrived
    assert link.transfer_s == pytest.approx(4 * LINK_S) and link.bytes_moved == 4 * GROUP_BYTES


def test_transfers_queue_behind_a_stream_on_the_serial_link():
    link, groups = link_with_groups(3)
    stream = link.stream_get(groups[:2])
    started = time.monotonic()
    next(stream)  # the stream's first group is through; its second is booked once the reader asks
    link.get_many(groups[2])  # a read that arrives meanwhile waits for the link
    list(stream)
    assert time.monotonic() - started >= 3 * LINK_S - 2e-3
    assert link.transfer_s == pytest.approx(3 * LINK_S)
