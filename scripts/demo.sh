#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M-Instruct, embedded memory:// store), in two
# phases: (1) one long request, VeriCache vs full-KV vs lossy decoding, identity checked token by
# token; (2) the case VeriCache is for, six long requests under a device-KV budget of two full KVs:
# full-KV resident, fetch-every-step offload and VeriCache side by side. Extra arguments go to
# phase 1's `vericache generate`; --json makes both phases print one JSON object each on stdout.
# Progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
json=()
for arg in "$@"; do [ "$arg" = "--json" ] && json=(--json); done

echo "== 1/2: one 3,823-token request, 128 new tokens: VeriCache, full-KV and lossy decoding" >&2
.venv/bin/vericache generate --prompt-file benchmarks/prompts/code.txt \
  --compressor snapkv:ratio=0.125 --horizon 16 --max-new-tokens 128 --check --lossy "$@"
cat >&2 <<'TEXT'
   On one request VeriCache is slower than full-KV decoding here: it drafts with the same model
   (a draft step costs a decode step's weights) and then verifies x+1 tokens in one pass, so per
   committed token it reads the weights about (x + 1) / accepted + 1 times instead of once; what
   it saves is device memory for KV, which a single request does not need. Its case is where
   that memory caps how many requests run at once and a batched step costs about the bytes it
   reads (HBM-bound GPU decoding). On these CPUs a batched step is bound by compute instead (the
   README's "What one batched step costs"), so below VeriCache keeps more requests running than
   full-KV resident decoding but does not beat it; it does beat fetching the full KV every step:
TEXT

echo "== 2/2: six long requests, device KV budget of 2 full KVs, full KV behind a link at 1/60 of memory" >&2
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
.venv/bin/vericache bench longctx --config benchmarks/configs/demo_batch.json --out "$out" "${json[@]}"
cat "$out/longctx.md" >&2  # the table (benchmarks/results/longctx.md holds the full sweep)
