"""Shared prefixes (remote prefix caching, RAG): a document's full KV in the store, its compressed KV
next to the serving node's prefix index. A request that starts with a registered document drafts
at once over the compressed prefix; its own prompt tokens past the document are drafted too (their
K/V over a compressed prefix is inexact), and the first verification recomputes them exactly.

A document is compressed without the question that will follow it, so scoring is query-agnostic:
compressors that score by position (streamingllm), key norms (knorm) or reconstruction of the
context (kvzip), and quantizers, need no query; those that score by queries (snapkv, pyramidkv,
adakv, h2o, tova, expected_attention) see the document's own queries instead, as in KVzip's
query-agnostic setting. Each compressor's ``document_scoring`` says which.

Several servers share one store: ``register(..., publish=True)`` lists a document in the store's
catalog (``vericache_sglang.full_kv.documents``); every server's ``sync`` loads each listed document's full KV
once and keeps its own compressed copy.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from remote_store.backends.base import StoreError
from vericache_sglang.core.compress import Compressor, Observation
from vericache_sglang.core.kv import CompressedKV
from vericache_sglang.engine.generation import Prefill
from vericache_sglang.engine.observe import RunnerObservation
from vericache_sglang.engine.prefill import prefill
from vericache_sglang.engine.runner import ModelRunner
from vericache_sglang.full_kv.documents import Document, DocumentCatalog
from vericache_sglang.full_kv.store import FullKVStore

log = logging.getLogger(__name__)


def document_tokens(tokenizer: object, text: str, role: str = "system") -> list[int]:
    """A document's token ids as requests will carry them: its chat-template segment (a ``system``
    or ``user`` message, rendered alone, no generation prompt), or ``raw`` text tokens. A chat
    request whose first message is the same document starts with exactly these ids."""
    if tokenizer is None:
        raise ValueError("the model has no tokenizer: register documents by token ids")
    if role == "raw":
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if role not in ("system", "user"):
        raise ValueError(f"a document's role is system, user or raw, not {role!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template: register the document with role 'raw'")
    return list(
        tokenizer.apply_chat_template([{"role": role, "content": text}], tokenize=True, return_dict=True)["input_ids"]
    )


def store_document(
    runner: ModelRunner, store: FullKVStore, tokens: list[int], name: str | None = None, publish: bool = True
) -> tuple[Prefill, str, str]:
    """Prefill ``tokens`` cut to whole chunks, write their full KV as the store's shared chunks and,
    with ``publish``, list them in its catalog. Returns the prefill, the digest and the name."""
    n = len(tokens) - len(tokens) % store.chunk_tokens
    if n == 0:
        raise ValueError(
            f"a document needs at least one whole chunk of {store.chunk_tokens} tokens, it has {len(tokens)}"
        )
    catalog = DocumentCatalog(store)
    digest = catalog.digest(tokens[:n])
    name = name or f"doc-{digest[:12]}"
    pre = prefill(runner, tokens[:n])
    writer = store.open_request(tokens[:n])
    writer.write(0, pre.kv.layers)
    writer.release()  # the chunks are shared: they stay
    if publish:
        catalog.add(tokens[:n], name)
    return pre, digest, name


@dataclass
class RegisteredPrefix:
    tokens: list[int]  # whole store chunks
    ckv: CompressedKV  # compressed once, copied into each request that uses it
    compressor: Compressor  # what made ``ckv``: a request that uses it keeps it current with the same
    full_kv_bytes: int
    seconds: float  # prefill (or load), store and compress, once
    digest: str = ""
    name: str = ""
    listed: bool = False  # in the store's catalog (``sync`` drops it when unlisted)
    hits: int = 0

    @property
    def compressed_kv_bytes(self) -> int:
        return self.ckv.nbytes


class PrefixRegistry:
    def __init__(self, runner: ModelRunner, store: FullKVStore, compressor: Compressor, max_bytes: int = 0):
        self.runner = runner
        self.store = store
        self.compressor = compressor
        self.catalog = DocumentCatalog(store)
        self.max_bytes = max_bytes  # compressed copies held (0: unbounded)
        self.by_digest: dict[str, RegisteredPrefix] = {}
        self.skipped: dict[str, str] = {}  # catalog documents not adopted, and why

    @property
    def prefixes(self) -> list[RegisteredPrefix]:
        return list(self.by_digest.values())

    @property
    def nbytes(self) -> int:
        return sum(p.compressed_kv_bytes for p in self.by_digest.values())

    def register(self, tokens: list[int], name: str | None = None, publish: bool = False) -> RegisteredPrefix:
        """Prefill ``tokens`` (cut to whole chunks), store their full KV as shared chunks, compress them;
        with ``publish``, list them in the store's catalog for every server sharing it."""
        t = time.monotonic()
        pre, digest, name = store_document(self.runner, self.store, tokens, name, publish)
        ckv = self.compressor.compress(pre.kv, pre.obs)
        prefix = RegisteredPrefix(
            pre.tokens, ckv, self.compressor, pre.kv.nbytes, time.monotonic() - t, digest, name, listed=publish
        )
        self.by_digest[digest] = prefix
        return prefix

    def adopt(self, doc: Document) -> RegisteredPrefix:
        """Keep a compressed copy of a catalog document: its full KV is read from the store once."""
        t = time.monotonic()
        tokens = list(doc.tokens)
        kv = self.store.load_prefix(tokens, len(tokens))
        obs = Observation(None, RunnerObservation(self.runner, tokens, kv))  # the document alone
        ckv = self.compressor.compress(kv, obs)
        prefix = RegisteredPrefix(
            tokens, ckv, self.compressor, kv.nbytes, time.monotonic() - t, doc.digest, doc.name, listed=True
        )
        self.by_digest[doc.digest] = prefix
        return prefix

    def sync(self) -> tuple[list[RegisteredPrefix], list[str]]:
        """Follow the store's catalog: adopt documents listed since the last sync, drop unlisted ones.
        Returns (adopted, dropped digests). A document whose KV the store cannot serve now is tried
        again at the next sync; one that is broken or does not fit the budget is skipped (logged).
        The store being down raises."""
        listed = self.catalog.digests()  # one read; records only of documents new to this server
        dropped = [d for d, p in self.by_digest.items() if p.listed and d not in listed]
        for d in dropped:
            del self.by_digest[d]
        adopted = []
        for digest in listed:
            if digest in self.by_digest or digest in self.skipped:
                continue
            try:
                doc = self.catalog.get(digest)
                if doc is None:  # its record was deleted under the index
                    continue
                prefix = self.adopt(doc)
            except StoreError as e:  # the store failed or lost chunks: the next sync tries again
                log.warning("document %s not adopted yet: %s", digest, e)
                continue
            except Exception as e:  # a broken document must not stop the others
                self.skipped[digest] = str(e)
                log.warning("document %s not adopted: %s", digest, e)
                continue
            if self.max_bytes and self.nbytes > self.max_bytes:
                del self.by_digest[digest]
                self.skipped[digest] = (
                    f"its compressed copy ({prefix.compressed_kv_bytes} bytes) does not fit "
                    f"the prefix budget of {self.max_bytes} bytes"
                )
                log.warning("document %s (%s) not adopted: %s", doc.name, digest, self.skipped[digest])
                continue
            adopted.append(prefix)
        return adopted, dropped

    def match(self, tokens: list[int]) -> RegisteredPrefix | None:
        """The longest registered prefix of ``tokens`` that leaves at least one token after it."""
        for n, digest in reversed(self.catalog.boundary_digests(tokens)):
            prefix = self.by_digest.get(digest)
            if prefix is not None and n < len(tokens):
                return prefix
        return None
