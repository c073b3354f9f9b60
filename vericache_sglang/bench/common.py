"""What the benchmarks share: fixed configs, real prompts, tables and plots."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "benchmarks" / "configs"
PROMPTS = REPO / "benchmarks" / "prompts"
RESULTS = REPO / "benchmarks" / "results"


def load_config(name: str, path: Path | None = None, quick: bool = False) -> dict:
    path = path or CONFIGS / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"benchmark config {path} not found (pass --config)")
    cfg = json.loads(path.read_text())
    overrides = cfg.pop("quick", {})
    cfg.pop("_comment", None)
    if quick:
        cfg.update(overrides)
    cfg["quick"] = quick
    return cfg


def prompts_for(engine, names: list[str], count: int) -> list[list[int]]:
    """``count`` distinct real prompts (token ids), cycling through ``names``; each opens with its
    request number so no two share a whole first chunk."""
    texts = [(PROMPTS / f"{n}.txt").read_text() for n in names]
    if engine.tokenizer is None:  # the tiny random model: random token prompts of similar shape
        import torch

        g = torch.Generator().manual_seed(0)
        return [torch.randint(0, engine.runner.vocab_size, (300,), generator=g).tolist() for _ in range(count)]
    return [engine.encode(f"Request {i}.\n\n{texts[i % len(texts)]}") for i in range(count)]


def table(rows: list[dict], cols: list[str]) -> str:
    def cell(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
        if isinstance(v, bool):
            return "yes" if v else "NO"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def plot_lines(
    path: Path,
    rows: list[dict],
    x: str,
    series: str,
    where: Callable[[dict], bool],
    xlabel: str,
    title: str,
    y: str = "throughput_tok_s",
    ylabel: str = "tokens/s",
    logx: bool = False,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    names = list(dict.fromkeys(r[series] for r in rows))
    for name in names:
        pts = sorted((r[x], r[y]) for r in rows if r[series] == name and where(r))
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    if logx:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
