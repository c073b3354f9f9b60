#!/usr/bin/env bash
# Build .gpu_bundle/ here for a lent GPU machine (x86_64, Python 3.12, no network): the wheels of
# requirements/sglang-gpu-bundle.txt for cp312 and SmolLM2's tokenizer files (the GPU check draws
# a random model's weights there). Carry it: run(carry=[".gpu_bundle"]). Fails if it outgrows
# what travels beside the working tree (64 MiB in all).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
out=.gpu_bundle
rm -rf "$out" && mkdir -p "$out/wheels" "$out/tokenizer"
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
  manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$out/wheels" -r requirements/sglang-gpu-bundle.txt
model=$("$PY" -m vericache_sglang.cli model 2>/dev/null)
for f in tokenizer.json tokenizer_config.json chat_template.jinja config.json; do
  [ -f "$model/$f" ] && cp "$model/$f" "$out/tokenizer/"
done
bytes=$(du -sb "$out" | cut -f1)
tree=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
echo "gpu bundle: $(ls "$out/wheels" | wc -l) wheels, $((bytes / 1048576)) MiB; with the tree $(((bytes + tree) / 1048576)) MiB of 64" >&2
[ $((bytes + tree)) -lt $((64 * 1048576)) ] || { echo "build_gpu_bundle: over 64 MiB with the tree" >&2; exit 1; }
