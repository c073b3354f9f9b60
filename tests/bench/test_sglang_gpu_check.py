"""The one-shot GPU check's parts that run without servers: its config (the GPU run and the CPU dry
run), the random model it draws from a tokenizer alone, how it compares answers with stock's, and
the bundle's wheel list (which must never carry what the GPU image already has), and the install
folder that gpu_check.sh completes (the plugin's entry points, the platform layer's .pth line)."""

from __future__ import annotations

from vericache_sglang.bench.common import REPO, load_config
from vericache_sglang.bench.sglang_gpu import _compare
from vericache_sglang.bench.sglang_server import PLATFORMS, Answer, launch_command


def test_the_gpu_run_and_its_dry_run_pick_their_platforms():
    gpu, dry = load_config("sglang_gpu"), load_config("sglang_gpu", quick=True)
    assert PLATFORMS[gpu["platform"]].name == "cuda" and gpu["dtype"] == "bfloat16"
    assert dry["platform"] == "cpu-triton" and ("TRITON_INTERPRET", "1") in PLATFORMS["cpu-triton"].env
    cmd = launch_command(1234, platform=PLATFORMS["cuda"], model="/m")
    assert cmd[cmd.index("--model-path") + 1] == "/m"
    assert cmd[cmd.index("--attention-backend") + 1] == "triton" and "--sampling-backend" in cmd
    for cfg in (gpu, dry):
        assert cfg["servers"][0] == "stock" and 0 < cfg["long_context"]["kv_budget"] < 1


def test_the_random_model_is_drawn_from_the_tokenizer_alone(tmp_path):
    from transformers import AutoConfig

    from vericache_sglang.engine.model import prepare_smollm2
    from vericache_sglang.engine.model_variants import random_model

    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok / name).write_bytes((prepare_smollm2(progress=False) / name).read_bytes())
    shape = load_config("sglang_gpu", quick=True)["model"]["shape"]
    a = random_model("llama", shape, tok, tmp_path / "a", seed=0)
    b = random_model("llama", shape, tok, tmp_path / "b", seed=0)
    config = AutoConfig.from_pretrained(a)
    assert config.vocab_size == 49152 and config.num_hidden_layers == shape["num_hidden_layers"]
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()  # same seed
    assert (a / "tokenizer.json").is_file()


def test_answers_are_compared_text_finish_and_logprobs():
    ref = [Answer("a b", "length", [-0.5, -1.0]), Answer("x", "stop")]
    assert _compare(ref, [Answer("a b", "length", [-0.5, -1.25]), Answer("x", "stop")]) == (2, 0.25)
    assert _compare(ref, [Answer("a c", "length"), Answer("x", "length")]) == (0, None)


def test_the_bundle_carries_nothing_the_gpu_image_has():
    lines = (REPO / "requirements" / "sglang-gpu-bundle.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    assert pins["sglang"] == "0.5.23"
    assert not {"torch", "triton", "transformers", "numpy", "tokenizers", "safetensors"} & set(pins)
    cpu = {
        line.split("==")[0]: line.split("==")[1].split()[0]
        for line in (REPO / "requirements" / "sglang-cpu.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    # the CPU server's tested versions wherever both carry a package
    assert {k: v for k, v in pins.items() if k in cpu} == {k: cpu[k] for k in pins if k in cpu}


def test_the_gpu_install_folder_carries_the_plugin_and_the_pth_line(tmp_path):
    import importlib.metadata

    from vericache_sglang.bench.gpu_site import write_site

    write_site(tmp_path)
    (dist,) = importlib.metadata.distributions(path=[str(tmp_path)])  # this folder alone
    plugins = {ep.name: ep.value for ep in dist.entry_points if ep.group == "sglang.srt.plugins"}
    assert plugins == {"vericache": "vericache_sglang.sglang.plugin:register"}
    line = (tmp_path / "vericache_sglang_cpu.pth").read_text()  # setup.py's PTH_NAME and PTH_LINE
    assert line.startswith("import os;") and "VERICACHE_TORCH_KERNELS" in line and ".install()" in line
    assert str(tmp_path) in (tmp_path / "sitecustomize.py").read_text()
