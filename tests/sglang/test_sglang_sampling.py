"""Sampled requests in the SGLang worker: SGLang's request settings mapped onto the core's sampler
or, under deterministic inference, SGLang's own seeded draw (``request_plan``, ``seeded_draw``),
and the worker's drafting and acceptance glue (``acceptance``) deciding what the core decides,
checked on logits: with ``verification: "exact"`` a sampled request commits the verifier's own
position-keyed draws (what full-KV sampling draws there), and with ``"rejection"`` the first
committed token is distributed as the verifier's distribution. The whole path in real servers:
``tests/sglang/test_sglang_e2e.py``; against stock SGLang's seeded tokens:
``tests/sglang/test_sglang_triton.py``.
"""

from __future__ import annotations

import sys
import zlib

import pytest
import torch

pytest.importorskip("sglang.srt.sampling.sampling_params", reason="sglang is not installed")

from sglang.srt.sampling.sampling_params import SamplingParams as SGLangSamplingParams

from vericache_sglang.core.accept import greedy_accept, rejection_accept
from vericache_sglang.core.sampling import Sampler, SamplingParams
from vericache_sglang.sglang.step.acceptance import draws, verdict
from vericache_sglang.sglang.step.request_plan import core_sampling, own_settings, plan_request
from vericache_sglang.sglang.step.seeded_draw import BatchPath, SGLangSeededSampler


def test_sglang_settings_map_onto_the_core_sampler():
    assert core_sampling(SGLangSamplingParams(temperature=0.0), "a") == SamplingParams()  # SGLang: top_k=1
    p = core_sampling(SGLangSamplingParams(temperature=0.7, top_p=0.9, top_k=-1, sampling_seed=5), "a")
    assert p == SamplingParams(temperature=0.7, top_k=0, top_p=0.9, seed=5)
    assert core_sampling(SGLangSamplingParams(temperature=1.0, top_k=40, sampling_seed=1), "a").top_k == 40
    unseeded = core_sampling(SGLangSamplingParams(temperature=1.0), "req-17")
    assert unseeded.seed == zlib.crc32(b"req-17") == core_sampling(SGLangSamplingParams(temperature=1.0), "req-17").seed


class _Req:
    def __init__(self, **params):
        self.rid = "r"
        self.sampling_params = SGLangSamplingParams(**params)
        self.return_logprob = False
        self.custom_logit_processor = None


def test_settings_only_sglangs_sampler_applies_make_a_request_its_own():
    assert own_settings(_Req(temperature=0.7, top_p=0.9, sampling_seed=1)) == ()
    assert own_settings(_Req(temperature=0.0)) == ()
    assert own_settings(_Req(temperature=1.0, frequency_penalty=0.5, repetition_penalty=1.1)) == (
        "frequency_penalty",
        "repetition_penalty",
    )
    assert own_settings(_Req(min_p=0.05)) == ("min_p",)
    assert own_settings(_Req(min_new_tokens=3, logit_bias={"5": 1.0})) == ("min_new_tokens", "logit_bias")


