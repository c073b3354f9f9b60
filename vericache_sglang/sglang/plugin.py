"""The ``sglang.srt.plugins`` entry point: registers VeriCache with SGLang in every process.

SGLang spawns its scheduler processes, so registrations made only in the launcher would be lost;
``load_plugins()`` runs this in each of them. Idempotent: a second call registers nothing twice.
"""

from __future__ import annotations

import logging

from vericache_sglang.sglang.hooks import ALGORITHM, BACKEND, register_hooks

logger = logging.getLogger(__name__)
_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    register_hooks()
    _register_attention_backend()
    _register_spec_algorithm()
    _register_radix_cache()
    _registered = True
    logger.info("VeriCache registered: --enable-vericache, speculative algorithm %s, backends %r", ALGORITHM, BACKEND)


def _register_attention_backend() -> None:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.server_args import (
        ATTENTION_BACKEND_CHOICES,
        DRAFT_ATTENTION_BACKEND_CHOICES,
        add_attention_backend_choices,
        add_draft_attention_backend_choices,
    )

    from vericache_sglang.sglang.cpu.chain_attention import NAME as CHAIN_BACKEND
    from vericache_sglang.sglang.cpu.chain_attention import create_chain_verify_backend
    from vericache_sglang.sglang.draft.attention import create_draft_backend

    # Choices must be extended before ServerArgs.add_cli_args builds a parser.
    for name in (BACKEND, CHAIN_BACKEND):
        if name not in ATTENTION_BACKEND_CHOICES:
            add_attention_backend_choices([name])
    if BACKEND not in DRAFT_ATTENTION_BACKEND_CHOICES:
        add_draft_attention_backend_choices([BACKEND])
    if BACKEND not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND)(create_draft_backend)
    if CHAIN_BACKEND not in ATTENTION_BACKENDS:
        register_attention_backend(CHAIN_BACKEND)(create_chain_verify_backend)


def _register_spec_algorithm() -> None:
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from vericache_sglang.sglang.spec_algo import VeriCacheSpecAlgo, validate_server_args, worker_factory

    if get_spec(ALGORITHM) is None:
        SpeculativeAlgorithm.register(
            ALGORITHM,
            supports_overlap=False,
            validate_server_args=validate_server_args,
            spec_class=VeriCacheSpecAlgo,
        )(worker_factory)


def _register_radix_cache() -> None:
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend

    from vericache_sglang.sglang.draft.radix_cache import create_radix_cache

    if get_radix_cache_factory(BACKEND) is None:
        register_radix_cache_backend(BACKEND, create_radix_cache)
