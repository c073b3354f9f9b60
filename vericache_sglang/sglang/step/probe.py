"""Probe forwards after a prompt in SGLang's own pool: the model behind a prefill, for the
compressors that ask it more than the observation window (KVzip's context reconstruction).

``PoolProbe`` is the core's ``ObservationSource`` for one request: ``probe(tokens)`` runs ``tokens``
after the request's first ``n`` prompt tokens as TARGET_VERIFY chains over its row of the target
pool (the passes the worker verifies with), their K/V written into slots lent for the probe and
mapped into the row past ``n``; the chains' post-RoPE queries are read off the attention layers,
their keys off the pool, and the slots and the row are given back. Nothing the request keeps
changes. A probe costs about one more prefill of the prompt (KVzip's price, in the engine too).

A probe needs ``len(tokens)`` free slots of the target pool and room in the row past the prompt;
without them ``ProbeUnavailable`` is raised and the request is verified one token a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from vericache_sglang.core.compress.rope import Rope
from vericache_sglang.sglang.step.draft_state import QueryCapture

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.model_executor.model_runner import ModelRunner

    from vericache_sglang.sglang.step.forward import ForwardBuilder
    from vericache_sglang.sglang.step.passes import Passes

# Tokens per probe pass: bounds the pass's logits, which TARGET_VERIFY returns for every token.
PROBE_TOKENS = 256


class ProbeUnavailable(RuntimeError):
    """No free slots, or no room in the request's row, for a probe this long."""


class PoolProbe:
    def __init__(
        self,
        runner: ModelRunner,
        forwards: ForwardBuilder,
        run: Callable[[ForwardBatch], torch.Tensor],
        encode: Callable[[str], list[int]],
        batch: ScheduleBatch,
        pool_row: int,
        tokens: list[int],
    ):
        self.runner, self.forwards, self.run, self._encode = runner, forwards, run, encode
        self.batch, self.pool_row, self._tokens = batch, pool_row, tokens

    @property
    def tokens(self) -> list[int]:
        return self._tokens

    def encode(self, text: str) -> list[int]:
        return self._encode(text)

    def probe(self, tokens: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the post-RoPE queries ``[q_heads, m, head_dim]`` and keys ``[kv_heads, m,
        head_dim]`` of ``tokens`` run after the prompt's first ``n`` tokens (positions ``n ..``)."""
        n, m = len(self._tokens), len(tokens)
        table = self.runner.req_to_token_pool.req_to_token
        if n + m > table.shape[1]:
            raise ProbeUnavailable(f"a {m}-token probe after {n} tokens passes the row's {table.shape[1]}")
        slots = self.runner.token_to_kv_pool_allocator.alloc(m)
        if slots is None:
            raise ProbeUnavailable(f"no {m} free KV slots for a probe")
        saved = table[self.pool_row, n : n + m].clone()
        table[self.pool_row, n : n + m] = slots.to(table.dtype)
        capture = QueryCapture(self.runner.model, self.runner.model_config.head_dim)
        queries: list[list[torch.Tensor]] = [[] for _ in capture.layers]
        device = self.runner.device
        row = torch.tensor([self.pool_row], dtype=torch.int64, device=device)
        try:
            for lo in range(0, m, PROBE_TOKENS):
                hi = min(m, lo + PROBE_TOKENS)
                chain = torch.tensor([tokens[lo:hi]], dtype=torch.int64, device=device)
                positions = torch.arange(n + lo, n + hi, device=device)[None]
                prefix = torch.tensor([n + lo], dtype=torch.int64, device=device)
                fb = self.forwards.chain(self.batch, row, chain, prefix, slots[None, lo:hi].to(device), positions)
                with capture.capturing():
                    self.run(fb)
                for layer, q in enumerate(capture.rows(0, hi - lo)):
                    queries[layer].append(q.float())
                capture.clear()
            pool = self.runner.token_to_kv_pool
            index = slots.to(device=device, dtype=torch.int64)
            return [
                (
                    torch.cat(q, dim=1),
                    pool.get_key_buffer(attn.layer_id)[index].transpose(0, 1).float(),
                )
                for q, attn in zip(queries, capture.layers, strict=True)
            ]
        finally:
            table[self.pool_row, n : n + m] = saved
            self.runner.token_to_kv_pool_allocator.free(slots)

    def prompt_queries(self) -> list[torch.Tensor]:
        raise ValueError("the SGLang worker's probe gives probe forwards only, not every prompt query")

    def tail_queries(self, n: int) -> list[torch.Tensor]:
        raise ValueError("the SGLang worker keeps the prefill's last queries in the observation window")

    def rope(self) -> Rope:
        raise ValueError("the SGLang worker's probe has no rotary embedding to give")


def pool_probes(
    passes: Passes, tokenizer: object | None, needs: frozenset[str]
) -> Callable[[ScheduleBatch, Req, list[int]], PoolProbe] | None:
    """What builds a request's ``PoolProbe``, run as ``passes`` verify (None when the compressor
    ``needs`` no probe); probes cue the model with text, so a server without its tokenizer refuses
    such a compressor."""
    if "probe" not in needs:
        return None
    if tokenizer is None:
        from vericache_sglang.sglang.config import VeriCacheConfigError

        raise VeriCacheConfigError(
            "the compressor probes the model with text cues (KVzip): the server needs its tokenizer "
            "(drop --skip-tokenizer-init)"
        )

    def encode(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]

    def build(batch: ScheduleBatch, req: Req, tokens: list[int]) -> PoolProbe:
        return PoolProbe(
            passes.model_runner, passes.forwards, passes.verify, encode, batch, int(req.kv.req_pool_idx), tokens
        )

    return build
