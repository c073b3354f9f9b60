#!/usr/bin/env bash
# The test suite (CI runs exactly this): unit tests on a tiny random Llama, the real-model set on
# SmolLM2, kernel tests in the Triton interpreter, SGLang server processes on this CPU, the stores
# (a redis-server and our store server are started by the tests unless CI's are given) and the
# LMCache sidecar in its own environment. Extra arguments go to pytest (e.g. -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
./scripts/setup_lmcache.sh  # LMCache 0.5.6 in .venv-lmcache: without it its tests would skip
# OpenMP workers that spin while they wait starve another process's (an SGLang server beside
# stock, a CLI beside the engine) on two cores; passive waiting costs nothing alone
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec .venv/bin/python -m pytest "$@"
