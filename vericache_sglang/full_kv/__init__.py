"""The full KV over a byte store (``remote_store``): the KV-aware layer, as LMCache puts its KV layer
above its connectors.

- ``keys``: chunk keys, a chained hash of the token prefix salted with model, layout and namespace
- ``store``: ``FullKVStore`` (a model's exact KV, chunk by chunk, every read checked) and
  ``RequestKV`` (one request's records, written as tokens commit, fetched per layer)
- ``subset``: fetching only the rows a verification does not already hold
- ``documents``: the catalog of shared documents (remote prefix caching)

``remote_store`` below knows bytes only and imports nothing from this package.
"""
