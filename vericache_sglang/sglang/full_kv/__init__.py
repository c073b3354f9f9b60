"""Where a running request's full KV lives, one module family per ``full_kv`` value.

``"device"`` is SGLang's own pool (nothing here). ``"host"``: ``host_offload`` (the worker's side),
``host_tier`` (SGLang's host pool and transfer engine), ``host_rows`` (which row positions are on
the host, the reload arena), ``host_reloads`` (the core's staggered plan carried out).
``"store"``: ``store_writes`` (each request's exact KV written to the full-KV store).
"""
