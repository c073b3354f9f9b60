"""Every compressor, and a composition, at its defaults on SmolLM2: VeriCache output identical to
full-KV greedy decoding on one real 2,297-token prompt, 24 new tokens in windows of 8 (three or more
verifications, each followed by the compressor's commit), the reference computed once.

The default set runs one compressor of each family: observation-window scoring (SnapKV), position
(StreamingLLM), accumulated attention evicting while decoding (H2O), query-aware pages (Quest),
quantization (KIVI) and a dropper composed with a quantizer; reconstruction (KVzip) and the others
of each family are in the heavy set (and every one at its defaults on the tiny model,
``tests/engine/test_engine_tiny.py``). The long runs (256 tokens, x=16 and 32, seeded sampling,
three prompts) are the heavy set's matrix."""

import pytest

from vericache_sglang.core.compress import COMPRESSORS
from vericache_sglang.engine.engine import compare

pytestmark = pytest.mark.real_model

NEW_TOKENS = 24
# reconstruction (KVzip) on SmolLM2 in the default set: the registered document's KVzip copy,
# ``tests/serve/test_serve_prefix.py``, drafted over and held to full-KV decoding
FAMILIES = {"snapkv", "streamingllm", "h2o", "quest", "kivi"}
SPECS = [pytest.param(name, marks=() if name in FAMILIES else pytest.mark.slow) for name in sorted(COMPRESSORS)]
SPECS.append("snapkv:ratio=0.25+kivi:bits=4")


@pytest.fixture(scope="module")
def pre(prose_prefill):
    return prose_prefill


@pytest.fixture(scope="module")
def reference(real_engine, pre):
    return real_engine.generate(pre, "full", cfg=real_engine.config(max_new_tokens=NEW_TOKENS, keep_logits=True))


@pytest.mark.parametrize("spec", SPECS)
def test_identical_to_full_kv(real_engine, pre, reference, spec, exactness):
    cfg = real_engine.config(max_new_tokens=NEW_TOKENS, keep_logits=True, horizon=8)
    res = real_engine.generate(pre, "vericache", spec, cfg)
    cmp = compare(reference, res)
    exactness(
        f"SmolLM2 prose greedy {spec} (family)",
        cmp,
        accepted_length=res.stats.mean_accepted_length,
        compressed_over_full=res.stats.compressed_kv_bytes / res.stats.full_kv_bytes,
    )
    assert cmp["identical"], cmp
    assert len(res.tokens) == NEW_TOKENS
