"""SGLang's HiCache on a CPU device: the three places its host tier assumes CUDA, answered on CPU.

With ``--device cpu`` SGLang 0.5.23 builds HiCache (``--enable-hierarchical-cache``: device pool,
host pool, L3 storage backends, prefetch, write-through) and then fails where a GPU is assumed:

1. **Pinned host pools.** Host pools are page-locked (``cudaHostRegister``, ``pin_memory=True``)
   so that a GPU can DMA from them; that asks the CUDA driver, which a CPU machine does not have.
   Here the "device" pool is host memory too, so host pools are allocated unpinned.
2. **The copies.** The ``direct`` io backend's copies are ``sgl_kernel.kvcacheio`` ops that SGLang
   imports on CUDA, ROCm and XPU only. They are given here in torch, with the kernels' semantics
   (``transfer_kv_direct``, ``transfer_kv_per_layer_direct_pf_lf``,
   ``transfer_kv_all_layer_direct_lf_pf``: token indices, pages of ``page_size`` consecutive
   tokens, the ``page_first_direct`` host layout ``[page, layer, token in page, head, dim]``).
3. **The io backend.** The default ``kernel`` io backend's ops take raw device pointers and exist
   only as CUDA kernels; on CPU the io backend resolves to ``direct`` (logged), the way SGLang
   itself switches it for layouts the kernels do not serve.

SGLang keeps 10 GiB of host memory free beside every host pool it sizes
(``HICACHE_HOST_MEMORY_RESERVE_BYTES``, meant for GPU hosts). It stays SGLang's unless
``VERICACHE_CPU_HICACHE_RESERVE_GIB`` is set: several CPU servers on one small machine (the test
suite's) set a smaller one rather than fail to launch.

Installed by ``platform.install()`` with SGLang's CPU engine only, as patches applied when each
module is first imported; a name SGLang already binds is never replaced.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported at interpreter start (platform.install): torch only when an op runs
    import torch

logger = logging.getLogger(__name__)

BASE = "sglang.srt.mem_cache.pool_host.base"
MHA = "sglang.srt.mem_cache.pool_host.mha"
HOOK = "sglang.srt.arg_groups.hicache_hook"
RESERVE_ENV = "VERICACHE_CPU_HICACHE_RESERVE_GIB"


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """``dst_layers[i][dst_indices] = src_layers[i][src_indices]`` for every buffer ``i`` (both
    token-major: layer-first host pools and the device pool)."""
    _check(src_indices, dst_indices, page_size)
    for src, dst in zip(src_layers, dst_layers, strict=True):
        dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """One layer host -> device: ``src_ptrs`` are the host pool's K and V buffers in the
    ``page_first_direct`` layout, ``dst_ptrs`` that layer's device K and V."""
    _check(src_indices, dst_indices, page_size)
    pages, offsets = _pages_and_offsets(src_indices, page_size)
    for src, dst in zip(src_ptrs, dst_ptrs, strict=True):
        dst[dst_indices.to(dst.device)] = src[pages, layer_id, offsets].to(dst.device)


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Every layer device -> host: ``src_ptrs`` are the device pool's K buffers then its V buffers
    (one per layer), ``dst_ptrs`` the host pool's K and V in the ``page_first_direct`` layout."""
    _check(src_indices, dst_indices, page_size)
    layers = len(src_ptrs) // len(dst_ptrs)
    if layers * len(dst_ptrs) != len(src_ptrs):
        raise ValueError(f"{len(src_ptrs)} device buffers do not split into {len(dst_ptrs)} kinds")
    pages, offsets = _pages_and_offsets(dst_indices, page_size)
    for kind, dst in enumerate(dst_ptrs):
        for layer in range(layers):
            src = src_ptrs[kind * layers + layer]
            dst[pages, layer, offsets] = src[src_indices.to(src.device)].to(dst.device)


def _pages_and_offsets(host_indices: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``page_first_direct`` host pool's token indices as (page, offset in page)."""
    host = host_indices.cpu().long()
    return host // page_size, host % page_size


def _check(src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int) -> None:
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"{src_indices.numel()} source indices for {dst_indices.numel()} destinations")
    if page_size <= 0 or src_indices.numel() % page_size:
        raise ValueError(f"{src_indices.numel()} indices are not whole pages of {page_size}")


DIRECT_OPS: dict[str, Callable[..., None]] = {
    "transfer_kv_direct": transfer_kv_direct,
    "transfer_kv_per_layer_direct_pf_lf": transfer_kv_per_layer_direct_pf_lf,
    "transfer_kv_all_layer_direct_lf_pf": transfer_kv_all_layer_direct_lf_pf,
}
# what the kernel io backend would call (MHA pools); raise naming the fix if ever reached
KERNEL_OPS = (
    "transfer_kv_per_layer",
    "transfer_kv_all_layer",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_per_layer_ph_lf",
    "transfer_kv_all_layer_lf_ph",
)


def _patch_base(module: types.ModuleType) -> None:
    reserve = os.environ.get(RESERVE_ENV)
    if reserve is not None:
        gib = float(reserve)
        if gib < 0:
            raise ValueError(f"{RESERVE_ENV}={reserve}: a reserve of host memory is >= 0 GiB")
        module.HICACHE_HOST_MEMORY_RESERVE_BYTES = int(gib * 1024**3)
    cls = module.HostKVCache
    init = cls.__init__

    def __init__(self, *args: object, **kwargs: object) -> None:
        if "pin_memory" in kwargs:
            kwargs["pin_memory"] = False  # no GPU to DMA from: host memory stays pageable
        init(self, *args, **kwargs)

    __init__.__wrapped__ = init
    cls.__init__ = __init__


def _patch_mha(module: types.ModuleType) -> None:
    from sglang.srt.mem_cache.pool_host._kvcacheio import unavailable_stub

    for name, op in DIRECT_OPS.items():
        if name not in module.__dict__:
            setattr(module, name, op)
    reason = "they are CUDA kernels over device pointers; on CPU HiCache copies with --hicache-io-backend direct"
    for name in KERNEL_OPS:
        if name not in module.__dict__:
            setattr(module, name, unavailable_stub(name, reason))


def _patch_hook(module: types.ModuleType) -> None:
    resolve = module.resolve_layout_io_compatibility

    def resolve_layout_io_compatibility(server_args: object) -> None:
        cfg = module.resolving_view(server_args)
        if cfg.hicache_io_backend == "kernel":
            module.declare_resolution(server_args, "vericache_cpu_hicache", hicache_io_backend="direct")
            logger.warning("HiCache on CPU: the kernel io backend's ops are CUDA kernels, switching to direct")
        resolve(server_args)

    module.resolve_layout_io_compatibility = resolve_layout_io_compatibility


PATCHES: dict[str, Callable[[types.ModuleType], None]] = {BASE: _patch_base, MHA: _patch_mha, HOOK: _patch_hook}
