"""Unseeded sampling in real servers: stock SGLang draws from torch's generator, so its tokens
cannot be matched one by one; VeriCache must draw from the same distribution. Many short
completions of one prompt at temperature 1, from stock and from the session's VeriCache server
(SnapKV with ``+refresh`` and ``+lookup``, drafts verified by the core's position-keyed sampler):
at every position the two token histograms pass a chi-square test of homogeneity. The same test
rejects a sampler that sharpens the distribution (VeriCache asked for temperature 0.6 against
stock's 1.0), so it can fail."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
import torch

from vericache_sglang.bench.sglang_server import tokenizer

pytestmark = [pytest.mark.real_model, pytest.mark.sglang]

SAMPLES = 120
TOKENS = 5
ALPHA = 1e-3  # over all positions (Bonferroni): a false alarm in one run of a thousand


def _sample(server, temperature: float) -> list[list[int]]:
    tok = tokenizer()
    chat = [{"role": "user", "content": "Name one animal and one colour."}]
    ids = list(tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
    params = {"max_new_tokens": TOKENS, "temperature": temperature, "top_p": 1.0, "top_k": -1, "ignore_eos": True}
    with cf.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda _: server.generate(ids, params)["output_ids"], range(SAMPLES)))
    assert all(len(o) == TOKENS for o in outs)
    return outs


def homogeneity_p(a: list[int], b: list[int]) -> float:
    """Chi-square test that two samples of tokens come from one distribution (tokens seen fewer
    than 10 times in both together pooled as one category); its p-value."""
    counts: dict[int, list[int]] = {}
    for side, sample in enumerate((a, b)):
        for t in sample:
            counts.setdefault(t, [0, 0])[side] += 1
    table, rare = [], [0, 0]
    for pair in counts.values():
        if sum(pair) >= 10:
            table.append(pair)
        else:
            rare = [rare[0] + pair[0], rare[1] + pair[1]]
    if sum(rare):
        table.append(rare)
    if len(table) < 2:
        return 1.0
    obs = torch.tensor(table, dtype=torch.float64)
    expected = obs.sum(1, keepdim=True) * obs.sum(0, keepdim=True) / obs.sum()
    stat = ((obs - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(len(table) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, stat / 2))  # the chi-square survival function


def positions_p(a: list[list[int]], b: list[list[int]]) -> list[float]:
    return [homogeneity_p([s[i] for s in a], [s[i] for s in b]) for i in range(TOKENS)]


@pytest.fixture(scope="module")
def vericache(vericache_launch):
    vericache_launch.wait_healthy()
    return vericache_launch  # stopped by test_sglang_e2e.py, which uses it next, or at the session's end


def test_homogeneity_test_tells_samplers_apart():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(30, generator=g), 0)
    one, two = (torch.multinomial(p, 200, True, generator=g).tolist() for _ in range(2))
    sharp = torch.multinomial(torch.softmax(torch.log(p) / 0.6, 0), 200, True, generator=g).tolist()
    assert homogeneity_p(one, two) > ALPHA
    assert homogeneity_p(one, sharp) < ALPHA


@pytest.mark.slow  # 2 min of 600 short draws; the seeded tests hold the same sampler to stock's every token
def test_unseeded_sampling_draws_stocks_distribution(stock_server, vericache):
    # all three samples at once: VeriCache's two mix in its batches, and the two servers share the cores
    with cf.ThreadPoolExecutor(3) as pool:
        runs = ((stock_server, 1.0), (vericache, 1.0), (vericache, 0.6))
        stock, ours, sharp = pool.map(lambda run: _sample(*run), runs)
    same = positions_p(stock, ours)
    assert min(same) > ALPHA / TOKENS, same
    biased = positions_p(stock, sharp)
    assert min(biased) < ALPHA / TOKENS, biased
    print(f"p-values by position: VeriCache T=1 vs stock {same}; VeriCache T=0.6 vs stock T=1 {biased}")


def test_n_choices_are_samples_of_their_own(vericache):
    """``n=2`` unseeded: each choice is its own request (SGLang gives each a rid, the worker draws
    from a seed of its rid), so the two differ. With a seed both choices carry it, and a seeded
    draw is keyed by seed and position, as SGLang's is under deterministic inference (every
    choice gets the request's ``sampling_seed``): the two are one sample, twice."""
    client = vericache.client()
    ask = {"model": "default", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "n": 2}
    unseeded = client.completions.create(**ask)
    assert unseeded.choices[0].text != unseeded.choices[1].text
    seeded = client.completions.create(**ask, seed=7)
    assert seeded.choices[0].text == seeded.choices[1].text
