"""The kvpress oracle: which tokens NVIDIA's kvpress keeps, per layer and KV head, on given tokens.

Runs in its own environment (kvpress pins transformers<5.3; ``scripts/setup_kvpress.sh`` makes
``.venv-kvpress``) and imports nothing from this project. The slow test
``tests/core/test_kvpress_oracle.py`` compares its answer with this project's compressors on the same
prompt. Presses that prune the cache are read back by matching the kept keys to the full prefill's
keys; presses that mask (AdaKV, KVzip) are read from the masked indices they leave on each layer.

    .venv-kvpress/bin/python benchmarks/kvpress_oracle.py --model DIR --tokens t.json --ratio 0.25 --out o.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache


def presses(kept: float) -> dict:
    from kvpress import (
        AdaKVPress,
        ExpectedAttentionPress,
        KnormPress,
        KVzipPress,
        PyramidKVPress,
        SnapKVPress,
        StreamingLLMPress,
        TOVAPress,
    )

    cr = 1.0 - kept
    return {
        "snapkv": SnapKVPress(compression_ratio=cr, window_size=64, kernel_size=5),
        "pyramidkv": PyramidKVPress(compression_ratio=cr, window_size=64, kernel_size=5, beta=20),
        "adakv": AdaKVPress(SnapKVPress(compression_ratio=cr, window_size=64, kernel_size=5), alpha_safeguard=0.2),
        "expected_attention": ExpectedAttentionPress(compression_ratio=cr),
        "tova": TOVAPress(compression_ratio=cr),
        "knorm": KnormPress(compression_ratio=cr),
        "streamingllm": StreamingLLMPress(compression_ratio=cr, n_sink=4),
        "kvzip": KVzipPress(compression_ratio=cr),
    }


def keys_of(cache: DynamicCache) -> list[torch.Tensor]:
    return [layer.keys[0] for layer in cache.layers]  # [kv_heads, tokens, head_dim]


def positions(full: torch.Tensor, kept: torch.Tensor) -> list[list[int]]:
    """Where each kept key row sits in the full keys, per head."""
    out = []
    for h in range(full.shape[0]):
        index = {row.numpy().tobytes(): i for i, row in enumerate(full[h])}
        out.append(sorted(index[row.numpy().tobytes()] for row in kept[h]))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--tokens", type=Path, required=True)
    p.add_argument("--ratio", type=float, default=0.25, help="kept fraction (kvpress's 1 - compression_ratio)")
    p.add_argument("--only", default="", help="comma-separated press names (default: all)")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = torch.tensor([json.loads(args.tokens.read_text())])
    n = ids.shape[1]
    with torch.no_grad():
        full_cache = DynamicCache()
        model(ids, past_key_values=full_cache)
        full = keys_of(full_cache)
        result: dict[str, object] = {"tokens": n, "ratio": args.ratio, "kept": {}}
        chosen = [x for x in args.only.split(",") if x]
        for name, press in presses(args.ratio).items():
            if chosen and name not in chosen:
                continue
            cache = DynamicCache()
            with press(model):
                model(ids, past_key_values=cache)
            layers = []
            for li, layer in enumerate(model.model.layers):
                masked = getattr(layer.self_attn, "masked_key_indices", None)
                if name in ("adakv", "kvzip"):
                    keep = torch.ones(full[li].shape[0], n, dtype=torch.bool)
                    if masked is not None:
                        _, heads, seqs = masked
                        keep[heads.cpu(), seqs.cpu()] = False
                    layers.append([torch.nonzero(keep[h]).squeeze(1).tolist() for h in range(keep.shape[0])])
                    layer.self_attn.masked_key_indices = None
                else:
                    layers.append(positions(full[li], keys_of(cache)[li]))
            result["kept"][name] = layers
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
