"""Grammar-constrained decoding (structured outputs) with xgrammar, for the reference engine.

A ``Constraint`` is a grammar compiled for the model's tokenizer (a JSON schema, any JSON, a regex or
an EBNF grammar); each request follows it with its own ``ConstraintState``, xgrammar's matcher over
the tokens committed so far. Before a token is chosen at a position, the logits there are masked to
the tokens the grammar allows after what precedes it. Drafting walks the matcher along the drafts
(keeping each position's mask) and rolls it back; verification applies the same masks to the
full-KV logits at the same positions; the committed tokens then advance it. So VeriCache commits
what full-KV constrained decoding chooses, token for token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

MAX_ROLLBACK = 128  # drafts a matcher can be rolled back over (the horizon is at most 64)


class ConstraintError(ValueError):
    """A response format or grammar that cannot be compiled or is not supported."""


@dataclass(frozen=True)
class Constraint:
    compiled: Any  # xgrammar.CompiledGrammar
    vocab_size: int
    kind: str  # "json_schema", "json_object", "regex" or "ebnf"

    def state(self) -> ConstraintState:
        import xgrammar as xgr

        return ConstraintState(xgr.GrammarMatcher(self.compiled, max_rollback_tokens=MAX_ROLLBACK), self.vocab_size)


class ConstraintState:
    """One request's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int):
        import xgrammar as xgr

        self.matcher = matcher
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    def mask(self) -> torch.Tensor:
        """The allowed-token bitmask after the tokens accepted so far (a copy: ``[1, words]``)."""
        self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        return self._bitmask.clone()

    def apply(self, logits: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """``logits`` ``[n, vocab]`` with disallowed tokens at -inf (a masked copy), by ``mask``
        (rows ``[n, words]``) or the current state's mask for every row."""
        import xgrammar as xgr

        out = logits.float().clone()
        if mask is None:
            mask = self.mask().expand(out.shape[0], -1).contiguous()
        width = self.vocab_size
        xgr.apply_token_bitmask_inplace(out[:, :width], mask.to(out.device))
        return out

    @staticmethod
    def allows(token: int, mask: torch.Tensor) -> bool:
        """Whether ``mask`` (one row ``[1, words]``, xgrammar's bitmask: bit ``t % 32`` of word
        ``t // 32``) allows ``token``."""
        return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)

    def advance(self, token: int) -> bool:
        """Accept ``token``; False (nothing changed) when the grammar is complete or forbids it."""
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(int(token)))

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)


# What xgrammar's cache of compiled grammars may hold: a server compiles every client's schema, and
# an unbounded cache grows with each distinct one for the life of the process (LRU beyond this).
DEFAULT_CACHE_LIMIT_BYTES = 256 << 20


class ConstraintCompiler:
    """Compiles response formats for one tokenizer (xgrammar caches what it compiled, up to
    ``cache_limit_bytes``)."""

    def __init__(self, tokenizer: Any, vocab_size: int, cache_limit_bytes: int = DEFAULT_CACHE_LIMIT_BYTES):
        import xgrammar as xgr

        if tokenizer is None:
            raise ConstraintError("constrained decoding needs the model's tokenizer")
        if cache_limit_bytes <= 0:
            raise ValueError(f"cache_limit_bytes must be > 0, got {cache_limit_bytes}")
        self.vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(
            xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size), cache_limit_bytes=cache_limit_bytes
        )

    def cache_bytes(self) -> int:
        """What the compiled-grammar cache holds now."""
        return int(self._compiler.get_cache_size_bytes())

    def compile(self, response_format: dict[str, Any]) -> Constraint:
        """An OpenAI ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema",
        "json_schema": {"schema": {...}}}``) or this project's ``{"type": "regex", "regex": ...}`` /
        ``{"type": "ebnf", "ebnf": ...}``."""
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        try:
            if kind == "json_object":
                compiled = self._compiler.compile_builtin_json_grammar()
            elif kind == "json_schema":
                spec = response_format.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ConstraintError("response_format.json_schema.schema must be a JSON Schema object")
                compiled = self._compiler.compile_json_schema(json.dumps(schema))
            elif kind == "regex" and isinstance(response_format.get("regex"), str):
                compiled = self._compiler.compile_regex(response_format["regex"])
            elif kind == "ebnf" and isinstance(response_format.get("ebnf"), str):
                compiled = self._compiler.compile_grammar(response_format["ebnf"])
            elif kind == "text":
                raise ConstraintError("response_format text is no constraint")
            else:
                raise ConstraintError(
                    f"response_format type {kind!r} is not one of json_object, json_schema, regex, ebnf"
                )
        except ConstraintError:
            raise
        except Exception as e:  # xgrammar's own parse errors
            raise ConstraintError(f"response_format: {e}") from None
        return Constraint(compiled, self.vocab_size, kind)

    def compile_grammar(self, grammar: Any, kind: str = "grammar") -> Constraint:
        """An xgrammar ``Grammar`` built by the caller (tool calls: literals around a JSON schema)."""
        try:
            return Constraint(self._compiler.compile_grammar(grammar), self.vocab_size, kind)
        except Exception as e:
            raise ConstraintError(f"{kind}: {e}") from None
