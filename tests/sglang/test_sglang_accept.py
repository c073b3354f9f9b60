"""The core's greedy acceptance decides exactly what SGLang's greedy verification decides, on the
same real logits.

``eagle_sample`` dispatches greedy verification to a platform kernel; on CPU none of its platform
branches is available, so this test calls SGLang's own Triton kernel (the one ``eagle_sample``
uses on XPU; in the interpreter here) with the chain layout an NGRAM/VeriCache verify input has.
On a GPU the same comparison runs through ``eagle_sample``'s CUDA kernel (``-m gpu``, unverified
here: the lent GPU machines have no sglang).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("sglang.kernels.ops.speculative.spec_tree", reason="sglang is not installed")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("SGLang's Triton kernel needs TRITON_INTERPRET=1 without a GPU", allow_module_level=True)

from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

from vericache_sglang.core.accept import greedy_accept

pytestmark = pytest.mark.real_model
X = 8  # drafted tokens


def _sglang_greedy(seed: int, draft: list[int], target: torch.Tensor) -> tuple[int, list[int]]:
    """SGLang's chain verification: (accepted drafts, committed tokens)."""
    n = len(draft) + 1
    candidates = torch.tensor([[seed, *draft]], dtype=torch.int64)
    retrieve_index = torch.arange(n, dtype=torch.int64)[None]
    retrieve_next_token = torch.tensor([[*range(1, n), -1]], dtype=torch.int64)
    retrieve_next_sibling = torch.full((1, n), -1, dtype=torch.int64)
    predicts = torch.zeros(n, dtype=torch.int32)
    accept_index = torch.full((1, n), -1, dtype=torch.int32)
    accept_num = torch.zeros(1, dtype=torch.int32)
    verify_tree_greedy_triton(
        predicts=predicts,
        accept_index=accept_index,
        accept_token_num=accept_num,
        candidates=candidates,
        retrieve_index=retrieve_index,
        retrieve_next_token=retrieve_next_token,
        retrieve_next_sibling=retrieve_next_sibling,
        target_predict=target[None].to(torch.int64),
    )
    accepted = int(accept_num[0])
    committed = [int(predicts[int(i)]) for i in accept_index[0, : accepted + 1]]
    return accepted, committed


@pytest.fixture(scope="module")
def model_and_prompt(real_engine):
    from conftest import PROMPTS

    tokens = real_engine.encode((PROMPTS / "code.txt").read_text()[:1200])
    model = real_engine.loaded.model
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, -1]
    seed = int(logits.argmax())
    # the greedy continuation: the draft a perfect drafter would make
    cont = [seed]
    with torch.no_grad():
        for _ in range(X + 1):  # the drafts and the bonus token
            cont.append(int(model(torch.tensor([tokens + cont])).logits[0, -1].argmax()))
    return model, tokens, seed, cont[1:]


@pytest.mark.parametrize("wrong_at", [None, 0, 3, X - 1])
def test_core_greedy_accept_equals_sglang_verification(model_and_prompt, wrong_at):
    model, tokens, seed, greedy = model_and_prompt
    draft = list(greedy[:X])
    if wrong_at is not None:
        draft[wrong_at] = (draft[wrong_at] + 17) % model.config.vocab_size
    with torch.no_grad():  # one verify pass over the full context: seed and drafts
        logits = model(torch.tensor([[*tokens, seed, *draft]])).logits[0, len(tokens) :]
    target = logits.argmax(-1)  # the verifier's token after the seed and after each draft
    ours = greedy_accept(draft, target.tolist())
    accepted, committed = _sglang_greedy(seed, draft, target)
    assert (ours.accepted, ours.tokens) == (accepted, committed)
    assert ours.accepted == (X if wrong_at is None else wrong_at)
    assert ours.tokens == greedy[: ours.accepted + 1]  # and both commit the full-KV greedy tokens
