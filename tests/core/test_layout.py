"""kernels/ is vericache_sglang.kernels only: with the repository root on sys.path, transformers
still imports and loads models, and the top-level name `kernels` is never claimed."""

import json
import subprocess
import sys
import textwrap

from conftest import REPO

PROBE = textwrap.dedent("""
    import importlib.util, json, sys
    sys.path.insert(0, {repo!r})            # the repository root first, as when run from a checkout
    if {standin!r}:
        sys.path.append({standin!r})        # an installed package named `kernels`, after the root
    out = {{}}
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_kernels_available
    model = AutoModelForCausalLM.from_pretrained({model_dir!r})
    out["logits_shape"] = list(model(torch.tensor([[1, 2, 3]])).logits.shape)
    out["is_kernels_available"] = is_kernels_available()
    spec = importlib.util.find_spec("kernels")
    out["kernels_origin"] = None if spec is None else spec.origin
    import kernels
    out["kernels_file"] = getattr(kernels, "__file__", None)
    try:
        import kernels.dequant
        out["top_level_submodule"] = "imported"
    except ImportError as e:
        out["top_level_submodule"] = str(e)
    import vericache_sglang.kernels.dequant as dq
    out["package_module"] = dq.__name__
    print(json.dumps(out))
""")


def run_probe(tmp_path, standin: str = "") -> dict:
    from vericache_sglang.engine.model import tiny_llama

    model_dir = tmp_path / "tiny"
    tiny_llama().model.save_pretrained(model_dir)
    code = PROBE.format(repo=str(REPO), standin=standin, model_dir=str(model_dir))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_transformers_works_with_repo_root_on_sys_path(tmp_path):
    out = run_probe(tmp_path)
    assert out["logits_shape"] == [1, 3, 512]
    assert out["is_kernels_available"] is False
    assert out["kernels_origin"] is None  # at most a namespace directory, never a regular package
    assert out["kernels_file"] is None
    assert "vericache_sglang.kernels" in out["top_level_submodule"]
    assert out["package_module"] == "vericache_sglang.kernels.dequant"


def test_repo_kernels_dir_does_not_shadow_an_installed_kernels_package(tmp_path):
    # A stand-in for Hugging Face's `kernels` (which sglang installs), placed after the repo root.
    standin = tmp_path / "site"
    (standin / "kernels").mkdir(parents=True)
    (standin / "kernels" / "__init__.py").write_text("__version__ = '0.14.1'\nREAL = True\n")
    out = run_probe(tmp_path, str(standin))
    assert out["kernels_file"] == str(standin / "kernels" / "__init__.py")
    assert out["logits_shape"] == [1, 3, 512]
