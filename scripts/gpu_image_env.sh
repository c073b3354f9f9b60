#!/usr/bin/env bash
# A Python 3.12 environment holding the lent GPU machines' package versions (the device tool's
# list of their image, 2026-11), for the GPU check's dry run here:
#   scripts/gpu_image_env.sh /tmp/imagevenv && scripts/build_gpu_bundle.sh
#   PYTHON=/tmp/imagevenv/bin/python bash scripts/gpu_check.sh --quick
# One exception: Triton 3.8 instead of the image's 3.6, whose interpreter cannot run SGLang's
# create_flashinfer_kv_indices_triton on CPU (on a GPU, 3.6 compiles it). About 5 GB (torch's CUDA
# build; it imports without a GPU).
set -euo pipefail
venv=${1:-/tmp/imagevenv}
py=${PYTHON312:-/root/.pyenv/versions/3.12.1/bin/python}
rm -rf "$venv"
"$py" -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q torch==2.11.0 torchvision==0.26.0 triton==3.6.0 transformers==5.17.0 numpy==2.5.2 \
  tokenizers==0.23.2 safetensors==0.8.0 huggingface_hub==1.33.0 sentencepiece==0.2.2 tiktoken==0.14.0 \
  aiohttp einops numba packaging pillow prometheus-client psutil python-dateutil regex requests scipy timm \
  tqdm uvloop xxhash httpx grpcio protobuf pyyaml jinja2 msgpack
"$venv/bin/pip" install -q --no-deps triton==3.8.0
"$venv/bin/python" -c "import torch, triton, transformers; print('image env:', torch.__version__, triton.__version__, transformers.__version__)"
