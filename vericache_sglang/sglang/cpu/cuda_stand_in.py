"""SGLang on a CUDA GPU without its kernel packages (the lent GPU machines: torch and Triton, no
``sgl_kernel``, no ``cutlass``): stand-ins for what SGLang's CUDA modules import as they load.

UNVERIFIED ON A GPU. Tested on this CPU with CUDA faked (``torch.cuda.is_available`` answering
True): the modules of a Llama server on the triton backend then import, and nothing else is
answered. Installed by the platform layer (``platform.install``) when ``VERICACHE_TORCH_KERNELS=1``.

- ``sgl_kernel``: a package of the names SGLang 0.5.23 imports at load with ``is_cuda()`` (norms,
  activations, renorm sampling, int8/MoE/GGUF ops, ``kvcacheio`` transfers, ``utils``). Only
  ``utils.is_arch_support_pdl`` is called on the path the GPU check runs (its answer: no PDL); the
  others raise ``NotImplementedError`` naming the op if called, so a path that reaches one fails
  loudly instead of computing anything. That path is kept off them by the server's environment:
  ``SGLANG_FORCE_FUSED_OP_BACKEND=torch`` (SGLang's switch for its fused layers' torch forms),
  ``--sampling-backend pytorch``, no CUDA graphs, no HiCache (``sglang_server.CUDA_TORCH``).
  ``sgl_kernel.allreduce`` and ``.scalar_type`` are deliberately not answered: their importers
  fall back on ImportError.
- ``sglang.kernels.ops.gemm.cutedsl_dual_gemm``, only where ``cutlass`` is absent: Llama's and
  Qwen's MLP import it on CUDA before any device check; the dual GEMM is never usable then.

``CudaStandIn`` is appended to the end of ``sys.meta_path``: a real ``sgl_kernel``, found by
Python's path finder first, always wins. ``DualGemmStandIn`` goes first (the real module file is
there, and fails on importing ``cutlass``) and answers only while ``cutlass`` is not installed.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import importlib.util
import types
from collections.abc import Callable, Sequence

ENV = "VERICACHE_TORCH_KERNELS"
DUAL_GEMM = "sglang.kernels.ops.gemm.cutedsl_dual_gemm"
NAMES: dict[str, tuple[str, ...]] = {
    "sgl_kernel": (
        "rmsnorm",
        "fused_add_rmsnorm",
        "gemma_rmsnorm",
        "gemma_fused_add_rmsnorm",
        "silu_and_mul",
        "gelu_and_mul",
        "gelu_tanh_and_mul",
        "top_k_renorm_prob",
        "top_p_renorm_prob",
        "int8_scaled_mm",
        "moe_sum",
        "moe_sum_reduce",
        "weak_ref_tensor",
    ),
    "sgl_kernel.quantization": ("ggml_dequantize", "ggml_moe_a8", "ggml_mul_mat_a8", "ggml_mul_mat_vec_a8"),
    "sgl_kernel.kvcacheio": tuple(
        f"transfer_kv_{name}"
        for name in (
            "all_layer",
            "all_layer_direct_lf_pf",
            "all_layer_lf_pf",
            "all_layer_lf_ph",
            "all_layer_mla",
            "all_layer_mla_lf_pf",
            "direct",
            "per_layer",
            "per_layer_direct_pf_lf",
            "per_layer_mla",
            "per_layer_mla_pf_lf",
            "per_layer_pf_lf",
            "per_layer_ph_lf",
        )
    ),
    "sgl_kernel.utils": ("is_arch_support_pdl",),
}


def _not_here(qualname: str) -> Callable[..., object]:
    def op(*args: object, **kwargs: object) -> object:
        raise NotImplementedError(
            f"{qualname}: not in VeriCache's torch stand-in of sgl_kernel (no CUDA kernel package on this "
            "machine); run SGLang with SGLANG_FORCE_FUSED_OP_BACKEND=torch, --sampling-backend pytorch, "
            "CUDA graphs and HiCache off, or install sgl_kernel"
        )

    op.__name__ = qualname.rpartition(".")[2]
    return op


def _no_pdl() -> bool:
    return False  # programmatic dependent launch: a property of sgl_kernel's own kernels


class DualGemmQuantMode(enum.IntEnum):
    """SGLang's enum, same values (``DualGemm._select_mode`` reads it before asking
    ``can_use_dual_gemm``)."""

    STATIC_PER_TENSOR = 0
    STATIC_PER_TOKEN = 1
    DYNAMIC_PER_TENSOR = 2
    DYNAMIC_PER_TOKEN = 3
    UNQUANT = 4


class _Loader(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        module.VERICACHE_STAND_IN = True
        if module.__name__ == DUAL_GEMM:
            module.MAX_DUAL_GEMM_DECODE_TOKENS = 16
            module.DualGemmQuantMode = DualGemmQuantMode
            module.can_use_dual_gemm = lambda *args, **kwargs: False
            return
        for name in NAMES[module.__name__]:
            setattr(module, name, _no_pdl if name == "is_arch_support_pdl" else _not_here(f"{module.__name__}.{name}"))
        module.__all__ = list(NAMES[module.__name__])


class CudaStandIn(importlib.abc.MetaPathFinder):
    """Finds the ``sgl_kernel`` stand-ins only when every finder before it (the real package's) found nothing."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in NAMES:
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _Loader(), origin="vericache-cuda-stand-in", is_package=fullname == "sgl_kernel"
        )


class DualGemmStandIn(importlib.abc.MetaPathFinder):
    """SGLang's CuTe DSL dual GEMM module, answered while ``cutlass`` is not installed."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != DUAL_GEMM or importlib.util.find_spec("cutlass") is not None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(), origin="vericache-cuda-stand-in")


def install() -> None:
    """Both finders, once each (idempotent)."""
    import sys

    if not any(isinstance(f, CudaStandIn) for f in sys.meta_path):
        sys.meta_path.append(CudaStandIn())
    if not any(isinstance(f, DualGemmStandIn) for f in sys.meta_path):
        sys.meta_path.insert(0, DualGemmStandIn())
