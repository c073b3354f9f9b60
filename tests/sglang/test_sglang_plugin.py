"""The SGLang plugin against the real sglang 0.5.23 package (CPU: registration, flags, resolution).

SGLang cannot run a model on this CPU (see README, "SGLang integration"); what it can do without a
GPU is parse, resolve and register, and that is what these tests drive, through SGLang's own entry
points (``load_plugins``, ``prepare_server_args``, ``resolve_once``, the registries).
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import pytest

pytest.importorskip("sglang.srt.server_args", reason="sglang is not installed (scripts/setup.sh installs it)")

from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args

from vericache_sglang.engine.model import smollm2_dir
from vericache_sglang.sglang.config import VeriCacheConfig, VeriCacheConfigError
from vericache_sglang.sglang.hooks import config_of

load_plugins()  # what launch_server and every scheduler process do first


def _model_path() -> str:
    path = smollm2_dir()
    if not (path / "config.json").exists():
        pytest.skip("SmolLM2 is not prepared (scripts/setup.sh)")
    return str(path)


def _argv(*extra: str, config: dict | None = None) -> list[str]:
    argv = ["--model-path", _model_path(), "--device", "cpu", "--enable-vericache"]
    if config is not None:
        argv += ["--vericache-config", json.dumps(config)]
    return argv + list(extra)


def test_entry_point_is_discovered():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get("vericache") == "vericache_sglang.sglang.plugin:register"
    from vericache_sglang.sglang import plugin

    assert plugin._registered, "load_plugins() did not run the vericache entry point"


def test_flags_parse_resolve_and_imply_settings():
    sa = prepare_server_args(
        _argv(config={"compressor": "streamingllm:sink=4,window=256", "horizon": 8, "store": "memory://"})
    )
    cfg = config_of(sa)
    assert cfg == VeriCacheConfig(compressor="streamingllm:sink=4,window=256", horizon=8, store="memory://")
    assert sa.speculative_algorithm == "VERICACHE"
    assert sa.speculative_num_draft_tokens == 9 and sa.speculative_num_steps == 8
    assert sa.speculative_eagle_topk == 1
    assert sa.radix_cache_backend == "vericache"
    assert sa.disable_overlap_schedule is True
    sa.resolve_once()
    from sglang.srt.arg_groups.overrides import resolving_view

    view = resolving_view(sa)
    assert view.speculative_algorithm == "VERICACHE"
    assert view.speculative_num_draft_tokens == 9
    assert config_of(view) == cfg


def test_config_survives_pickling_to_a_subprocess():
    sa = prepare_server_args(
        _argv(config={"compressor": "snapkv:ratio=0.125", "horizon": 12, "verification": "rejection"})
    )
    sa.resolve_once()
    child = (
        "import pickle, sys\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "from sglang.srt.speculative.spec_info import SpeculativeAlgorithm\n"
        "from vericache_sglang.sglang.hooks import config_of\n"
        "sa = pickle.load(sys.stdin.buffer)\n"
        "algo = SpeculativeAlgorithm.from_string(sa.speculative_algorithm)\n"
        "print(config_of(sa).to_json()); print(type(algo).__name__, algo.need_topk())\n"
    )
    out = subprocess.run([sys.executable, "-c", child], input=pickle.dumps(sa), capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    lines = out.stdout.decode().strip().splitlines()
    assert json.loads(lines[-2]) == config_of(sa).to_dict()
    assert json.loads(lines[-2])["verification"] == "rejection"
    assert lines[-1] == "VeriCacheSpecAlgo False"
    assert sa.speculative_use_rejection_sampling is True


@pytest.mark.parametrize(
    ("config", "extra", "message"),
    [
        ({"compressor": "h3o"}, (), "unknown compressor 'h3o'"),
        ({"compressor": "quest"}, (), "is a sparse compressor"),
        ({"compressor": "kvquant:bits=4"}, (), "it needs rope from the model"),
        ({"horizon": 0}, (), "horizon must be in"),
        ({"full_kv": "disk"}, (), "full_kv must be one of"),
        ({"verification": "greedy"}, (), "'greedy' is now 'exact'"),
        ({"verification": "rejection"}, ("--enable-deterministic-inference",), "draws its own noise"),
        ({"store": "ftp://x"}, (), "store scheme 'ftp'"),
        ({"horizn": 8}, (), "unknown keys ['horizn']"),
        ({}, ("--tp-size", "2"), "tensor parallelism"),
        ({}, ("--enable-lora",), "LoRA"),
        ({}, ("--speculative-algorithm", "EAGLE"), "--speculative-algorithm 'EAGLE' was given"),
        ({"horizon": 8}, ("--speculative-num-draft-tokens", "4"), "--speculative-num-draft-tokens 4 was given"),
        ({}, ("--radix-cache-backend", "flexkv"), "--radix-cache-backend 'flexkv' was given"),
        ({"full_kv": "host"}, ("--page-size", "16"), "--page-size > 1 with full_kv=host"),
        ({"full_kv": "host"}, ("--disaggregation-mode", "decode"), "disaggregation with full_kv=host"),
        ({"full_kv": "store"}, ("--page-size", "16"), "--page-size > 1 with full_kv=store"),
        ({"full_kv": "host", "reload_room": 1.5}, (), "reload_room must be a number in (0.0, 1.0)"),
        ({"full_kv": "host", "host_pool_ratio": 0}, (), "host_pool_ratio must be a number in (0.0, inf)"),
    ],
)
def test_contradictory_or_unsupported_settings_are_clear_errors(config, extra, message):
    with pytest.raises(VeriCacheConfigError) as err:
        prepare_server_args(_argv(*extra, config=config))
    assert message in str(err.value)


def test_a_store_behind_an_emulated_link_passes_the_launch_check(store_url):
    """The launcher opens the store (``?link_ratio=R`` included) without measuring a device: each
    scheduler sets the emulated link against its own device's memory bandwidth."""
    sa = prepare_server_args(_argv(config={"full_kv": "store", "store": f"{store_url}?link_ratio=60"}))
    assert config_of(sa).store.endswith("?link_ratio=60")


