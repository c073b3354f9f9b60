"""VeriCache inside SGLang 0.5.23: the only sub-package that imports ``sglang``.

- ``plugin``: the ``sglang.srt.plugins`` entry point (registrations, run in every process)
- ``hooks``: the launch flags, the only patches (HookRegistry), each explained
- ``config``: ``--vericache-config`` (pure Python)
- ``cpu_platform``, ``cpu_kernels``: SGLang on a CPU without its kernel package (a stand-in
  ``sgl_kernel``, loaded at interpreter start by the project's ``.pth`` line)
- ``spec_algo``: the ``VERICACHE`` speculative algorithm; ``worker``: its worker, one scheduler step
  at a time, with ``request_plan`` (how each request is served), ``forward`` (its forward passes as
  SGLang batches), ``grammar_masks``, ``acceptance`` and ``step_output`` (what the scheduler reads)
- ``draft_state``, ``draft_pool``, ``attention``: the seeds carried between steps, the private
  compressed pool and the draft attention backend over it
- ``chain_attention``: chain verification on the CPU backend (torch_native has no speculative path)
- ``radix_cache``: the radix tree with compressed copies of cached prefixes
- ``host_offload``, ``host_tier``, ``offload``, ``reloads``: ``full_kv: "host"``
- ``storage``: the full-KV tier as a HiCache storage backend (``dynamic``, ``interface_v1``)
- ``pool_kv``: KV between SGLang's pools and the core's KV objects; ``metrics``: ``vericache_*``

Importing this package does not import sglang; its modules do.
"""
