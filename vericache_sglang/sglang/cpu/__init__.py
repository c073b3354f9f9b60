"""SGLang on a CPU without its kernel package.

- ``platform``: the stand-in ``sgl_kernel`` finder, installed at interpreter start by the project's
  ``.pth`` line when ``SGLANG_USE_CPU_ENGINE=1``; never shadows a real ``sgl_kernel``
- ``ops``: the two kernel-package ops SGLang's CPU path calls, in torch
- ``chain_attention``: chain verification on ``torch_native`` (which has no speculative path)
"""
