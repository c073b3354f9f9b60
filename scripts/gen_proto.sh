#!/usr/bin/env bash
# Regenerate remote_store/proto/store_pb2*.py from store.proto. The generated files are committed.
# They are generated with grpcio-tools 1.76.0 (protobuf gencode 6.31), which loads under protobuf 6.x
# (the LMCache sidecar's environment) and 7.x (the main environment) alike; a newer protoc's gencode
# would refuse the sidecar's older runtime. The tool lives in its own throwaway venv.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${PROTO_VENV:-${TMPDIR:-/tmp}/vericache-proto-venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet grpcio-tools==1.76.0
fi
out=${1:-.}
"$venv/bin/python" -m grpc_tools.protoc -I. --python_out="$out" --grpc_python_out="$out" --pyi_out="$out" \
  remote_store/proto/store.proto
