"""Lookup drafts under a grammar in the SGLang worker: the core ``DraftWindow`` walks SGLang's own
xgrammar object through ``WindowGrammar``, and ``ChainMasks.adopt`` hands the window's masks to
verification. On SmolLM2's tokenizer and a real JSON schema: a lookup chain from the prompt stops
before the token the schema forbids, every draft is one the grammar takes, the verification masks
are those a one-token-per-pass walk over the same drafts fills, and the grammar is back at the
committed state afterwards (SGLang's scheduler advances it over what the step commits)."""

from __future__ import annotations

import json

import pytest
import torch
from sglang_e2e import PERSON

from vericache_sglang.core.drafting import DraftWindow
from vericache_sglang.core.lookup import LookupParams, NgramIndex
from vericache_sglang.core.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.sglang


@pytest.fixture(scope="module")
def json_grammars():
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend

    from vericache_sglang.bench.sglang_server import tokenizer

    tok = tokenizer()
    backend = XGrammarGrammarBackend(tok, vocab_size=len(tok), model_eos_token_ids=[tok.eos_token_id])
    return tok, lambda: backend.dispatch_json(json.dumps(PERSON))


def test_a_lookup_chain_under_a_json_schema(json_grammars):
    from vericache_sglang.sglang.step.grammar_masks import ChainMasks, WindowGrammar

    tok, new_grammar = json_grammars
    vocab, eos = len(tok), tok.eos_token_id
    # the prompt holds an object with a property the schema forbids; the model writes the allowed one
    prompt = tok.encode('Copy this: {"name": "Ada Lovelace", "age": 36, "city": "Dublin"}\n')
    answer = [*tok.encode('{"name": "Ada Lovelace", "age": 36}'), eos]
    k = answer.index(tok.encode('":')[0], 4) + 1  # committed through `"age":`; the seed is its last token
    committed, truth = prompt + answer[:k], prompt + answer

    def model(pending: list[int], position: int) -> torch.Tensor:
        """Each row predicts the true next token (the model agrees with the prompt's `36`)."""
        rows = torch.full((len(pending), vocab), -10.0)
        for r in range(len(pending)):
            rows[r, truth[position + r + 1]] = 10.0
        return rows

    grammar = new_grammar()
    for t in answer[:k]:
        grammar.accept_token(t)
    index = NgramIndex(LookupParams())
    index.extend(committed)
    window = DraftWindow(
        8,
        len(committed),
        committed[-1:],
        Sampler(SamplingParams()),
        False,
        [eos],
        vocab,
        forget=lambda n: None,
        lookup=LookupParams(),
        index=index,
        grammar=WindowGrammar(grammar, vocab, "cpu"),
    )
    while window.drafting:
        window.take(model(window.pending, window.position))

    assert window.drafts == answer[k:]  # ` 36}` then the end: the model's own chain
    assert "lookup" in window.sources  # ` 36` came from the prompt, checked in one pass
    assert tok.encode(",")[0] not in window.drafts  # the chain stopped before the forbidden `,`

    masks = ChainMasks({0: grammar}, 9, vocab, "cpu")
    masks.adopt(0, window)
    masks.restore()
    assert grammar.accepted_tokens == answer[:k]  # the window's walk undone

    # verification's masks are those a one-token-per-pass walk over the same drafts fills
    stepped = new_grammar()
    for t in answer[:k]:
        stepped.accept_token(t)
    walk = ChainMasks({0: stepped}, 9, vocab, "cpu")
    for j, token in enumerate(window.drafts):
        walk.fill(j)
        walk.advance(0, token)
    walk.fill(len(window.drafts))
    walk.restore()
    assert masks.filled[0] == walk.filled[0] == len(window.drafts)  # the end completed the grammar: no bonus mask
    assert torch.equal(masks.masks[0][: masks.filled[0]], walk.masks[0][: walk.filled[0]])
    logits = torch.randn(2, 9, vocab)
    masks.apply_chain(0, logits[0])
    walk.apply_chains(logits[1:])
    assert torch.equal(logits[0].isinf(), logits[1].isinf())
