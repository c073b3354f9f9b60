"""A sampler whose draw depends only on (the user's seed, the absolute position, the logits).

Drafting, verification and plain full-KV decoding all call the same function with the same
noise, so with seeded sampling VeriCache commits exactly what full-KV sampling would: the
verifier's token at a position is the full-KV token there, whatever the request id, batch or
device. Sampling is Gumbel-max over the temperature-scaled, top-k/top-p-filtered logits, which is
an exact draw from the filtered softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1

# Independent noise streams at one position.
STREAM_TOKEN = 0  # the token drawn from a distribution (full-KV decoding, drafts, verifier)
STREAM_ACCEPT = 1  # rejection sampling: the accept/reject coin
STREAM_RESIDUAL = 2  # rejection sampling: the draw from the residual distribution
STREAM_DRAFT = 3  # rejection sampling: the drafter's own draw


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def noise_seed(seed: int, position: int, stream: int) -> int:
    return _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ position) ^ stream) >> 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params

    def processed_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Temperature-scaled float32 logits with tokens outside top-k / top-p set to -inf."""
        p = self.params
        x = logits.float() / (p.temperature if p.temperature > 0 else 1.0)
        if p.top_k and p.top_k < x.shape[-1]:
            kth = x.topk(p.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = x.sort(dim=-1, descending=True)
            cum = sorted_x.softmax(dim=-1).cumsum(dim=-1)
            # Drop a token once the mass before it already reaches top_p (the first always stays).
            drop_sorted = (cum - sorted_x.softmax(dim=-1)) >= p.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            x = x.masked_fill(drop, float("-inf"))
        return x

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        return self.processed_logits(logits).softmax(dim=-1)

    def gumbel(self, position: int, vocab: int, stream: int = STREAM_TOKEN) -> torch.Tensor:
        g = torch.Generator(device="cpu")
        g.manual_seed(noise_seed(self.params.seed, position, stream))
        u = torch.rand(vocab, generator=g, dtype=torch.float64).clamp_(1e-300, 1.0 - 1e-16)
        return (-torch.log(-torch.log(u))).float()

    def uniform(self, position: int, stream: int) -> float:
        g = torch.Generator(device="cpu")
        g.manual_seed(noise_seed(self.params.seed, position, stream))
        return torch.rand(1, generator=g, dtype=torch.float64).item()

    def sample(self, logits: torch.Tensor, positions: list[int], stream: int = STREAM_TOKEN) -> torch.Tensor:
        """One token per row of ``logits`` ``[n, vocab]``; row ``i`` is the token at ``positions[i]``."""
        if self.params.greedy:
            return logits.argmax(dim=-1)
        x = self.processed_logits(logits)
        noise = torch.stack([self.gumbel(pos, x.shape[-1], stream) for pos in positions]).to(x.device)
        return (x + noise).argmax(dim=-1)

    def sample_probs(self, probs: torch.Tensor, position: int, stream: int) -> int:
        """One draw from an explicit distribution ``[vocab]`` (rejection sampling's residual)."""
        noise = self.gumbel(position, probs.shape[-1], stream).to(probs.device)
        return int((probs.float().log() + noise).argmax())
