import pytest
import torch

from vericache_sglang.core.accept import greedy_accept, rejection_accept
from vericache_sglang.core.sampling import STREAM_DRAFT, Sampler, SamplingParams

CHI2_4DOF_P001 = 18.47  # chi-square critical value, 4 degrees of freedom, p = 0.001


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_accept():
    assert greedy_accept([5, 6, 7], [5, 6, 7, 8]).tokens == [5, 6, 7, 8]
    v = greedy_accept([5, 6, 7], [5, 9, 7, 8])
    assert (v.accepted, v.tokens) == (1, [5, 9])
    assert greedy_accept([], [3]).tokens == [3]
    with pytest.raises(ValueError):
        greedy_accept([1, 2], [1, 2])


def test_sampling_params_validated():
    for bad in ({"temperature": -1}, {"top_k": -1}, {"top_p": 0.0}, {"top_p": 1.5}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


def test_draw_depends_only_on_seed_position_and_logits():
    s = Sampler(SamplingParams(temperature=0.8, seed=42))
    logits = torch.randn(6, 1000)
    together = s.sample(logits, list(range(100, 106)))
    one_by_one = torch.cat([s.sample(logits[i : i + 1], [100 + i]) for i in range(6)])
    assert torch.equal(together, one_by_one)  # batch composition does not matter
    again = Sampler(SamplingParams(temperature=0.8, seed=42)).sample(logits, list(range(100, 106)))
    assert torch.equal(together, again)
    other_seed = Sampler(SamplingParams(temperature=0.8, seed=43)).sample(logits, list(range(100, 106)))
    assert not torch.equal(together, other_seed)
    flat = torch.zeros(1, 1000)
    draws = {int(s.sample(flat, [p])[0]) for p in range(50)}
    assert len(draws) > 40  # positions get independent noise


def test_greedy_is_argmax():
    logits = torch.randn(4, 100)
    assert torch.equal(Sampler(SamplingParams()).sample(logits, [0, 1, 2, 3]), logits.argmax(-1))


def test_top_k_top_p_filter():
    s = Sampler(SamplingParams(temperature=1.0, top_k=3, top_p=0.9))
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    x = s.processed_logits(logits)
    assert torch.isfinite(x[0, :3]).all() and x[0, 3] == float("-inf")
    s2 = Sampler(SamplingParams(temperature=1.0, top_p=0.7))
    x2 = s2.processed_logits(logits)
    assert torch.isfinite(x2[0, :2]).all() and torch.isinf(x2[0, 2:]).all()


def test_gumbel_sampling_matches_the_distribution():
    p = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    logits = (p.log() * 0.7)[None]  # temperature 0.7 undoes the scaling
    counts = torch.zeros(5)
    for seed in range(4000):
        counts[int(Sampler(SamplingParams(temperature=0.7, seed=seed)).sample(logits, [7])[0])] += 1
    assert chi2(counts, p) < CHI2_4DOF_P001


def test_rejection_sampling_is_lossless_in_distribution():
    target = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    draft = torch.tensor([0.1, 0.1, 0.3, 0.3, 0.2])
    first = torch.zeros(5)
    drafts_only = torch.zeros(5)
    for seed in range(4000):
        s = Sampler(SamplingParams(temperature=1.0, seed=seed))
        d = s.sample_probs(draft, 11, STREAM_DRAFT)
        drafts_only[d] += 1
        v = rejection_accept([d], draft[None], torch.stack([target, target]), [11, 12], s)
        first[v.tokens[0]] += 1
    assert chi2(first, target) < CHI2_4DOF_P001
    assert chi2(drafts_only, target) > 10 * CHI2_4DOF_P001  # the test can tell the draft from the target
