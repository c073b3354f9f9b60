#!/usr/bin/env bash
# For an operator with a CUDA GPU and `pip install .[sglang]` (sglang 0.5.23 with its CUDA
# dependencies). NOT RUN by this project: the same path runs on its CPUs in real SGLang servers
# (tests/sglang/test_sglang_e2e*.py, `vericache bench sglang`), but its lent GPU machines have no sglang
# and sgl_kernel's CUDA build (hundreds of MB) cannot travel to them. What this script measures
# (the GPU backends' masked TARGET_VERIFY, CUDA copies of full_kv=host, bf16 exactness under
# deterministic inference) is therefore UNVERIFIED until an operator runs it.
#
# What it does, on one GPU:
#   1. the reference: stock SGLang greedy decoding with --enable-deterministic-inference (triton
#      attention, batch-invariant ops), on the project's three real prompts;
#   2. the same server with --enable-vericache (compressed-KV drafting, TARGET_VERIFY on the full
#      KV) and the same deterministic flags, the full KV kept on the GPU (full_kv=device);
#   3. again with full_kv=host: each request's own KV in SGLang's host pool between
#      verifications, reloaded per layer for them (--page-size 1);
#   4. compares the outputs token by token with the reference (exactness: every token identical)
#      and reports the time of each, side by side in one run.
#
# Usage: benchmarks/sglang_gpu.sh [MODEL_PATH] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-$HOME/.cache/vericache/models/SmolLM2-135M-Instruct}
OUT=${2:-benchmarks/results/sglang_gpu}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
command -v nvidia-smi >/dev/null || { echo "sglang_gpu.sh: needs a CUDA GPU" >&2; exit 2; }
"$PY" -c 'import sglang, flashinfer' 2>/dev/null || { echo "sglang_gpu.sh: needs pip install .[sglang]" >&2; exit 2; }

COMMON=(--model-path "$MODEL" --enable-deterministic-inference --attention-backend triton
        --cuda-graph-backend-decode disabled --disable-overlap-schedule --mem-fraction-static 0.6)
VC_CONFIG='{"compressor": "snapkv:ratio=0.125", "horizon": 16, "full_kv": "device"}'
VC_HOST_CONFIG='{"compressor": "snapkv:ratio=0.125", "horizon": 16, "full_kv": "host", "reload_room": 0.25}'

serve() {  # name port extra-args...
  local name=$1 port=$2; shift 2
  "$PY" -m sglang.launch_server "${COMMON[@]}" --port "$port" "$@" >"$OUT/$name.server.log" 2>&1 &
  echo $! >"$OUT/$name.pid"
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && return 0
    sleep 1
  done
  echo "server $name did not come up; see $OUT/$name.server.log" >&2
  return 1
}
stop() { kill "$(cat "$OUT/$1.pid")" 2>/dev/null || true; wait "$(cat "$OUT/$1.pid")" 2>/dev/null || true; }

run_prompts() {  # name port
  "$PY" - "$1" "$2" "$OUT" <<'EOF'
import json, sys, time, urllib.request
from pathlib import Path
name, port, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
rows = []
for kind in ("code", "prose", "tools"):
    text = Path(f"benchmarks/prompts/{kind}.txt").read_text()
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 256}, "return_logprob": False}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.monotonic()
    res = json.loads(urllib.request.urlopen(req, timeout=3600).read())
    rows.append({"prompt": kind, "seconds": time.monotonic() - t0, "output_ids": res.get("output_ids"),
                 "text": res["text"], "meta": res.get("meta_info", {})})
(out / f"{name}.json").write_text(json.dumps(rows, indent=1))
EOF
}

serve reference 30100
run_prompts reference 30100
stop reference
serve vericache 30101 --enable-vericache --vericache-config "$VC_CONFIG"
run_prompts vericache 30101
stop vericache
serve vericache_host 30102 --enable-vericache --page-size 1 --vericache-config "$VC_HOST_CONFIG"
run_prompts vericache_host 30102
stop vericache_host

"$PY" - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
runs = ("vericache", "vericache_host")
ref = json.loads((out / "reference.json").read_text())
got = {n: json.loads((out / f"{n}.json").read_text()) for n in runs}
lines = ["| prompt | reference s | " + " | ".join(f"{n} identical | first difference | {n} s" for n in runs) + " |",
         "|---|---:|" + "---|---:|---:|" * len(runs)]
for i, r in enumerate(ref):
    cells = [r["prompt"], f"{r['seconds']:.2f}"]
    for n in runs:
        v = got[n][i]
        a, b = r["output_ids"] or r["text"], v["output_ids"] or v["text"]
        first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
        cells += [str(first is None), "-" if first is None else str(first), f"{v['seconds']:.2f}"]
    lines.append("| " + " | ".join(cells) + " |")
(out / "summary.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
