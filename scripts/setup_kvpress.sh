#!/usr/bin/env bash
# The kvpress oracle's own environment (.venv-kvpress): kvpress pins transformers<5.3, which the main
# environment (transformers 5.19.0) cannot share, so it runs apart and is only an oracle for the slow
# faithfulness test (tests/core/test_kvpress_oracle.py), never a dependency. The oracle script runs from
# the checkout: .venv-kvpress/bin/python benchmarks/kvpress_oracle.py ...
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
[ -x .venv-kvpress/bin/python ] || "$PY" -m venv .venv-kvpress
stamp=.venv-kvpress/.installed-kvpress-0.5.5
if [ ! -f "$stamp" ]; then
  echo "setup: installing kvpress 0.5.5 (torch 2.13.0, transformers 5.2.0) into .venv-kvpress" >&2
  .venv-kvpress/bin/python -m pip install --quiet torch==2.13.0
  .venv-kvpress/bin/python -m pip install --quiet "transformers==5.2.0" accelerate "cachetools>=5.5.2,<6" "pandas>=2.2.2,<3" "datasets>=2.21" \
    safetensors numpy requests "fire<0.7" peft
  .venv-kvpress/bin/python -m pip install --quiet --no-deps kvpress==0.5.5
  touch "$stamp"
fi
