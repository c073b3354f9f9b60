"""Everything is in pyproject.toml but one file: ``vericache_sglang_cpu.pth``, placed at the root of
site-packages by both a regular and an editable install.

Python runs a ``.pth`` file's ``import`` line at every interpreter start, which is the one moment
early enough for SGLang's CPU engine: its modules import ``sgl_kernel`` as they load, in the
launcher and in each scheduler process it spawns, before any ``sglang.srt.plugins`` entry point
runs. The line does nothing unless ``SGLANG_USE_CPU_ENGINE=1`` (or ``VERICACHE_TORCH_KERNELS=1``, a CUDA
machine without sgl_kernel); then it installs the stand-in finder of
``vericache_sglang/sglang/cpu/platform.py``, which never shadows a real ``sgl_kernel``.
"""

from __future__ import annotations

import os

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH_NAME = "vericache_sglang_cpu.pth"
PTH_LINE = (
    "import os; (os.environ.get('SGLANG_USE_CPU_ENGINE', '0') == '1' or "
    "os.environ.get('VERICACHE_TORCH_KERNELS', '0') == '1') and "
    "__import__('vericache_sglang.sglang.cpu.platform', fromlist=['install']).install()\n"
)


class BuildPyWithPth(build_py):
    """A regular wheel: the .pth beside the packages, at the wheel's root."""

    def run(self) -> None:
        super().run()
        with open(os.path.join(self.build_lib, PTH_NAME), "w") as f:
            f.write(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH_NAME)]


class _StrategyWithPth:
    """Wraps setuptools' editable strategy: the same editable files, plus the .pth."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, wheel, files, mapping):
        self.inner(wheel, files, mapping)
        # sorts after setuptools' "__editable__.*.pth", so the package is importable when it runs
        wheel.writestr(PTH_NAME, PTH_LINE.encode())

    def __enter__(self):
        self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)


class EditableWheelWithPth(editable_wheel):
    """An editable install (``pip install -e``, what scripts/setup.sh does): setuptools writes only
    its own files there, so the strategy that writes them is wrapped."""

    def _select_strategy(self, name, tag, build_lib):
        return _StrategyWithPth(super()._select_strategy(name, tag, build_lib))


setup(cmdclass={"build_py": BuildPyWithPth, "editable_wheel": EditableWheelWithPth})
