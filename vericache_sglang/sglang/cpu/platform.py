"""SGLang on a CPU without its kernel package: a stand-in ``sgl_kernel`` where none is installed.

SGLang's modules import ``sgl_kernel`` when they are imported, in the launcher and in every
scheduler process it spawns, before any plugin of the ``sglang.srt.plugins`` group runs; so this
layer is installed at interpreter start, by ``vericache_sglang_cpu.pth`` in site-packages (written
there by the project's build, ``setup.py``). That file calls ``install()`` only when
``SGLANG_USE_CPU_ENGINE=1`` (SGLang's own switch for its CPU engine), and importing this module
imports neither torch nor sglang.

The finder is appended to the *end* of ``sys.meta_path``: Python's own path finder runs first, so
a real ``sgl_kernel`` (its CPU build, or a CUDA build on a GPU machine) is always the one imported;
the stand-in is built only when nothing else provides the name. It provides the CPU ops SGLang
calls on this path and the import-only names (``ops``). ``torch.ops.sgl_kernel`` holds only
``murmur_hash32_cpu``, which keeps SGLang off its AMX path (it probes ``convert_weight_packed``).

**Seeded sampling on CPU** (opt-in, ``VERICACHE_CPU_DETERMINISTIC=1``). SGLang honours a request's
``seed`` only with ``--enable-deterministic-inference``, whose set-up registers batch-invariant
Triton matmuls for the accelerator's dispatch key and raises "No supported accelerator" on a CPU
(interpreted, its lm_head matmul alone takes 16 s). With the switch, that one call is answered on
CPU by leaving torch's CPU kernels in place (logged): SGLang's seeded sampler then runs as on a GPU,
but outputs are batch-invariant only as far as torch's CPU kernels are. Tests use it to have a
stock reference for seeded requests; without the switch SGLang's own error stands.

**HiCache on CPU** (always, with the CPU engine): ``hicache`` answers the three places where
``--enable-hierarchical-cache`` assumes CUDA (pinned host pools, the ``direct`` io backend's copies,
the ``kernel`` io backend), so stock SGLang's HiCache, its L3 storage backends included, runs here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable, Sequence

MODULE = "sgl_kernel"
ENV = "SGLANG_USE_CPU_ENGINE"
DETERMINISTIC_ENV = "VERICACHE_CPU_DETERMINISTIC"
TORCH_KERNELS_ENV = "VERICACHE_TORCH_KERNELS"  # a CUDA GPU without sgl_kernel: cuda_stand_in.py
BATCH_INVARIANT = "sglang.srt.batch_invariant_ops"


def cpu_engine_requested() -> bool:
    """SGLang's own test (``sglang.srt.utils.common.is_cpu``): the variable is exactly ``"1"``."""
    return os.environ.get(ENV, "0") == "1"


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        from vericache_sglang.sglang.cpu import ops as cpu_kernels

        table = cpu_kernels.ops()
        cpu_kernels.register_torch_ops()
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


def _cpu_batch_invariant_mode(*args: object, **kwargs: object) -> None:
    import logging

    logging.getLogger(__name__).warning(
        "%s=1: --enable-deterministic-inference on CPU without batch-invariant kernels (SGLang has none "
        "for CPU): SGLang's seeded sampler runs, torch's CPU matmuls stay",
        DETERMINISTIC_ENV,
    )


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real module, then applies its CPU patch."""

    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[types.ModuleType], None]):
        self.loader = loader
        self.patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        self.patch(module)


class CpuPatches(importlib.abc.MetaPathFinder):
    """Finds the SGLang modules in ``patches`` through the path finder and patches each once it
    has run (every other module is left to the finders after this one)."""

    def __init__(self, patches: dict[str, Callable[[types.ModuleType], None]]):
        self.patches = dict(patches)

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader, patch)
        return spec


def _batch_invariant_patch(module: types.ModuleType) -> None:
    module.enable_batch_invariant_mode = _cpu_batch_invariant_mode


def cpu_patches() -> dict[str, Callable[[types.ModuleType], None]]:
    """The modules patched on CPU: HiCache's host tier always (``hicache``), deterministic
    inference's set-up with the deterministic switch."""
    from vericache_sglang.sglang.cpu import hicache

    patches = dict(hicache.PATCHES)
    if os.environ.get(DETERMINISTIC_ENV, "0") == "1":
        patches[BATCH_INVARIANT] = _batch_invariant_patch
    return patches


def install() -> bool:
    """Append the stand-in finder (once) when SGLang's CPU engine is requested, and put the CPU
    patches (``cpu_patches``) first; on a CUDA machine without SGLang's
    kernel packages (``VERICACHE_TORCH_KERNELS=1``) install ``cuda_stand_in``'s finders instead.
    Returns whether a stand-in is on."""
    if not cpu_engine_requested():
        if os.environ.get(TORCH_KERNELS_ENV, "0") != "1":
            return False
        from vericache_sglang.sglang.cpu import cuda_stand_in

        cuda_stand_in.install()
        return True
    if not any(isinstance(f, SglKernelStandIn) for f in sys.meta_path):
        sys.meta_path.append(SglKernelStandIn())
    if not any(isinstance(f, CpuPatches) for f in sys.meta_path):
        sys.meta_path.insert(0, CpuPatches(cpu_patches()))
    return True


def is_stand_in(module: types.ModuleType) -> bool:
    """Whether an imported ``sgl_kernel`` is this stand-in (not the real package)."""
    return bool(getattr(module, "__dict__", {}).get("VERICACHE_STAND_IN", False))
