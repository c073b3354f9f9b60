#!/usr/bin/env bash
# The project's GPU benchmark for a short lease on the device machine (no install there: the
# project runs from source). Writes gpu_bench.json and gpu_bench.md to $OUT. Usage on the lease:
#   benchmarks/gpu_bench.sh [--shape llama3-8b|qwen2.5-32b] [--minutes 5]
# and here, to check it: benchmarks/gpu_bench.sh --device cpu --quick --out /tmp/gpu_bench
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && [ -z "${OUT:-}" ] && PY=.venv/bin/python
exec "$PY" benchmarks/gpu_bench.py "$@"
