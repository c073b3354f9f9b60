"""Where a running request's full KV lives between verifications, for each ``full_kv`` value.

``"device"`` is SGLang's own pool (nothing here). ``"host"`` and ``"store"`` take it off the device
through one offload (``offload``: the worker's side; ``offload_rows``: which row positions are off
the device, the reload arena; ``reloads``: the core's staggered plan carried out) over a tier:
``host_tier`` (SGLang's host pool and transfer engine) or ``store_tier`` (the full-KV store only,
fetched on a thread while drafting runs).
"""
