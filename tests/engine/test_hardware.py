"""The memory-bandwidth probe every link ratio is set against: a streaming read, repeated, with
its spread reported beside the median."""

from vericache_sglang.engine.hardware import memory_bandwidth, streaming_read_bandwidth


def test_probe_reports_its_median_and_spread():
    probe = streaming_read_bandwidth("cpu", 64 << 20, 5)
    assert probe.array_bytes == 64 << 20 and probe.reads == 5
    assert 0 < probe.low_bytes_s <= probe.bytes_s <= probe.high_bytes_s
    assert probe.spread == (probe.high_bytes_s - probe.low_bytes_s) / probe.bytes_s
    text = probe.describe()
    assert "median of 5 reads of 0.06 GiB" in text and "spread" in text
    assert probe.to_dict()["spread"] == probe.spread


def test_the_engine_figure_is_the_default_probes_median():
    assert memory_bandwidth("cpu") == streaming_read_bandwidth("cpu").bytes_s
