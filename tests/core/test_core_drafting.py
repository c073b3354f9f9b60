"""The core's draft window (``core/drafting.py``), which the engines and the SGLang worker drive,
on a model whose next token is known (the successor of its input): a lookup chain costs one
forward for its tokens, is cut where the model disagrees (its K/V forgotten), and the drafts are
the model's own greedy chain whatever the lookup proposed."""

from __future__ import annotations

import torch

from vericache_sglang.core.drafting import DraftWindow
from vericache_sglang.core.lookup import LookupParams, NgramIndex
from vericache_sglang.core.sampling import Sampler, SamplingParams

VOCAB = 50


def successor_logits(tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]``: each row predicts its input token + 1."""
    rows = torch.full((len(tokens), VOCAB), -10.0)
    rows[torch.arange(len(tokens)), torch.tensor([(t + 1) % VOCAB for t in tokens])] = 10.0
    return rows


def drive(window: DraftWindow) -> int:
    passes = 0
    while window.drafting:
        window.take(successor_logits(window.pending))
        passes += 1
    return passes


def window(committed: list[int], x: int, lookup: LookupParams | None, forgotten: list[int]) -> DraftWindow:
    index = None
    if lookup is not None:
        index = NgramIndex(lookup)
        index.extend(committed)
    return DraftWindow(
        x,
        len(committed),
        committed[-1:],
        Sampler(SamplingParams()),
        False,
        eos_ids=[0],
        vocab_size=VOCAB,
        forget=forgotten.append,
        lookup=lookup,
        index=index,
    )


def test_a_chain_is_checked_in_one_forward_and_cut_where_the_model_disagrees():
    # "10 11" recurs: lookup proposes what followed it (12 13 14 15 3 4); the model agrees up to 15
    committed = [10, 11, 12, 13, 14, 15, 3, 4, 5, 10, 11]
    forgotten: list[int] = []
    w = window(committed, 6, LookupParams(), forgotten)
    assert drive(w) == 3  # the seed, the chain, the model's own token after the cut
    assert w.drafts == [12, 13, 14, 15, 16, 17]  # the model's greedy chain
    assert w.sources == ["lookup"] * 4 + ["model"] * 2
    assert forgotten == [2]  # the chain's two tokens after the cut point
    assert w.position == len(committed) + 6 - len(w.pending)


def test_without_lookup_one_forward_per_draft_and_nothing_after_an_end():
    forgotten: list[int] = []
    w = window([10, 11, 12, 13], 5, None, forgotten)
    assert drive(w) == 5 and w.drafts == [14, 15, 16, 17, 18] and w.sources == ["model"] * 5
    w = window([46, 47], 5, None, forgotten)
    assert drive(w) == 3 and w.drafts == [48, 49, 0]  # 0 ends the request: drafting stops there
    assert not forgotten
