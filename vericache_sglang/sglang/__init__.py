"""VeriCache inside SGLang 0.5.23: the only sub-package that imports ``sglang``.

- ``plugin``: the ``sglang.srt.plugins`` entry point (registrations, run in every process)
- ``hooks``: the launch flags, the only patches (HookRegistry), each explained
- ``config``: ``--vericache-config`` (pure Python)
- ``spec_algo``: the ``VERICACHE`` speculative algorithm
- ``step/``: its worker, one scheduler step at a time (request plans, forward passes, acceptance)
- ``draft/``: the private compressed pool, the draft attention backend over it, the radix cache
- ``full_kv/``: where a running request's full KV lives (``host``, ``store``)
- ``cpu/``: SGLang on a CPU without its kernel package (loaded at interpreter start by a ``.pth``)
- ``storage``: the full-KV tier as a HiCache storage backend (``dynamic``, ``interface_v1``)
- ``pool_kv``: KV between SGLang's pools and the core's KV objects; ``metrics``: ``vericache_*``

Importing this package does not import sglang; its modules do.
"""
