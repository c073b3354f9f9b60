"""KVzip (Kim et al., 2025): query-agnostic scores from context reconstruction. The model is asked
to repeat the prompt (``"\\n\\nRepeat the previous context exactly."`` then the prompt itself, in
chunks of ``chunk`` tokens, each later chunk cued by the previous chunk's last 8 tokens) over the
prompt's exact KV; a key's score is the largest attention any reconstruction query of its KV head
group paid it, the softmax taken over the sinks, the chunk and the reconstruction tokens.

Budgets: by default the kept count of each layer comes from one ranking of all layers' scores
(as KVzip and kvpress do); within a layer every KV head keeps the same count (this project's
rule; the paper lets heads differ too). ``layerwise=true`` gives every layer the same ratio.
Runs offline (extra forwards, about one more prefill); tokens committed later are appended.
Query-agnostic, so a shared document's compressed KV serves every request that reuses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from vericache_sglang.core.compress.base import DroppedLayer, KeepingDropper, check_ratio
from vericache_sglang.core.compress.drop.scoring import attention_probs, top_per_head
from vericache_sglang.core.compress.observation import Observation
from vericache_sglang.core.kv import CompressedKV, FullKV

FIRST_CUE = "\n\nRepeat the previous context exactly."
NEXT_CUE = "\n\nRepeat the part of the previous context exactly, starting with"
CUE_TAIL = 8  # tokens of the previous chunk that cue the next


@dataclass
class KVzipParams:
    """KVzip (Kim et al. 2025, arXiv:2505.23416): query-agnostic scores from context reconstruction.

    Parameters
    ----------
    ratio : float
        Kept fraction of the prompt's KV entries (tokens x KV heads x layers). By default the best
        ``ceil(ratio * n * kv_heads * layers)`` entries of all layers are chosen at once and each layer
        keeps, per KV head, its chosen count over ``kv_heads`` rounded up (at least 1, at most ``n``); with
        ``layerwise`` every layer keeps ``ceil(ratio * n)`` per head. In (0, 1]. kvpress's
        ``compression_ratio`` is ``1 - ratio``.
    n_sink : int
        First prompt tokens, always kept; every later chunk's reconstruction attends to them too. >= 0.
    chunk : int
        Prompt tokens reconstructed per probe forward, in tokens: ``ceil(n / chunk)`` probes. >= 1.
    layerwise : bool
        Give every layer the same ratio instead of choosing over all layers together.
    """

    ratio: float = 0.25
    n_sink: int = 4
    chunk: int = 2048
    layerwise: bool = False


class KVzip(KeepingDropper):
    name = "kvzip"
    mode = "offline"
    Params = KVzipParams
    summary = "context-reconstruction attention (query-agnostic); runs the model again over the prompt"
    document_scoring = "query-agnostic: attention while the model reconstructs the document"
    needs = frozenset({"probe"})
    uniform_layers = False  # per instance: True with ``layerwise``

    def validate(self) -> None:
        p = self.params
        check_ratio("kvzip", p.ratio)
        self.uniform_layers = bool(p.layerwise)
        if p.chunk < 1 or p.n_sink < 0:
            raise ValueError(f"kvzip: chunk must be >= 1 and n_sink >= 0, got {p.chunk}, {p.n_sink}")

    def scores(self, full: FullKV, obs: Observation | None) -> list[torch.Tensor]:
        """Per layer ``[kv_heads, n]`` reconstruction scores, sinks at +inf."""
        source = (obs or Observation()).model("kvzip")
        tokens, n = source.tokens, full.num_tokens
        if len(tokens) != n:
            raise ValueError(f"kvzip: the observation holds {len(tokens)} tokens, the KV {n}")
        out = [torch.zeros(k.shape[0], n, device=k.device) for k, _ in full.layers]
        for a in range(0, n, self.params.chunk):
            b = min(a + self.params.chunk, n)
            cue = source.encode(FIRST_CUE) if a == 0 else source.encode(NEXT_CUE) + tokens[max(0, a - CUE_TAIL) : a]
            probe = source.probe(cue + tokens[a:b])
            sink = min(self.params.n_sink, a)
            for layer, ((k, _), (pq, pk)) in enumerate(zip(full.layers, probe, strict=True)):
                keys = torch.cat([k[:, :sink], k[:, a:b], pk], dim=1)
                probs = attention_probs(pq, keys)[:, :, sink : sink + b - a]  # [hq, m, b - a]
                hk = k.shape[0]
                out[layer][:, a:b] = probs.amax(dim=1).view(hk, -1, b - a).amax(dim=1)
        for s in out:
            s[:, : self.params.n_sink] = float("inf")
        return out

    def compress(self, full: FullKV, obs: Observation | None = None) -> CompressedKV:
        n, layers = full.num_tokens, full.layout.num_layers
        hk = full.layout.num_kv_heads
        scores = self.scores(full, obs)
        keep_total = math.ceil(self.params.ratio * n * hk * layers)
        if self.params.layerwise or keep_total >= n * hk * layers:
            counts = [min(n, math.ceil(self.params.ratio * n))] * layers
        else:
            flat = torch.stack(scores).flatten()
            chosen = flat.topk(keep_total).indices // (hk * n)
            per_layer = torch.bincount(chosen, minlength=layers).tolist()
            counts = [min(n, max(1, math.ceil(c / hk))) for c in per_layer]
        out = [
            DroppedLayer.gather(k, v, top_per_head(s, c))
            for (k, v), s, c in zip(full.layers, scores, counts, strict=True)
        ]
        return CompressedKV(full.layout, self.base_spec, out)

    def compress_layer(self, layer_idx, k, v, obs: Observation | None) -> DroppedLayer:
        raise NotImplementedError("kvzip ranks all layers together: use compress()")
