#!/usr/bin/env bash
# docker-compose.yml's cpu profile on loopback, without Docker: redis-server, the LMCache sidecar, our
# gRPC store, two VeriCache servers sharing it, and the RAG client (deploy/cluster.py reads the
# compose file; nothing here repeats it). `deploy/local_cluster.sh up --exit-after-client` runs the
# demo once and stops; `up` alone keeps the cluster serving until Ctrl-C; `plan` prints the commands.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >&2
if [[ " $* " != *" --without lmcache "* ]]; then ./scripts/setup_lmcache.sh >&2; fi
exec .venv/bin/python deploy/cluster.py "$@"
