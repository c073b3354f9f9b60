"""What the worker carries between SGLang steps and takes from a prefill.

- ``VeriCacheDraftInput``: each running request's seed (its last committed token, whose K/V the
  next verify pass writes), kept aligned with the batch as SGLang filters and merges it.
- ``QueryCapture``: the last prompt queries of each request in a prefill (SnapKV's observation
  window), read off the model's attention layers while the prefill runs; and a verify pass's
  queries, which choose the refreshed rows (``+refresh``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

from vericache_sglang.core.compress import Observation

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention

OBS_WINDOW = 64  # prefill queries kept per request for scoring compressors (SnapKV)


@dataclass
class VeriCacheDraftInput(SpecInput):
    """Carried between steps: each request's seed (last committed token, no KV yet)."""

    seeds: torch.Tensor

    def __post_init__(self) -> None:
        super().__init__(SpecInputType.EAGLE_DRAFT)  # a closed enum: reuse the draft-state type
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu: list[int] | None = None) -> None:
        self.seeds = self.seeds[new_indices]

    def merge_batch(self, other: VeriCacheDraftInput) -> None:
        self.seeds = torch.cat([self.seeds, other.seeds])


class QueryCapture:
    """Each attention layer's post-RoPE queries during a prefill, and each request's last
    ``OBS_WINDOW`` of them across its chunks (a chunked prompt's last chunk may be short)."""

    def __init__(self, model: torch.nn.Module, head_dim: int):
        from sglang.srt.layers.radix_attention import RadixAttention

        self.layers = [m for m in model.modules() if isinstance(m, RadixAttention)]
        self.head_dim = head_dim
        self.queries: list[torch.Tensor | None] = [None] * len(self.layers)  # this prefill's, flat
        self.tails: dict[str, list[torch.Tensor]] = {}  # rid -> its last queries per layer, flat

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        def hook(index: int):
            def fn(module: RadixAttention, args: tuple, kwargs: dict) -> None:
                q = args[0] if args else kwargs["q"]
                self.queries[index] = q.detach()

            return fn

        handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(self.layers)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def rows(self, start: int, n: int) -> list[torch.Tensor]:
        """This pass's queries of tokens ``[start, start + n)`` per layer, ``[q_heads, n, head_dim]``."""
        return [q[start : start + n].reshape(n, -1, self.head_dim).transpose(0, 1) for q in self.queries]

    def keep(self, rid: str, start: int, end: int) -> None:
        """Keep request ``rid``'s queries, this prefill's tokens ``[start, end)``, after its earlier ones."""
        lo = max(start, end - OBS_WINDOW)
        new = [q[lo:end] for q in self.queries]
        old = self.tails.get(rid)
        if old is not None and end - lo < OBS_WINDOW:
            new = [torch.cat([a, b])[-OBS_WINDOW:] for a, b in zip(old, new, strict=True)]
        self.tails[rid] = new

    def observation(self, rid: str, follows: bool = False) -> Observation:
        """The request's last queries as the core's observation (``follows``: see ``Observation``)."""
        tail = self.tails.pop(rid)
        return Observation(
            [q.view(q.shape[0], -1, self.head_dim).transpose(0, 1).float() for q in tail], follows=follows
        )

    def forget(self, rid: str) -> None:
        self.tails.pop(rid, None)

    def clear(self) -> None:
        """Drop this pass's queries (the kept tails stay)."""
        self.queries = [None] * len(self.layers)
