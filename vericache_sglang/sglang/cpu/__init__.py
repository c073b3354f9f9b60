"""SGLang on a CPU without its kernel package.

- ``platform``: the stand-in ``sgl_kernel`` finder, installed at interpreter start by the project's
  ``.pth`` line when ``SGLANG_USE_CPU_ENGINE=1``; never shadows a real ``sgl_kernel``; with
  ``VERICACHE_CPU_DETERMINISTIC=1`` it answers deterministic inference's GPU-only set-up on CPU
- ``ops``: the kernel-package ops SGLang's CPU path calls (pool moves, slot writes, the seeded
  draw's hash), in torch
- ``hicache``: SGLang's HiCache on a CPU device (unpinned host pools, the direct io backend's copies
  in torch)
- ``chain_attention``: chain verification on ``torch_native`` (which has no speculative path)
"""
