"""SGLang's own seeded draw, for drafts and verification under ``--enable-deterministic-inference``.

Stock SGLang honours a request's ``seed`` only with deterministic inference; its sampler then draws
every token with ``multinomial_with_seed``: Gumbel noise from a MurmurHash3 of (seed, the input
token's position, the column), added to float64 log-probabilities. The draw is a function of the
logits, the seed and the position alone, which is what lossless speculative sampling needs: a
draft drawn with it from the compressed-KV logits is accepted exactly when the same draw from the
full-KV logits chooses it, so the committed tokens are stock's (``core.accept.greedy_accept``).

The path is stock's, in its order and precision (``sglang.srt.layers.sampler``): logits divided by
the temperature, ``torch.softmax``, then either ``sampling_from_probs_torch`` (no request of the
batch sets top-k, top-p or min-p) or ``top_k_top_p_min_p_sampling_from_probs_torch`` (full sort,
mask, the noise keyed by rank). Which one is a property of the whole batch in stock itself, so a
plain-temperature request's tokens depend on its batch there; ``BatchPath`` follows the batch the
worker runs, whose ``sampling_info`` is the one stock's sampler would read. An unseeded request
draws with SGLang's default seed 42, as in stock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vericache_sglang.core.sampling import STREAM_TOKEN, Sampler, SamplingParams

if TYPE_CHECKING:
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

DEFAULT_SEED = 42  # SamplingBatchInfo's seed for a request without one


class BatchPath:
    """Whether the running batch takes stock's sorted (top-k / top-p / min-p) path; set per step."""

    def __init__(self) -> None:
        self.sorted = False

    def follow(self, info: SamplingBatchInfo) -> None:
        self.sorted = bool(info.need_top_k_sampling or info.need_top_p_sampling or info.need_min_p_sampling)


class SGLangSeededSampler(Sampler):
    """The core's sampler interface over SGLang's seeded draw (token stream only: the draft and
    the verifier draw the same noise, so there is no separate draft stream to keep)."""

    def __init__(self, params: SamplingParams, top_k: int, top_p: float, path: BatchPath):
        super().__init__(params)
        self.top_k, self.top_p, self.path = top_k, top_p, path  # SGLang's values (top_k "all": TOP_K_ALL)

    def sample(self, logits: torch.Tensor, positions: list[int], stream: int = STREAM_TOKEN) -> torch.Tensor:
        """One token per row of ``logits`` ``[n, vocab]``; row ``i`` is the token at ``positions[i]``,
        keyed as stock keys it: by the position of the token it follows."""
        if stream != STREAM_TOKEN:
            raise ValueError("SGLang's seeded draw has one stream: rejection sampling does not apply to it")
        if self.params.greedy:
            return logits.argmax(dim=-1)
        from sglang.srt.layers.sampler import sampling_from_probs_torch, top_k_top_p_min_p_sampling_from_probs_torch

        n, device = logits.shape[0], logits.device
        temperature = torch.full((n, 1), self.params.temperature, dtype=torch.float32, device=device)
        probs = torch.softmax(logits.float() / temperature, dim=-1)
        seeds = torch.full((n,), self.params.seed, dtype=torch.int64, device=device)
        keys = torch.tensor(positions, dtype=torch.int64, device=device) - 1
        if not self.path.sorted:
            return sampling_from_probs_torch(probs, seeds, keys).to(torch.int64)
        ids = top_k_top_p_min_p_sampling_from_probs_torch(
            probs,
            torch.full((n,), self.top_k, dtype=torch.int32, device=device),
            torch.full((n,), self.top_p, dtype=torch.float32, device=device),
            torch.zeros((n,), dtype=torch.float32, device=device),
            False,
            seeds,
            keys,
        )
        return ids.to(torch.int64)
