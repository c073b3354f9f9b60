#!/usr/bin/env bash
# The test suite (CI runs exactly this): unit tests on a tiny random Llama, the real-model set on
# SmolLM2, kernel tests in the Triton interpreter. Extra arguments go to pytest (e.g. -m slow).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/python -m pytest "$@"
