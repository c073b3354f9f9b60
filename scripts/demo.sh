#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M-Instruct, embedded memory:// store): VeriCache vs
# full-KV decoding vs lossy decoding on a long real prompt. Extra arguments go to `vericache generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/vericache generate --prompt-file benchmarks/prompts/code.txt \
  --compressor snapkv:ratio=0.125 --horizon 16 --max-new-tokens 128 --check --lossy "$@"
