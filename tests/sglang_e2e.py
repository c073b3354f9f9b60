"""Requests the SGLang end-to-end tests send, through the official ``openai`` client, and the
comparisons they make. Every "identical" is the VeriCache server's output against stock SGLang's
on the same request, token text for token text; where log-probabilities are asked for, their
largest difference is recorded (``exactness``)."""

from __future__ import annotations

import concurrent.futures as cf
import functools
from dataclasses import dataclass, field
from typing import Any

from sglang_server import SGLangServer, document_prompt, tokenizer

MODEL = "default"


@dataclass(frozen=True)
class Ask:
    """One request: ``kind`` "chat" or "completion", streamed or not."""

    prompt: str
    kind: str = "chat"
    stream: bool = False
    max_tokens: int = 64
    params: dict[str, Any] = field(default_factory=dict)  # temperature, stop, logprobs, response_format, ...
    system: str | None = None

    def label(self) -> str:
        return f"{self.kind}{'-stream' if self.stream else ''}"


@dataclass
class Answer:
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None
    cached_tokens: int | None = None


def ask(server: SGLangServer, q: Ask) -> Answer:
    client = server.client()
    params = {"temperature": 0.0, **q.params}
    if q.kind == "completion":
        if q.stream:
            text, finish = "", None
            for chunk in client.completions.create(model=MODEL, prompt=q.prompt, max_tokens=q.max_tokens, stream=True,
                                                   **params):
                text += chunk.choices[0].text
                finish = chunk.choices[0].finish_reason or finish
            return Answer(text, finish)
        r = client.completions.create(model=MODEL, prompt=q.prompt, max_tokens=q.max_tokens, **params)
        logprobs = r.choices[0].logprobs.token_logprobs if r.choices[0].logprobs else None
        return Answer(r.choices[0].text, r.choices[0].finish_reason, logprobs, _cached(r))
    messages = ([{"role": "system", "content": q.system}] if q.system else []) + [{"role": "user", "content": q.prompt}]
    if q.stream:
        text, finish = "", None
        for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=q.max_tokens,
                                                    stream=True, **params):
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        return Answer(text, finish)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=q.max_tokens, **params)
    choice = r.choices[0]
    logprobs = [t.logprob for t in choice.logprobs.content] if choice.logprobs and choice.logprobs.content else None
    return Answer(choice.message.content or "", choice.finish_reason, logprobs, _cached(r))


def _cached(r: Any) -> int | None:
    details = getattr(r.usage, "prompt_tokens_details", None)
    return getattr(details, "cached_tokens", None) if details is not None else None


def ask_all(server: SGLangServer, questions: list[Ask]) -> list[Answer]:
    """All at once (they run as one continuous batch on the server)."""
    with cf.ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(lambda q: ask(server, q), questions))


def compare_answers(reference: Answer, answer: Answer) -> dict[str, Any]:
    """The exactness record of one answer against stock SGLang's."""
    diff = None
    if reference.logprobs is not None and answer.logprobs is not None:
        n = min(len(reference.logprobs), len(answer.logprobs))
        diff = max((abs(a - b) for a, b in zip(reference.logprobs[:n], answer.logprobs[:n], strict=True)), default=0.0)
    return {"identical": reference.text == answer.text and reference.finish_reason == answer.finish_reason,
            "compared_tokens": token_count(answer.text),
            "max_logprob_abs_diff": diff, "first_mismatch": _first_difference(reference.text, answer.text)}


def _first_difference(a: str, b: str) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


def accepted_length(server: SGLangServer) -> float:
    """Tokens committed per verification over the server's drafting requests (its ``/metrics``)."""
    m = server.metrics()
    return m["vericache_accepted_length_sum"] / max(m["vericache_accepted_length_count"], 1.0)


@functools.cache
def prompt(name: str, min_tokens: int = 1000) -> str:
    """``benchmarks/prompts/NAME.txt`` cut to about ``min_tokens`` tokens (a real prompt of >= 1,000)."""
    return document_prompt(name, min_tokens)


@functools.cache
def _tokenizer() -> Any:
    return tokenizer()


def token_count(text: str) -> int:
    return len(_tokenizer().encode(text, add_special_tokens=False))
