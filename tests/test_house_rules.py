"""The house rules that keep the layout readable, checked on the source (no imports, a second):
no import circle among the project's modules, ``remote_store`` (the bytes layer) importing nothing
from ``vericache_sglang``, no Python file over 500 lines, a README of at most 300 lines, and every
relative link in the README and ``docs/`` resolving."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("vericache_sglang", "remote_store")  # kernels/ is imported as vericache_sglang.kernels (a link)
MAX_LINES = 500


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources() -> dict[str, Path]:
    found = {_module(p): p for pkg in PACKAGES for p in sorted((REPO / pkg).rglob("*.py"))}
    found.update({f"vericache_sglang.kernels.{p.stem}": p for p in sorted((REPO / "kernels").glob("*.py"))})
    return found


def _imports_at_load(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports when it loads: module level, outside ``TYPE_CHECKING``
    (imports inside functions run later and cannot make a circle at import time)."""
    found: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", [])):
                    visit(block)
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                    package = package[: len(package) - (node.level - 1)]
                    base = ".".join([*package, base] if base else package)
                found.add(base)
                found.update(f"{base}.{alias.name}" for alias in node.names)  # a submodule, if it is one

    visit(ast.parse(path.read_text()).body)
    return {m for m in found if m in known and m != name}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def test_no_import_circle_and_the_store_below_the_package():
    known = _sources()
    graph = {name: _imports_at_load(path, name, known) for name, path in known.items()}
    assert _circles(graph) == []
    upward = {name: sorted(m for m in deps if m.startswith("vericache_sglang")) for name, deps in graph.items()}
    assert {n: d for n, d in upward.items() if n.startswith("remote_store") and d} == {}
    # function-level imports too: the bytes layer never reaches up into the KV layer
    for path in sorted((REPO / "remote_store").rglob("*.py")):
        assert not re.search(r"^\s*(from|import) vericache_sglang", path.read_text(), re.M), path


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_python_file_over_500_lines():
    files = [p for d in (*PACKAGES, "kernels", "tests", "benchmarks", "deploy") for p in (REPO / d).rglob("*.py")]
    assert files
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_readme_is_short_and_every_link_resolves():
    readme = REPO / "README.md"
    assert len(readme.read_text().splitlines()) <= 300
    broken = []
    for doc in [readme, *sorted((REPO / "docs").rglob("*.md"))]:
        for match in re.finditer(r"\]\(([^)\s]+)\)", doc.read_text()):
            target = match.group(1).split("#")[0]
            if target and not re.match(r"[a-z]+://|mailto:", target) and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)} -> {target}")
    assert broken == []
