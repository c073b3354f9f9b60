"""SGLang on a CPU without its kernel package: a stand-in ``sgl_kernel`` where none is installed.

SGLang's modules import ``sgl_kernel`` when they are imported, in the launcher and in every
scheduler process it spawns, before any plugin of the ``sglang.srt.plugins`` group runs; so this
layer is installed at interpreter start, by ``vericache_sglang_cpu.pth`` in site-packages (written
there by the project's build, ``setup.py``). That file calls ``install()`` only when
``SGLANG_USE_CPU_ENGINE=1`` (SGLang's own switch for its CPU engine), and importing this module
imports neither torch nor sglang.

The finder is appended to the *end* of ``sys.meta_path``: Python's own path finder runs first, so
a real ``sgl_kernel`` (its CPU build, or a CUDA build on a GPU machine) is always the one imported;
the stand-in is built only when nothing else provides the name. It provides the two CPU ops SGLang
calls on this path and the import-only names (``ops``). ``torch.ops.sgl_kernel`` stays
empty, which keeps SGLang off its AMX path (it probes ``convert_weight_packed`` there).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Sequence

MODULE = "sgl_kernel"
ENV = "SGLANG_USE_CPU_ENGINE"


def cpu_engine_requested() -> bool:
    """SGLang's own test (``sglang.srt.utils.common.is_cpu``): the variable is exactly ``"1"``."""
    return os.environ.get(ENV, "0") == "1"


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        from vericache_sglang.sglang.cpu import ops as cpu_kernels

        table = cpu_kernels.ops()
        module.__dict__.update(table)
        module.__all__ = sorted(table)
        module.__doc__ = f"Stand-in for SGLang's CPU kernel package, from {cpu_kernels.SOURCE}."
        module.VERICACHE_STAND_IN = True

        def __getattr__(name: str) -> object:
            raise AttributeError(
                f"module 'sgl_kernel' (the stand-in of {cpu_kernels.SOURCE}) has no attribute {name!r}; "
                f"it provides {', '.join(module.__all__)}"
            )

        module.__getattr__ = __getattr__


class SglKernelStandIn(importlib.abc.MetaPathFinder):
    """Finds ``sgl_kernel`` only when every finder before it (the real package's) found nothing."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != MODULE:
            return None
        return importlib.machinery.ModuleSpec(MODULE, _StandInLoader(), origin="vericache-cpu-stand-in")


def install() -> bool:
    """Append the stand-in finder (once) when SGLang's CPU engine is requested; returns whether it is on."""
    if not cpu_engine_requested():
        return False
    if not any(isinstance(f, SglKernelStandIn) for f in sys.meta_path):
        sys.meta_path.append(SglKernelStandIn())
    return True


def is_stand_in(module: types.ModuleType) -> bool:
    """Whether an imported ``sgl_kernel`` is this stand-in (not the real package)."""
    return bool(getattr(module, "__dict__", {}).get("VERICACHE_STAND_IN", False))
