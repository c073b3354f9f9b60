"""Step cost: what one batched iteration costs against the bytes it must read.

A decode iteration is bandwidth-bound: it reads the weights once and each request's KV once. For
each iteration kind (a full-KV decode step, a draft step over each compressed KV, a verify pass
of x+1 tokens over the full KV), at each batch size and context length, this times the runner's
forward and sets it against its bytes (weights + KV attended) at the machine's measured streaming
read bandwidth; a draft step is also set against the full step scaled by their bytes. One point
per mode is profiled to show where the time beyond the bytes goes.

The KV is random (a step's cost does not depend on its values); the compressed KVs are made from
it by each compressor, scored by random observation queries. Writes ``step_cost.{json,md,png}``.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from vericache_sglang.bench.common import load_config, table
from vericache_sglang.core.compress import parse_spec
from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.kv import FullKV
from vericache_sglang.engine.fetch import ResidentFeed
from vericache_sglang.engine.hardware import streaming_read_bandwidth
from vericache_sglang.engine.model import load_model
from vericache_sglang.engine.runner import DraftKV, ModelRunner, ResidentKV, Segment, StreamedKV

# Profiler op names grouped by what they stand for in a step.
OP_GROUPS = (  # first match wins
    ("weight GEMMs", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
    ("attention", ("scaled_dot_product", "flash_attention")),
    (
        "dequantization",
        (
            "aten::embedding",
            "aten::index_select",
            "aten::bitwise",
            "aten::__rshift__",
            "aten::__and__",
            "aten::mul_",
            "aten::add_",
        ),
    ),
    ("KV copies", ("aten::cat", "aten::copy_", "aten::index", "aten::gather")),
)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(step: Callable[[], None], device: torch.device, repeats: int) -> list[float]:
    step()  # warm: first-touch pages, allocator, kernel choice
    times = []
    for _ in range(repeats):
        _sync(device)
        t = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t)
    return times


def _profile(step: Callable[[], None], active: int = 2) -> dict[str, float]:
    """Milliseconds of one step per op group (self time, the mean of ``active`` profiled steps),
    the rest as 'other ops'."""
    step()  # the profiler's own first-call costs land outside
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(active):
            step()
    groups: dict[str, float] = defaultdict(float)
    for ev in prof.key_averages():
        group = next((g for g, names in OP_GROUPS if any(n in ev.key for n in names)), "other ops")
        groups[group] += ev.self_cpu_time_total / 1e3 / active
    return dict(groups)


class StepPoint:
    """One batch of requests at one context length: their resident KVs, and steps over them."""

    def __init__(self, runner: ModelRunner, context: int, batch: int, seed: int = 0):
        layout, dev = runner.layout, runner.device
        g = torch.Generator(device="cpu").manual_seed(seed)
        shape = (layout.num_kv_heads, context, layout.head_dim)
        base = FullKV(
            layout,
            [
                (
                    torch.randn(shape, generator=g).to(dev, layout.dtype),
                    torch.randn(shape, generator=g).to(dev, layout.dtype),
                )
                for _ in range(layout.num_layers)
            ],
        )
        self.runner, self.context, self.batch = runner, context, batch
        self.resident = [ResidentKV.from_full(base, context + 64, dev) for _ in range(batch)]  # each its own
        self.full = [r.to_full() for r in self.resident]
        self.obs = Observation(
            queries=[
                torch.randn(runner.num_heads, 64, layout.head_dim, generator=g).to(dev, layout.dtype)
                for _ in range(layout.num_layers)
            ]
        )

    @property
    def full_kv_bytes(self) -> int:
        return sum(f.nbytes for f in self.full)

    def weights_step(self) -> Callable[[], None]:
        """The batch's tokens over no context (each attends to itself): the weights' pass alone."""
        empty = [ResidentKV(self.runner.layout, 1, self.runner.device) for _ in range(self.batch)]

        def step() -> None:
            self.runner.forward([Segment([1], [self.context], r, logits="last") for r in empty])
            for r in empty:
                r.truncate(0)

        return step

    def full_step(self) -> Callable[[], None]:
        def step() -> None:
            self.runner.forward([Segment([1], [self.context], r, logits="last") for r in self.resident])
            for r in self.resident:
                r.truncate(self.context)

        return step

    def draft_step(self, spec: str) -> tuple[Callable[[], None], int]:
        compressor = parse_spec(spec)
        ckvs = [compressor.compress(f, self.obs) for f in self.full]

        def step() -> None:
            self.runner.forward([Segment([1], [self.context], DraftKV(c), logits="last") for c in ckvs])

        return step, sum(c.nbytes for c in ckvs)

    def verify_step(self, x: int) -> Callable[[], None]:
        # Each request's full KV in a buffer with room for the x+1 tokens, as a fetch leaves it
        # (the resident buffers themselves: no second copy of every full KV).
        feeds = [ResidentFeed.of_resident(r) for r in self.resident]

        def step() -> None:
            self.runner.forward(
                [
                    Segment([1] * (x + 1), list(range(self.context, self.context + x + 1)), StreamedKV(feed))
                    for feed in feeds
                ]
            )

        return step


def _iterations(point: StepPoint, cfg: dict) -> list[tuple[str, str, Callable[[], tuple[Callable[[], None], int]]]]:
    """Each iteration kind at a point: its name, kind, and how to build its step (and the KV
    bytes it reads). Built one at a time and dropped after timing: twelve 8k-token requests'
    compressed KVs of every compressor at once would not fit this machine's memory."""
    full_bytes = point.full_kv_bytes
    kinds = [
        ("weights pass", "weights", lambda: (point.weights_step(), 0)),
        ("full decode", "full", lambda: (point.full_step(), full_bytes)),
    ]
    for template in cfg["drafts"]:
        # {eighth}/{quarter}: a window of that share of the context (positional droppers)
        spec = template.format(eighth=point.context // 8 - 4, quarter=point.context // 4 - 4)
        kinds.append((f"draft {template}", "draft", lambda spec=spec: point.draft_step(spec)))
    for x in cfg["verify_horizons"]:
        kinds.append((f"verify x={x}", "verify", lambda x=x: (point.verify_step(x), full_bytes)))
    return kinds


def _measure(point: StepPoint, cfg: dict, weights: int, bw: float, profile: bool) -> Iterator[tuple[dict, dict | None]]:
    full_bytes, full_ms, weights_ms = point.full_kv_bytes, None, None
    for name, kind, make in _iterations(point, cfg):
        step, kv_bytes = make()
        times = sorted(_timed(step, point.runner.device, cfg["repeats"]))
        ms = 1e3 * times[len(times) // 2]
        read = weights + kv_bytes
        byte_ms = 1e3 * read / bw
        if kind == "full":
            full_ms = ms
        if kind == "weights":
            weights_ms = ms
        row = {
            "iteration": name,
            "kind": kind,
            "context": point.context,
            "batch": point.batch,
            "ms": ms,
            "ms_min": 1e3 * times[0],
            "read_mb": read / 1e6,
            "kv_mb": kv_bytes / 1e6,
            "kv_fraction": kv_bytes / full_bytes,
            "byte_ms": byte_ms,
            "over_bytes": ms / byte_ms,
            "achieved_gb_s": read / ms / 1e6,
            "predicted_from_full_ms": full_ms * read / (weights + full_bytes) if kind == "draft" else None,
        }
        if row["predicted_from_full_ms"] is not None:
            row["over_full_prediction"] = ms / row["predicted_from_full_ms"]
        if kv_bytes:  # the step beyond the weights' pass, against the KV's own bytes
            row["kv_ms"] = ms - weights_ms
            row["kv_over_bytes"] = row["kv_ms"] / (1e3 * kv_bytes / bw)
        yield row, (_profile(step) if profile else None)


def run(config_path: Path | None = None, quick: bool = False, out_dir: Path | None = None, log=print) -> dict:
    cfg = load_config("step_cost", config_path, quick)
    torch.set_num_threads(cfg["threads"])
    device = cfg.get("device", "cpu")
    loaded = load_model(cfg["model"], device=device, progress=False)
    runner = ModelRunner(loaded)
    probe = streaming_read_bandwidth(str(runner.device))
    log(f"memory bandwidth: {probe.describe()}")
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    rows, profiles = [], {}
    for context in cfg["contexts"]:
        for batch in cfg["batches"]:
            t = time.monotonic()
            point = StepPoint(runner, context, batch)
            profile = (context, batch) == tuple(cfg["profile_at"])
            for row, prof in _measure(point, cfg, weights, probe.bytes_s, profile):
                rows.append(row)
                if prof is not None:
                    profiles[row["iteration"]] = prof
                log(
                    f"ctx {context:>5} batch {batch:>2} {row['iteration']:<40} {row['ms']:8.1f} ms  "
                    f"bytes {row['byte_ms']:7.1f} ms  x{row['over_bytes']:.2f}"
                )
            del point
            log(f"  (point ctx {context} batch {batch} took {time.monotonic() - t:.0f} s)")
    summary = _summary(cfg, rows, probe, weights)
    if out_dir is not None:
        _write(out_dir, cfg, rows, profiles, summary, quick)
    return summary


def _summary(cfg: dict, rows: list[dict], probe, weights: int) -> dict:
    def at(name: str) -> dict | None:
        return next(
            (
                r
                for r in rows
                if r["iteration"] == name and r["context"] == cfg["check_at"][0] and r["batch"] == cfg["check_at"][1]
            ),
            None,
        )

    names = ["weights pass", "full decode", *(f"draft {s}" for s in cfg["drafts"])]
    check = {name: (round(r["over_bytes"], 3) if r else None) for name in names for r in [at(name)]}
    kv_check = {name: (round(r["kv_over_bytes"], 3) if r else None) for name in names[1:] for r in [at(name)]}
    return {
        "memory_probe": probe.to_dict(),
        "memory_probe_text": probe.describe(),
        "weights_bytes": weights,
        "check_at": cfg["check_at"],
        "over_bytes_at_check": check,
        "kv_over_bytes_at_check": kv_check,
        "points": len(rows),
    }


def _write(out_dir: Path, cfg: dict, rows: list[dict], profiles: dict, summary: dict, quick: bool) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "step_cost_quick" if quick else "step_cost"
    (out_dir / f"{stem}.json").write_text(
        json.dumps({"config": cfg, "rows": rows, "profiles": profiles, "summary": summary}, indent=2)
    )
    cols = [
        "iteration",
        "context",
        "batch",
        "kv_fraction",
        "ms",
        "read_mb",
        "byte_ms",
        "over_bytes",
        "achieved_gb_s",
        "over_full_prediction",
        "kv_ms",
        "kv_over_bytes",
    ]
    groups = [g for g, _ in OP_GROUPS] + ["other ops"]
    prof_rows = [
        {"iteration": name, **{g: round(p.get(g, 0.0), 1) for g in groups}, "total": round(sum(p.values()), 1)}
        for name, p in profiles.items()
    ]
    ctx, batch = cfg["profile_at"]
    md = [
        f"Step cost on `{cfg['model']}` ({cfg['threads']} threads, {cfg.get('device', 'cpu')}): "
        f"ms per iteration (median of {cfg['repeats']}) against the bytes it reads (weights "
        f"{summary['weights_bytes'] / 1e6:.0f} MB + the KV attended) at the measured memory bandwidth: "
        f"{summary['memory_probe_text']}. `over_bytes` = ms / byte time; `over_full_prediction` = a "
        "draft step against the full step scaled by their bytes.",
        "",
        table(rows, cols),
        "",
        f"Where a step's time goes (ms of one step, profiler self time by op group, context {ctx}, batch {batch}):",
        "",
        table(prof_rows, ["iteration", *groups, "total"]),
    ]
    (out_dir / f"{stem}.md").write_text("\n".join(md) + "\n")
    _plot(out_dir / f"{stem}.png", rows, cfg)


def _plot(path: Path, rows: list[dict], cfg: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = cfg["contexts"]
    fig, axes = plt.subplots(1, len(contexts), figsize=(4.6 * len(contexts), 4.2), squeeze=False)
    for ax, context in zip(axes[0], contexts, strict=True):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # a dozen series, none sharing a colour
        ax.set_yscale("log")
        for name in dict.fromkeys(r["iteration"] for r in rows):
            pts = sorted(
                (r["batch"], r["over_bytes"]) for r in rows if r["iteration"] == name and r["context"] == context
            )
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_title(f"context {context}")
        ax.set_xlabel("batch (requests per iteration)")
        ax.set_ylabel("ms / byte time")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
