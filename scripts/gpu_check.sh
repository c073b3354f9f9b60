#!/usr/bin/env bash
# The one command on a lent GPU machine (torch and Triton; no sglang, nothing installable), with
# .gpu_bundle carried (scripts/build_gpu_bundle.sh, here):
#   bash scripts/gpu_check.sh                 # writes to $OUT, else benchmarks/results/gpu
# UNVERIFIED: never run on a GPU. Its dry run here, on a Python 3.12 holding the GPU image's
# packages (scripts/gpu_image_env.sh): PYTHON=/tmp/imagevenv/bin/python bash scripts/gpu_check.sh --quick
#
# Installs the bundle into a folder of its own (the image's python is itself a venv, whose packages
# a new venv could not see), completes it (vericache_sglang/bench/gpu_site.py: the platform
# layer's .pth line, processed at every start, and the project's entry points), puts it and this
# tree on PYTHONPATH, then runs `vericache bench sglang-gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
site=${GPU_SITE:-/tmp/vericache-gpu-site}
[ -d .gpu_bundle/wheels ] || { echo "gpu_check: no .gpu_bundle: run scripts/build_gpu_bundle.sh and carry it" >&2; exit 2; }
t0=$(date +%s)
rm -rf "$site" && mkdir -p "$site"
"$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$site" .gpu_bundle/wheels/*.whl
PYTHONPATH="$PWD" "$PY" -m vericache_sglang.bench.gpu_site "$site"
export PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# the wheel's Rust radix-tree core is built against torch 2.14.1 and panicked under the image's 2.11
export SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND=python
echo "gpu_check: bundle installed in $(($(date +%s) - t0)) s" >&2
exec "$PY" -m vericache_sglang.cli bench sglang-gpu --out "${OUT:-benchmarks/results/gpu}" "$@"
