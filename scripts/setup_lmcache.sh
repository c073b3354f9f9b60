#!/usr/bin/env bash
# The LMCache sidecar's own environment (.venv-lmcache): LMCache 0.5.6 is built on torch 2.13.0, which
# cannot share the main environment's torch 2.14.1. The sidecar runs our code from the checkout:
#   PYTHONPATH=$PWD .venv-lmcache/bin/python -m remote_store.lmcache_sidecar --listen ... --remote-url redis://...
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv-lmcache/bin/python ]; then
  "$PY" -m venv .venv-lmcache
fi
stamp=.venv-lmcache/.installed-0.5.6
if [ ! -f "$stamp" ]; then
  echo "setup: installing LMCache 0.5.6 (CPU torch 2.13.0) into .venv-lmcache" >&2
  # torch first, so LMCache's resolver keeps the CPU build instead of pulling CUDA wheels
  .venv-lmcache/bin/python -m pip install --quiet torch==2.13.0
  .venv-lmcache/bin/python -m pip install --quiet lmcache==0.5.6 grpcio-health-checking==1.78.0
  touch "$stamp"
fi
