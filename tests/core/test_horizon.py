"""The adaptive horizon policy: its acceptance estimate and how cost and acceptance move it."""

import pytest

from vericache_sglang.core.horizon import AdaptiveHorizon, WindowCost, expected_committed


def test_expected_committed():
    assert expected_committed(0.0, 16) == 1.0
    assert expected_committed(1.0, 16) == 17.0
    assert expected_committed(0.5, 2) == pytest.approx(1.75)


def test_acceptance_is_the_censored_estimate_with_a_prior():
    policy = AdaptiveHorizon(prior_accepts=0, prior_rejects=0, memory=1.0)
    # 3 of 8 accepted (one rejection), then 8 of 8 (censored: no rejection)
    assert policy.acceptance([8, 8], [3, 8]) == pytest.approx(11 / 12)
    assert AdaptiveHorizon().acceptance([], []) == pytest.approx(0.8)


def test_a_slow_link_drafts_longer_and_low_acceptance_drafts_shorter():
    policy = AdaptiveHorizon(max_horizon=64)
    good = ([16] * 4, [15] * 4)
    fast = policy.choose(*good, WindowCost(draft_s=1.0, verify_s=1.25, transfer_s=2.5))
    slow = policy.choose(*good, WindowCost(draft_s=1.0, verify_s=1.25, transfer_s=15.0))
    assert slow >= 15 and slow > fast
    poor = policy.choose([16] * 4, [1] * 4, WindowCost(draft_s=1.0, verify_s=1.25, transfer_s=2.5))
    assert poor < fast
    assert 1 <= poor and slow <= 64


def test_bad_parameters():
    with pytest.raises(ValueError):
        AdaptiveHorizon(max_horizon=0)
    with pytest.raises(ValueError):
        AdaptiveHorizon(memory=0)