def _logits(bs: int, x: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Verifier logits ``[bs, x + 1, vocab]`` and drafter logits near them (compressed-KV drift)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(bs, x + 1, vocab, generator=g) * 3
    return target, target[:, :x] + 0.4 * torch.randn(bs, x, vocab, generator=g)


def test_under_deterministic_inference_a_request_draws_with_sglangs_seed():
    path = BatchPath()
    plan = plan_request(_Req(temperature=0.8, top_p=0.9, sampling_seed=5), path)
    assert isinstance(plan.sampler, SGLangSeededSampler) and plan.sampler.params.seed == 5
    assert plan.sampler.top_p == pytest.approx(0.9) and plan.sampler.path is path
    assert plan_request(_Req(temperature=0.8), path).sampler.params.seed == 42  # SGLang's default seed
    assert plan_request(_Req(temperature=0.0), path).sampler.params.greedy
    assert type(plan_request(_Req(temperature=0.8)).sampler) is Sampler  # off: the core's sampler
    info = type("Info", (), {"need_top_k_sampling": False, "need_top_p_sampling": False, "need_min_p_sampling": False})
    path.follow(info)
    assert not path.sorted
    info.need_top_k_sampling = True  # a greedy request (top_k 1) in the batch
    path.follow(info)
    assert path.sorted
    with pytest.raises(ValueError, match="one stream"):
        plan.sampler.sample(torch.zeros(1, 8), [3], stream=3)


@pytest.fixture
def cpu_kernels(monkeypatch):
    """SGLang's seeded draw hashes through ``sgl_kernel`` on CPU: the platform layer's stand-in, as
    in a server process (``SGLANG_USE_CPU_ENGINE=1``), for this test only."""
    from vericache_sglang.sglang.cpu import platform

    monkeypatch.setenv(platform.ENV, "1")
    before = list(sys.meta_path)
    platform.install()
    yield
    sys.meta_path[:] = before
    sys.modules.pop(platform.MODULE, None)


def test_sglangs_seeded_draw_keys_a_token_by_the_position_it_follows(cpu_kernels):
    """On the plain path the draw is SGLang's own sampler's at position ``p - 1`` for the token at
    ``p`` (a decode step's input position; a prefill's last prompt position)."""
    from sglang.srt.layers.sampler import Sampler as SGLangSampler

    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    ours = SGLangSeededSampler(SamplingParams(temperature=0.7, seed=11), -1, 1.0, BatchPath())
    info = type("Info", (), {"sampling_seed": torch.full((3,), 11), "sampling_mask_batch_indices": None})
    probs = torch.softmax(logits / torch.full((3, 1), 0.7), dim=-1)
    stock, _ = SGLangSampler.__new__(SGLangSampler)._sample_from_probs(probs, info, torch.tensor([9, 10, 11]), True)
    assert ours.sample(logits, [10, 11, 12]).tolist() == stock.tolist()
    drawn = {int(ours.sample(logits[:1], [p])) for p in range(10, 60)}
    assert len(drawn) > 3  # the noise moves with the position


def _samplers(kind: str) -> list[Sampler]:
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, seed=3),
        SamplingParams(temperature=1.2, top_k=10, seed=4),
        SamplingParams(temperature=0.9, top_p=0.8, seed=5),
    ]
    if kind == "core":
        return [Sampler(p) for p in params]
    path = BatchPath()
    path.sorted = kind == "sglang-sorted"
    sglang = [(1, 1.0), (-1, 1.0), (10, 1.0), (-1, 0.8)]  # SGLang's top_k / top_p of each
    return [SGLangSeededSampler(p, k, top_p, path) for p, (k, top_p) in zip(params, sglang, strict=True)]


@pytest.mark.parametrize("kind", ["core", "sglang-plain", "sglang-sorted"])
def test_sampled_requests_commit_the_verifiers_own_draws(kind, cpu_kernels):
    """``verification: "exact"`` with a mixed batch: each request's committed tokens are the
    verifier's position-keyed draws (its argmax for the greedy one), and its drafts up to the
    first mismatch are exactly those draws; with the core's sampler and with SGLang's seeded draw
    on either of its paths."""
    bs, x, vocab = 4, 6, 50
    samplers = _samplers(kind)
    committed = [100, 37, 512, 9]
    accepted_some = 0
    for trial in range(20):
        target, drafter = _logits(bs, x, vocab, trial)
        drafts = torch.stack(
            [draws(drafter[:, j], samplers, [c + 1 + j for c in committed], False)[0] for j in range(x)], dim=1
        )
        verdicts = [
            verdict(drafts[i].tolist(), [], target[i], committed[i], samplers[i], rejection=False) for i in range(bs)
        ]
        for i, (v, sampler) in enumerate(zip(verdicts, samplers, strict=True)):
            own = sampler.sample(target[i], [committed[i] + 1 + k for k in range(x + 1)]).tolist()
            assert v.tokens == own[: v.accepted + 1]
            assert v.tokens[: v.accepted] == drafts[i, : v.accepted].tolist()
            accepted_some += v.accepted
        # the greedy request decides on the argmax
        assert verdicts[0] == greedy_accept(drafts[0].tolist(), target[0].argmax(-1).tolist())
    assert accepted_some > 0  # the drafter agreed often enough for the check to mean something


def test_rejection_glue_is_the_cores_rejection_sampling_and_keeps_the_verifiers_distribution():
    vocab, x, trials = 6, 1, 3000
    g = torch.Generator().manual_seed(0)
    target = torch.randn(1, x + 1, vocab, generator=g)
    drafter = torch.randn(1, x, vocab, generator=g)  # a poor drafter: many rejections
    counts = torch.zeros(vocab)
    for seed in range(trials):
        sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
        token, q = draws(drafter[:, 0], [sampler], [11], rejection=True)
        decided = verdict(token.tolist(), [q[0]], target[0], 10, sampler, rejection=True)
        direct = rejection_accept(token.tolist(), torch.stack([q[0]]), sampler.probs(target[0]), [11, 12], sampler)
        assert decided == direct
        counts[decided.tokens[0]] += 1
    expected = Sampler(SamplingParams(temperature=1.0)).probs(target[0, 0])
    total_variation = 0.5 * float((counts / trials - expected).abs().sum())
    assert total_variation < 0.04, (counts / trials, expected)
