"""The worker's two kinds of forward pass, as SGLang ``ForwardBatch`` objects built the way 0.5.23's
own workers build them (``ForwardBatch.init_new`` from the scheduler's ``ScheduleBatch``, its
fields substituted for the pass and restored after).

- A **draft pass** (DECODE): one token per drafting request over the worker's private compressed
  pool (``draft.pool``): the request's private row, its kept length plus the drafts so far, a
  scratch slot to write into, and the token's true position (RoPE). A pass where some request
  feeds a prompt-lookup chain (``+lookup``) is a TARGET_VERIFY pass over the private pool
  instead (``chain``), the shorter chains padded into their own scratch slots.
- A **chain verification** (TARGET_VERIFY, SGLang's own convention as its NGRAM worker uses it:
  ``seq_lens`` the committed lengths, ``spec_info`` an ``NgramVerifyInput`` with
  ``draft_token_num = x + 1``): the seed and ``x`` drafts of each request, each token attending to
  the committed prefix and to the chain before it. Which backend computes it
  (``verify_convention``; any other backend is refused at launch):

  - ``flashinfer``, ``triton``, ``fa3`` (GPU, "masked"): the server's backend itself, reading a
    full custom mask (the prefix, then a lower triangle over the chain), as for NGRAM's trees.
    Unverified here: no GPU with sglang.
  - ``torch_native`` (CPU, "chain"): it has no speculative support, so the worker runs the pass
    through ``chain_attention.ChainVerifyTorchNative`` (torch_native with TARGET_VERIFY computed
    as a chain). Tested on CPU in real server processes.

  TARGET_VERIFY keeps the logits processor returning every chain position's logits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode

from vericache_sglang.sglang.config import verify_convention

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.model_runner import ModelRunner


@contextlib.contextmanager
def substituted(batch: ScheduleBatch, **fields: Any) -> Iterator[ScheduleBatch]:
    """``batch`` with ``fields`` replaced for the duration (the scheduler's isolation restores them
    after the whole step too; restoring here keeps the passes of one step from leaking)."""
    saved = {name: getattr(batch, name) for name in fields}
    for name, value in fields.items():
        setattr(batch, name, value)
    try:
        yield batch
    finally:
        for name, value in saved.items():
            setattr(batch, name, value)


class ForwardBuilder:
    def __init__(self, model_runner: ModelRunner, backend: str):
        self.model_runner = model_runner
        self.device = model_runner.device
        self.convention = verify_convention(backend)

    def _init_new(self, batch: ScheduleBatch) -> ForwardBatch:
        return ForwardBatch.init_new(
            batch, self.model_runner, capture_hidden_mode=CaptureHiddenMode.NULL, return_hidden_states_before_norm=False
        )

    def prefill(self, batch: ScheduleBatch) -> ForwardBatch:
        """The scheduler's EXTEND batch as SGLang's own worker would build it."""
        return ForwardBatch.init_new(batch, self.model_runner, return_hidden_states_before_norm=False)

    def draft(
        self,
        batch: ScheduleBatch,
        tokens: torch.Tensor,
        rows: torch.Tensor,
        seq_lens: torch.Tensor,
        out_cache_loc: torch.Tensor,
        positions: torch.Tensor,
    ) -> ForwardBatch:
        """One draft token per request: ``rows`` in the private pool, ``seq_lens`` kept + drafts so
        far + this one, written at ``out_cache_loc``, at true ``positions``."""
        seq_lens = seq_lens.to(device=self.device, dtype=torch.int32)
        seq_lens_cpu = seq_lens.cpu()
        with substituted(
            batch,
            forward_mode=ForwardMode.DECODE,
            input_ids=tokens,
            req_pool_indices=rows,
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            seq_lens_sum=int(seq_lens_cpu.sum()),
            orig_seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            spec_info=None,
            return_logprob=False,
        ):
            fb = self._init_new(batch)
        fb.positions = positions.to(device=self.device, dtype=fb.positions.dtype)
        return fb

    def stock_decode(self, batch: ScheduleBatch, seeds: torch.Tensor, out_cache_loc: torch.Tensor) -> ForwardBatch:
        """The DECODE batch a stock step would run now (its input token the seed, at the committed
        length): what SGLang's sampler reads to choose as that step would. Never run forward."""
        lens = (batch.seq_lens + 1).to(torch.int32)
        lens_cpu = lens.cpu()
        with substituted(
            batch,
            forward_mode=ForwardMode.DECODE,
            input_ids=seeds,
            seq_lens=lens,
            seq_lens_cpu=lens_cpu,
            seq_lens_sum=int(lens_cpu.sum()),
            orig_seq_lens=lens,
            out_cache_loc=out_cache_loc,
            spec_info=None,
        ):
            return self._init_new(batch)

    def verify(
        self,
        batch: ScheduleBatch,
        rows: torch.Tensor,
        chain: torch.Tensor,
        committed: torch.Tensor,
        slots: torch.Tensor,
    ) -> ForwardBatch:
        """The chains ``[n, width]`` of the requests at batch indices ``rows``, over the target pool:
        ``committed`` their committed lengths, ``slots`` ``[n, width]`` where the chain's K/V goes."""
        committed = committed.to(device=self.device, dtype=torch.int64)
        positions = committed[:, None] + torch.arange(chain.shape[1], device=self.device)[None]
        pool_rows = batch.req_pool_indices[rows.to(batch.req_pool_indices.device)]
        return self.chain(batch, pool_rows, chain, committed, slots, positions)

    def chain(
        self,
        batch: ScheduleBatch,
        pool_rows: torch.Tensor,
        chain: torch.Tensor,
        prefix_lens: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
    ) -> ForwardBatch:
        """A TARGET_VERIFY pass of chains ``[n, width]``, each over its pool row ``pool_rows[r]``'s
        first ``prefix_lens[r]`` tokens and the chain before it, written at ``slots`` ``[n, width]``,
        at true ``positions`` ``[n, width]``: the verification (target pool) and a lookup chain's
        check (the private draft pool, through a backend bound to it)."""
        from sglang.srt.speculative.ngram_info import NgramVerifyInput

        n, width = chain.shape
        prefix_lens = prefix_lens.to(device=self.device, dtype=torch.int64)
        spec = NgramVerifyInput(
            draft_token=chain.reshape(-1),
            custom_mask=self._chain_mask(prefix_lens, width),
            positions=positions.to(self.device).reshape(-1),
            retrieve_index=torch.arange(n * width, device=self.device).view(n, width),
            retrieve_next_token=torch.cat(
                [torch.arange(1, width, device=self.device), torch.tensor([-1], device=self.device)]
            ).repeat(n, 1),
            retrieve_next_sibling=torch.full((n, width), -1, device=self.device),
            draft_token_num=width,
            new_seq_lens=prefix_lens,
        )
        lens = prefix_lens.to(torch.int32)
        lens_cpu = lens.cpu()
        with substituted(
            batch,
            forward_mode=ForwardMode.TARGET_VERIFY,
            input_ids=chain.reshape(-1),
            req_pool_indices=pool_rows,
            seq_lens=lens,
            seq_lens_cpu=lens_cpu,
            seq_lens_sum=int(lens_cpu.sum()),
            orig_seq_lens=lens,
            out_cache_loc=slots.reshape(-1),
            spec_info=spec,
            return_logprob=False,
        ):
            return self._init_new(batch)

    def _chain_mask(self, committed: torch.Tensor, width: int) -> torch.Tensor | None:
        """NGRAM's full-mask layout for a chain: per request ``[width, committed + width]``, the
        whole prefix visible, then causal over the chain. Only the masked convention reads it."""
        if self.convention != "masked":
            return None
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril()
        return torch.cat(
            [
                torch.cat([torch.ones(width, int(c), dtype=torch.bool, device=self.device), causal], dim=1).reshape(-1)
                for c in committed.tolist()
            ]
        )
