"""What a prefill saw, for the compressors that score by it: the observation window's queries and,
where the engine provides it, the model behind the prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from vericache_sglang.core.compress.rope import Rope


class ObservationSource(Protocol):
    """The model behind a prefill, for compressors that need more than the observation window.

    Implemented by the engine (``vericache_sglang.engine.observe``); the SGLang path has none, so
    compressors that need it are refused there at configuration time.
    """

    def prompt_queries(self) -> list[torch.Tensor]:
        """Post-RoPE queries ``[q_heads, tokens, head_dim]`` of every prompt token, per layer."""
        ...

    def tail_queries(self, n: int) -> list[torch.Tensor]:
        """Post-RoPE queries of the prompt's last ``n`` tokens, per layer."""
        ...

    @property
    def tokens(self) -> list[int]:
        """The prompt's token ids."""
        ...

    def rope(self) -> Rope:
        """The model's rotary embedding."""
        ...

    def probe(self, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Run ``tokens`` after the prompt over its exact KV (nothing is kept); per layer, their
        post-RoPE queries ``[q_heads, m, head_dim]`` and keys ``[kv_heads, m, head_dim]``."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens); raises ValueError without a tokenizer."""
        ...


@dataclass
class Observation:
    """What the prefill saw that a scoring compressor may use.

    ``queries[layer]`` holds the post-RoPE queries ``[q_heads, window, head_dim]`` of the last
    prompt tokens (SnapKV's observation window); ``source`` reaches the model for more. With
    ``follows`` the queries are of tokens *after* the KV being compressed (a shared prefix scored
    by the request that continues it): they see all of it, no causal mask applies within it.
    """

    queries: list[torch.Tensor] | None = None
    source: ObservationSource | None = None
    follows: bool = False

    def window_queries(self, layer: int, window: int) -> torch.Tensor:
        kept = 0 if self.queries is None else self.queries[layer].shape[1]
        if kept < window and self.source is not None:
            # The prefill computed fewer tokens than the window (a stored prefix was reused): the
            # model recomputes the queries of the prompt's last tokens.
            self.queries = self.source.tail_queries(window)
            kept = self.queries[layer].shape[1]
        if self.queries is None:
            raise ValueError("this compressor needs the prefill's observation queries")
        if kept < window:
            raise ValueError(f"observation window of {window} tokens asked, prefill kept {kept}")
        q = self.queries[layer]
        return q[:, kept - window :]

    def model(self, who: str) -> ObservationSource:
        if self.source is None:
            raise ValueError(
                f"{who} needs the model behind the prefill (prompt queries, rotary embedding), "
                "which this path does not provide"
            )
        return self.source
