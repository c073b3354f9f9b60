"""Stop conditions, checked token by token so every decoding method stops at the same token."""

from __future__ import annotations

from collections.abc import Iterable


class StopChecker:
    """Feeds committed tokens in order; says when and why generation ends.

    A stop string ends generation at the first token whose text completes it; the text returned
    stops before the stop string. EOS ends it at the EOS token (kept in the tokens, not the text).
    """

    def __init__(
        self,
        tokenizer: object | None,
        eos_token_ids: Iterable[int] = (),
        stop_strings: Iterable[str] = (),
        max_new_tokens: int = 128,
    ):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.tokenizer = tokenizer
        self.eos = set(int(t) for t in eos_token_ids)
        self.stop_strings = [s for s in stop_strings if s]
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.max_new_tokens = max_new_tokens
        self.tokens: list[int] = []
        self.finish_reason: str | None = None
        self._cut: int | None = None  # text length to keep, when a stop string matched

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True) if self.tokenizer else ""

    def feed(self, token: int) -> bool:
        """Add one committed token; return True when generation ends with it."""
        if self.done:
            raise RuntimeError("generation already finished")
        self.tokens.append(int(token))
        if int(token) in self.eos:
            self.finish_reason = "stop"
        elif self.stop_strings:
            text = self._decode()
            hits = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
            if hits:
                self._cut = min(hits)
                self.finish_reason = "stop"
        if not self.done and len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
        return self.done

    def feed_many(self, tokens: Iterable[int]) -> int:
        """Feed tokens in order until one ends generation; return how many were taken."""
        taken = 0
        for t in tokens:
            taken += 1
            if self.feed(t):
                break
        return taken

    @property
    def text(self) -> str:
        text = self._decode()
        return text if self._cut is None else text[: self._cut]
