"""The ``vericache_*`` series both servers expose under one name and one shape: ``vericache serve``
(its own registry) and SGLang with ``--enable-vericache`` (SGLang's multiprocess registry, labelled
like SGLang's). Each server makes its metrics; what they share is defined here once."""

from __future__ import annotations

from typing import Literal, get_args

# A full-KV store operation that failed, by kind: "outage" (the store failed: the request fell back
# to recomputation, failed cleanly, or, where the device copy stays authoritative, only its writes
# stopped) or "refused" (the store refused this server's credentials: a misconfiguration, logged as
# an error and never computed around).
StoreErrorKind = Literal["outage", "refused"]
STORE_ERROR_KINDS: tuple[str, ...] = get_args(StoreErrorKind)
STORE_ERRORS = "vericache_store_errors"
STORE_ERRORS_HELP = "Full-KV store operations that failed, by kind (outage or refused)"