def test_probing_compressors_are_served_with_a_tokenizer_only():
    """KVzip's probes run in the pool (``step/probe.py``); they cue the model with text."""
    from vericache_sglang.sglang.step.probe import pool_probes

    spec = "kvzip:ratio=0.3,layerwise=true+kivi:bits=4"
    assert VeriCacheConfig(compressor=spec).compressor.startswith("kvzip:")
    needs = frozenset({"probe"})
    assert pool_probes(object(), object(), frozenset({"window"})) is None
    assert callable(pool_probes(object(), object(), needs))
    with pytest.raises(VeriCacheConfigError, match="needs its tokenizer"):
        pool_probes(object(), None, needs)


def test_per_layer_budgets_draft_through_backends_that_read_rows_per_layer():
    """``draft/layer_rows.py`` swaps each layer's row per call: the masked backends precompute theirs."""
    from vericache_sglang.core.compress import parse_spec
    from vericache_sglang.sglang.config import check_layer_budgets

    for spec in ("pyramidkv:ratio=0.3+kivi:bits=4", "kvzip:ratio=0.3", "adakv:ratio=0.3"):
        assert VeriCacheConfig(compressor=spec).compressor.split(":")[0] == spec.split(":")[0]
        check_layer_budgets(parse_spec(spec), "torch_native")
        with pytest.raises(VeriCacheConfigError, match="different token counts per layer"):
            check_layer_budgets(parse_spec(spec), "triton")
    check_layer_budgets(parse_spec("kvzip:ratio=0.3,layerwise=true"), "triton")


def test_config_without_enable_flag_and_bad_json_are_errors():
    with pytest.raises(VeriCacheConfigError, match="without --enable-vericache"):
        prepare_server_args(["--model-path", _model_path(), "--vericache-config", "{}"])
    with pytest.raises(VeriCacheConfigError, match="not valid JSON"):
        prepare_server_args(_argv("--vericache-config", "{horizon: 8"))


def test_config_from_file(tmp_path):
    path = tmp_path / "vc.json"
    path.write_text(json.dumps({"horizon": 32, "compressor": "snapkv"}))
    sa = prepare_server_args(
        ["--model-path", _model_path(), "--device", "cpu", "--enable-vericache", "--vericache-config", f"@{path}"]
    )
    assert config_of(sa).horizon == 32 and sa.speculative_num_draft_tokens == 33
    with pytest.raises(VeriCacheConfigError, match="No such file"):
        VeriCacheConfig.parse(f"@{tmp_path / 'missing.json'}")


def test_speculative_algorithm_without_the_flag_is_refused():
    sa = prepare_server_args(["--model-path", _model_path(), "--device", "cpu", "--speculative-algorithm", "VERICACHE"])
    with pytest.raises(VeriCacheConfigError, match="pass that flag instead"):
        sa.resolve_once()


def _hf_dir(tmp_path, **config):
    import shutil

    src = smollm2_dir()
    base = json.loads((src / "config.json").read_text())
    base.update(config)
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(base))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, d / name)
    return d


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 4096},
            "sliding-window attention",
        ),
    ],
)
def test_unsupported_models_are_refused_at_resolution(tmp_path, overrides, message):
    _model_path()
    d = _hf_dir(tmp_path, **overrides)
    sa = prepare_server_args(["--model-path", str(d), "--device", "cpu", "--enable-vericache"])
    with pytest.raises(VeriCacheConfigError, match=message):
        sa.resolve_once()


def test_registries_hold_the_algorithm_and_backends():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends
    from sglang.srt.server_args import ATTENTION_BACKEND_CHOICES, DRAFT_ATTENTION_BACKEND_CHOICES
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    from vericache_sglang.sglang.spec_algo import VeriCacheSpecAlgo
    from vericache_sglang.sglang.step.worker import VeriCacheWorker

    algo = SpeculativeAlgorithm.from_string("vericache")
    assert isinstance(algo, VeriCacheSpecAlgo)
    assert algo.is_speculative() and not algo.is_eagle() and not algo.need_topk()
    assert algo.carries_draft_hidden_states() is False
    assert callable(algo.create_future_map)
    assert algo.create_worker(prepare_server_args(_argv())) is VeriCacheWorker  # overlap is off
    assert "vericache" in ATTENTION_BACKENDS and "vericache" in ATTENTION_BACKEND_CHOICES
    assert "vericache" in DRAFT_ATTENTION_BACKEND_CHOICES
    assert "vericache" in registered_radix_cache_backends()


def test_future_map_is_built_on_sglang_objects():
    import torch
    from sglang.srt.managers.overlap_utils import FutureMap
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    algo = SpeculativeAlgorithm.from_string("VERICACHE")
    pool = ReqToTokenPool(size=8, max_context_len=64, device="cpu", enable_memory_saver=False)
    fm = algo.create_future_map(torch.device("cpu"), pool)
    assert isinstance(fm, FutureMap)


def test_draft_backend_refuses_to_be_the_server_backend():
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    class Runner:  # a ModelRunner without VeriCache's pools: what --attention-backend vericache would give
        pass

    with pytest.raises(ValueError, match="selected by --enable-vericache"):
        ATTENTION_BACKENDS["vericache"](Runner())
