"""The worker's forward passes, run on SGLang's model runner through the attention backend each one
reads (``forward.py`` builds their ``ForwardBatch``; this module runs them):

- a **draft pass** over the private compressed pool (DECODE, through the draft backend), and a
  lookup chain's check over it (TARGET_VERIFY); with the full KV offloaded each is an iteration of
  the reload plan (``FullKVOffload.draft_pass``), timed;
- the **verification** (TARGET_VERIFY over the target pool: the server's own backend where it reads
  SGLang's chain mask, the plugin's chain backend on torch_native);
- the **recompute** of a full KV the store did not deliver: chain passes over the request's
  committed tokens, writing their K/V into the slots lent to its row;
- **SGLang's own sample** at the seed position, as a stock decode step would draw it.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

import torch
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

from vericache_sglang.sglang.config import check_layer_budgets
from vericache_sglang.sglang.cpu.chain_attention import NAME as CHAIN_BACKEND
from vericache_sglang.sglang.draft.attention import create_draft_backend, pools_bound
from vericache_sglang.sglang.draft.layer_rows import LayerRowsBackend

if TYPE_CHECKING:
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.tp_worker import TpModelWorker
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from vericache_sglang.sglang.draft.pool import CompressedDraftPool
    from vericache_sglang.sglang.full_kv.offload import FullKVOffload
    from vericache_sglang.sglang.step.forward import ForwardBuilder

# Tokens per recompute pass: bounds the pass's logits, which TARGET_VERIFY returns for every token.
RECOMPUTE_TOKENS = 256


class Passes:
    def __init__(
        self,
        target_worker: TpModelWorker,
        forwards: ForwardBuilder,
        draft_pool: CompressedDraftPool,
        lookup: bool,
        offload: FullKVOffload | None,
    ):
        runner = target_worker.model_runner
        self.target_worker = target_worker
        self.model_runner = runner
        self.forwards = forwards
        self.offload = offload
        # TARGET_VERIFY forwards by the attention backend class that ran them (the metrics drain
        # it): which path verified, as run, not as configured
        self.target_verify_forwards: collections.Counter[str] = collections.Counter()
        draft_pool.pools.inner_backend = runner.decode_attention_backend_str  # drafting is decoding
        check_layer_budgets(draft_pool.compressor, draft_pool.pools.inner_backend)
        self.draft_backend = create_draft_backend(runner)
        # the server's backend verifies where it reads SGLang's chain mask; torch_native cannot
        self.verify_backend: AttentionBackend | None = None
        if forwards.convention == "chain":
            self.verify_backend = ATTENTION_BACKENDS[CHAIN_BACKEND](runner)
        # a lookup chain's check: a TARGET_VERIFY pass over the private pool (on a GPU the draft
        # backend's own masked TARGET_VERIFY: unverified, no GPU with sglang here)
        self.draft_chain_backend = self.draft_backend
        if lookup and forwards.convention == "chain":
            with pools_bound(runner, draft_pool.pools):
                self.draft_chain_backend = ATTENTION_BACKENDS[CHAIN_BACKEND](runner)
        if draft_pool.per_layer:  # each layer reads its own kept count
            rows = LayerRowsBackend(self.draft_backend, draft_pool)
            self.draft_backend = rows
            self.draft_chain_backend = LayerRowsBackend(self.draft_chain_backend, draft_pool, rows.table)

    @contextlib.contextmanager
    def using(self, backend: AttentionBackend | None, fb: ForwardBatch) -> Iterator[None]:
        """Run a forward of ``fb`` through ``backend`` (None: the runner's own)."""
        if backend is None:
            yield
            return
        saved = self.model_runner.attn_backend
        self.model_runner.attn_backend = backend
        try:
            with forward_context(ForwardContext(attn_backend=backend), forward_batch=fb):
                yield
        finally:
            self.model_runner.attn_backend = saved

    def draft(self, fb: ForwardBatch) -> torch.Tensor:
        """One draft pass (DECODE over the private pool): each request's next-token logits."""
        return self._timed(partial(self._draft, fb))

    def chain(self, fb: ForwardBatch) -> torch.Tensor:
        """A TARGET_VERIFY pass over the private pool (lookup chains): every row's logits."""
        return self._timed(partial(self._target_verify, self.draft_chain_backend, fb))

    def verify(self, fb: ForwardBatch) -> torch.Tensor:
        """The chain verification over the target pool: every chain position's logits."""
        return self._target_verify(self.verify_backend, fb)

    def recompute(self, batch: ScheduleBatch, committed: torch.Tensor, i: int, start: int, slots: torch.Tensor) -> None:
        """Batch index ``i``'s full KV of positions from ``start`` into ``slots`` (lent to its row),
        from its committed tokens, each chunk attending to the prefix and itself as a prefill
        would. Exact: the K/V of the same tokens over the same prefix."""
        req = batch.reqs[i]
        tokens = [*req.origin_input_ids, *req.output_ids][: int(committed[i])]
        n = int(slots.numel())
        if start + n > len(tokens):
            raise RuntimeError(f"request {req.rid}: positions up to {start + n} to recompute, {len(tokens)} known")
        device = self.model_runner.device
        row = torch.tensor([i], dtype=torch.int64, device=device)
        for lo in range(0, n, RECOMPUTE_TOKENS):
            hi = min(n, lo + RECOMPUTE_TOKENS)
            chain = torch.tensor([tokens[start + lo : start + hi]], dtype=torch.int64, device=device)
            at = torch.tensor([start + lo], dtype=torch.int64, device=device)
            self.verify(self.forwards.verify(batch, row, chain, at, slots[None, lo:hi].to(device)))

    def own_tokens(
        self, batch: ScheduleBatch, seed_logits: torch.Tensor, slots: torch.Tensor
    ) -> tuple[torch.Tensor, LogitsProcessorOutput]:
        """SGLang's own choice at every request's seed position: its sampler over the full-KV logits
        there (penalties, logit_bias, min_p, grammar masks, its seeded draws, logprobs), as a stock
        decode step, whose input token is the seed, makes it."""
        fb = self.forwards.stock_decode(batch, batch.spec_info.seeds.to(self.model_runner.device), slots[:, 0])
        out = LogitsProcessorOutput(next_token_logits=seed_logits.clone())
        return self.model_runner.sample(out, fb), out

    def drain_target_verify_forwards(self) -> dict[str, int]:
        """TARGET_VERIFY forwards by backend class since the last call."""
        counts, self.target_verify_forwards = dict(self.target_verify_forwards), collections.Counter()
        return counts

    def _timed(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        return run() if self.offload is None else self.offload.draft_pass(run)

    def _draft(self, fb: ForwardBatch) -> torch.Tensor:
        with self.using(self.draft_backend, fb):
            return self.model_runner.forward(fb).logits_output.next_token_logits

    def _target_verify(self, backend: AttentionBackend | None, fb: ForwardBatch) -> torch.Tensor:
        with self.using(backend, fb):
            ran = type(self.model_runner.attn_backend).__name__
            out = self.target_worker.forward_batch_generation(batch=None, forward_batch=fb, is_verify=True)
        self.target_verify_forwards[ran] += 1
        return out.logits_output.next_token_logits
