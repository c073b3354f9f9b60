"""Where drafts read the compressed KV: the private pool, its attention backend, the radix tree.

- ``pool``: the private compressed pool (admit, commit, release), one row per request
- ``attention``: the ``vericache`` attention backend, the target's own kernels over that pool
- ``radix_cache``: SGLang's radix tree, each cached prefix with its compressed copy
"""
