"""VeriCache inside SGLang 0.5.23: the only sub-package that imports ``sglang``.

- ``plugin``: the ``sglang.srt.plugins`` entry point (registrations, run in every process)
- ``hooks``: the launch flags, the only patches (HookRegistry), each explained
- ``config``: ``--vericache-config`` (pure Python)
- ``spec_algo``: the ``VERICACHE`` speculative algorithm; ``worker``: its worker (GPU)
- ``attention``: the draft attention backend over the private compressed pool
- ``radix_cache``: the radix tree with compressed copies of cached prefixes
- ``storage``: the full-KV tier as a HiCache storage backend (``dynamic``, ``interface_v1``)
- ``pool_kv``: KV between SGLang's pools and the core's KV objects

Importing this package does not import sglang; its modules do.
"""
