"""The GPU check's install folder made whole (``scripts/gpu_check.sh``, on a machine where the
project is a source tree on ``PYTHONPATH``, not an installed package). Standard library only: it
runs before anything of the bundle is importable.

Into ``SITE`` (the folder the bundle's wheels went to) it writes:

- the platform layer's ``.pth`` line, exactly as the project's install writes it (``setup.py``);
- a ``sitecustomize`` that processes ``SITE``'s ``.pth`` files at every interpreter start, in the
  processes SGLang spawns too (a folder on ``PYTHONPATH`` is not a site directory);
- the project's ``dist-info`` with its entry points, from ``pyproject.toml``: SGLang finds the
  plugin (``sglang.srt.plugins``) through ``importlib.metadata``, not through imports.

Usage: ``python -m vericache_sglang.bench.gpu_site SITE``
"""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _pth() -> tuple[str, str]:
    """setup.py's PTH_NAME and PTH_LINE, read without running setup.py (setuptools may be absent)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    assigns = [n for n in tree.body if isinstance(n, ast.Assign)]
    values = {t.id: n.value for n in assigns for t in n.targets if isinstance(t, ast.Name)}
    return ast.literal_eval(values["PTH_NAME"]), ast.literal_eval(values["PTH_LINE"])


def write_site(site: Path) -> Path:
    """Write the three pieces into ``site``; returns the ``dist-info`` folder."""
    name, line = _pth()
    (site / name).write_text(line)
    (site / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    info = site / f"vericache_sglang-{project['version']}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vericache-sglang\nVersion: {project['version']}\n")
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    (info / "entry_points.txt").write_text(
        "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())
    )
    return info


if __name__ == "__main__":
    write_site(Path(sys.argv[1]))
