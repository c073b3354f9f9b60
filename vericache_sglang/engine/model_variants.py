"""Small model directories on disk, for SGLang servers (which load models by path) and the engine:
SmolLM2 cut to its first layers, and random tiny models of the families users serve.

- ``smollm2_first_layers(n)``: SmolLM2-135M-Instruct's embedding, first ``n`` decoder layers, final
  norm and head, its real weights. Real token statistics at a fraction of the cost: what runs where
  every kernel is slow (SGLang's triton backend under Triton's interpreter).
- ``tiny_family(family)``: a randomly initialised two-layer model (fixed seed) of one architecture,
  with what sets it apart from Llama: Qwen2's QKV bias, Qwen3's q/k norm, Mistral's GQA, Llama 3's
  ``llama3`` RoPE scaling (biases and norm weights drawn at random too, so they count). The
  initialiser's scale is large so the next token is decided by clear margins, not by float rounding.

Both carry SmolLM2's tokenizer (the random families use its vocabulary size), so the servers take
the same prompts. Built once under the cache home, from the local SmolLM2 cache; nothing is fetched.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from vericache_sglang.engine.model import cache_home, prepare_smollm2

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# family: (transformers config class, model class, config fields beyond the shared tiny shape)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"use_sliding_window": False}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None, "num_key_value_heads": 1}),
    "llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 1024,
            },
        },
    ),
}


def _variants_home() -> Path:
    return cache_home() / "models" / "variants"


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)


def _publish(build: Path, target: Path) -> Path:
    # built in a temporary directory and renamed: a half-written model is never found
    if target.exists():
        shutil.rmtree(target)
    build.rename(target)
    return target


def smollm2_first_layers(num_layers: int) -> Path:
    """SmolLM2-135M-Instruct keeping only its first ``num_layers`` decoder layers."""
    target = _variants_home() / f"SmolLM2-135M-Instruct-{num_layers}L"
    if (target / "model.safetensors").is_file():
        return target
    from safetensors.torch import load_file, save_file

    src = prepare_smollm2(progress=False)
    config = json.loads((src / "config.json").read_text())
    if not 0 < num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"SmolLM2 has {config['num_hidden_layers']} layers; asked for {num_layers}")
    kept = {
        name: tensor
        for name, tensor in load_file(src / "model.safetensors").items()
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    target.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(dir=target.parent))
    save_file(kept, build / "model.safetensors", metadata={"format": "pt"})
    (build / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2))
    _copy_tokenizer(src, build)
    return _publish(build, target)


TINY_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "initializer_range": 0.5,
    "torch_dtype": "float32",
}


def tiny_family(family: str, seed: int = 0) -> Path:
    """A random two-layer model of ``family`` (one of ``FAMILIES``) with SmolLM2's tokenizer."""
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    target = _variants_home() / f"tiny-{family}-{seed}"
    if (target / "model.safetensors").is_file():
        return target
    return random_model(family, TINY_SHAPE, prepare_smollm2(progress=False), target, seed)


def random_model(family: str, shape: dict, tokenizer_dir: Path, target: Path, seed: int = 0) -> Path:
    """A randomly initialised model of ``family`` and ``shape`` (config fields) written to ``target``,
    with the tokenizer files of ``tokenizer_dir`` (whose ``config.json`` or ``tokenizer.json`` sets
    the vocabulary size unless ``shape`` does). Weights are drawn here from ``seed``, never fetched:
    the GPU check builds its model this way on a machine that holds only the tokenizer."""
    import transformers

    config_cls, model_cls, fields = {"llama": ("LlamaConfig", "LlamaForCausalLM", {}), **FAMILIES}[family]
    shape = {"vocab_size": _vocab_size(tokenizer_dir), **shape}
    config = getattr(transformers, config_cls)(**{**shape, **fields})
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    scale = shape.get("initializer_range", config.initializer_range)
    with torch.no_grad():  # biases start at zero and norms at one: random, so the family's own terms count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, scale)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    target.parent.mkdir(parents=True, exist_ok=True)
    build = Path(tempfile.mkdtemp(dir=target.parent))
    model.save_pretrained(build)
    _copy_tokenizer(tokenizer_dir, build)
    return _publish(build, target)


def _vocab_size(tokenizer_dir: Path) -> int:
    config = tokenizer_dir / "config.json"
    if config.is_file():
        return json.loads(config.read_text())["vocab_size"]
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    return len(vocab)
