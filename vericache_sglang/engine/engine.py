"""The reference engine's Python API: a model, its runner and its full-KV store, behind one object."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from remote_store import ChunkError, StoreConfigError, StoreError, connect_store
from remote_store.link import LinkEmulator
from vericache_sglang.core.compress import Compressor, parse_spec
from vericache_sglang.engine.constraint import Constraint, ConstraintCompiler
from vericache_sglang.engine.decode import (
    GenerationConfig,
    GenerationResult,
    Prefill,
    generate_full,
    generate_lossy,
    generate_vericache,
)
from vericache_sglang.engine.hardware import memory_bandwidth, streaming_read_bandwidth
from vericache_sglang.engine.model import DEFAULT_MODEL, load_model
from vericache_sglang.engine.prefill import prefill
from vericache_sglang.engine.runner import ModelRunner
from vericache_sglang.full_kv.store import DEFAULT_CHUNK_TOKENS, FullKVStore

log = logging.getLogger(__name__)

METHODS = ("vericache", "full", "lossy")
# A decode step and a verify pass of up to 64 rows (horizon up to 63) run the same GEMM shapes.
BATCH_INVARIANT_ROWS = 64


class Engine:
    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        store: str = "memory://",
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        namespace: str = "default",
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        progress: bool = False,
        batch_invariant: bool | None = None,
    ):
        self.loaded = load_model(model, device=device, dtype=dtype, progress=progress)
        # On a GPU a verify pass must compute each row as a one-token decode step would; measured on
        # an H200 in bfloat16 (benchmarks/results/gpu/): without this, output drifts from full-KV
        # decoding; with it, 15/15 compressors bit-identical. CPU kernels here need none of it.
        if batch_invariant is None:
            batch_invariant = str(device).startswith("cuda")
        self.runner = ModelRunner(
            self.loaded, row_bucket=BATCH_INVARIANT_ROWS if batch_invariant else 0, row_attention=batch_invariant
        )
        self.tokenizer = self.loaded.tokenizer
        # a store that cannot be used as configured fails here, before anything runs on it
        backend = connect_store(store, memory_bandwidth=lambda: memory_bandwidth(str(self.runner.device)))
        self.store = FullKVStore(backend, self.runner.layout, namespace, chunk_tokens)
        self.progress = progress
        self._constraints: ConstraintCompiler | None = None

    def store_report(self) -> dict[str, object]:
        """The store URL and, behind a link emulator, the emulated link against the measured memory."""
        backend = self.store.backend
        report: dict[str, object] = {"url": backend.url.split("@")[-1]}
        if isinstance(backend, LinkEmulator):
            probe = streaming_read_bandwidth(str(self.runner.device))  # what the link was set against
            report.update(
                link_bandwidth_bytes_s=backend.bandwidth_bytes_s,
                link_ratio=backend.ratio,
                link_bytes_moved=backend.bytes_moved,
                link_transfer_s=round(backend.transfer_s, 4),
                memory_bandwidth_bytes_s=probe.bytes_s,
                memory_probe=probe.to_dict(),
            )
        return report

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = getattr(self.loaded.model.generation_config, "eos_token_id", None)
        if ids is None and self.tokenizer is not None:
            ids = self.tokenizer.eos_token_id
        if ids is None:
            return ()
        return tuple(ids) if isinstance(ids, list | tuple) else (int(ids),)

    def encode(self, prompt: str, chat: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.loaded.name} has no tokenizer: pass token ids")
        if chat and getattr(self.tokenizer, "chat_template", None):
            return list(
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
            )
        return list(self.tokenizer(prompt)["input_ids"])

    def prefill(self, tokens: Sequence[int], reuse_prefix: bool = True) -> Prefill:
        """Exact prefill; a prefix whose full KV is already in the store is loaded, not computed (and
        computed after all when the store cannot serve it: the prefill never depends on it)."""
        prefix = None
        if reuse_prefix:
            try:
                found = self.store.longest_prefix(tokens)
                if found:
                    prefix = self.store.load_prefix(tokens, found)
            except StoreConfigError:
                raise  # refused: never silently computed around
            except (StoreError, ChunkError) as e:
                log.warning("prefix reuse skipped, the store failed: %s", e)
                prefix = None
        return prefill(self.runner, tokens, progress=self.progress, prefix=prefix)

    def constraint(self, response_format: dict | None = None, *, grammar: object = None) -> Constraint:
        """A grammar for this model's tokenizer from an OpenAI ``response_format`` (or this project's
        regex / EBNF forms), or an xgrammar ``Grammar``; ConstraintError when it cannot be compiled."""
        if self._constraints is None:
            self._constraints = ConstraintCompiler(self.tokenizer, self.runner.vocab_size)
        if grammar is not None:
            return self._constraints.compile_grammar(grammar, "tool calls")
        return self._constraints.compile(response_format)

    def config(self, **kwargs: object) -> GenerationConfig:
        """A generation config with this model's EOS tokens filled in."""
        kwargs.setdefault("eos_token_ids", self.eos_token_ids)
        return GenerationConfig(**kwargs)

    def generate(
        self,
        pre: Prefill,
        method: str = "vericache",
        compressor: str | Compressor = "snapkv",
        cfg: GenerationConfig | None = None,
        **kwargs: object,
    ) -> GenerationResult:
        cfg = cfg or self.config()
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choices: {', '.join(METHODS)}")
        comp = parse_spec(compressor) if isinstance(compressor, str) else compressor
        if method == "full":
            return generate_full(self.runner, pre, cfg, self.tokenizer, **kwargs)
        if method == "lossy":
            return generate_lossy(self.runner, pre, comp, cfg, self.tokenizer, **kwargs)
        return generate_vericache(
            self.runner, pre, comp, self.store, cfg, self.tokenizer, progress=self.progress, **kwargs
        )


def compare(reference: GenerationResult, result: GenerationResult) -> dict[str, object]:
    """Token-by-token comparison against the reference, with the largest logit difference seen
    where both decoded the same context (up to and including the first mismatch)."""
    n = min(len(reference.tokens), len(result.tokens))
    mismatch = next((i for i in range(n) if reference.tokens[i] != result.tokens[i]), None)
    identical = mismatch is None and len(reference.tokens) == len(result.tokens)
    diff = None
    if reference.logits is not None and result.logits is not None:
        upto = n if mismatch is None else mismatch + 1
        diffs = [_finite_diff(a, b) for a, b in zip(reference.logits[:upto], result.logits[:upto], strict=True)]
        diff = max(diffs) if diffs else 0.0
    return {"identical": identical, "first_mismatch": mismatch, "compared_tokens": n, "max_logit_abs_diff": diff}


def _finite_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference of two logit rows where both are finite (a grammar masks the rest)."""
    both = torch.isfinite(a) & torch.isfinite(b)
    return float((a[both] - b[both]).abs().max()) if bool(both.any()) else 0.0
