"""The model behind a prefill, for compressors that score with more than the observation window:
every prompt query (recomputed on first use), the rotary embedding, and probe forwards after the
prompt (KVzip's reconstruction). Nothing here changes the prefill's KV."""

from __future__ import annotations

import torch

from vericache_sglang.core.compress.rope import Rope
from vericache_sglang.core.kv import FullKV
from vericache_sglang.engine.runner import ModelRunner, ResidentKV, Segment


class RunnerObservation:
    def __init__(self, runner: ModelRunner, tokens: list[int], kv: FullKV, chunk: int = 512):
        self.runner, self._tokens, self.kv, self.chunk = runner, tokens, kv, chunk
        self._queries: list[torch.Tensor] | None = None

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def prompt_queries(self) -> list[torch.Tensor]:
        if self._queries is None:
            ctx = ResidentKV(self.runner.layout, len(self._tokens), self.runner.device)
            parts: list[list[torch.Tensor]] = [[] for _ in range(self.runner.layout.num_layers)]
            for a in range(0, len(self._tokens), self.chunk):
                b = min(a + self.chunk, len(self._tokens))
                out = self.runner.forward(
                    [Segment(self._tokens[a:b], list(range(a, b)), ctx, logits="none", keep_queries=b - a)]
                )[0]
                for layer, q in enumerate(out.queries):
                    parts[layer].append(q)
            self._queries = [torch.cat(p, dim=1) for p in parts]
        return self._queries

    def tail_queries(self, n: int) -> list[torch.Tensor]:
        n = min(n, len(self._tokens))
        if self._queries is not None:
            return [q[:, -n:] for q in self._queries]
        start = len(self._tokens) - n
        ctx = ResidentKV.from_full(self.kv.slice(0, start), len(self._tokens), self.runner.device)
        out = self.runner.forward(
            [Segment(self._tokens[start:], list(range(start, len(self._tokens))), ctx, logits="none", keep_queries=n)]
        )[0]
        return out.queries

    def rope(self) -> Rope:
        rotary = self.runner.rotary
        return Rope(rotary.inv_freq.detach().float().clone(), float(getattr(rotary, "attention_scaling", 1.0)))

    def probe(self, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        n = self.kv.num_tokens
        ctx = ResidentKV.from_full(self.kv, n + len(tokens), self.runner.device)
        out = self.runner.forward(
            [Segment(tokens, list(range(n, n + len(tokens))), ctx, logits="none", keep_queries=len(tokens))]
        )[0]
        return [(q, k) for q, (k, _) in zip(out.queries, out.kv, strict=True)]

    def encode(self, text: str) -> list[int]:
        tokenizer = self.runner.loaded.tokenizer
        if tokenizer is None:
            raise ValueError(f"model {self.runner.loaded.name} has no tokenizer: this compressor needs one")
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
