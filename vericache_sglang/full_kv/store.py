"""The engine's view of the full-KV tier: a model's exact KV in a byte store, chunk by chunk.

Chunks that lie wholly inside a prompt are shared (content-addressed, no TTL), so another request
or process with the same prefix finds them. A request's own chunks (the prompt's partial tail and
everything decoded) carry its id and a TTL, and are deleted when it is released. Every record is
checked on read (layout, token-prefix digest, layer, span, checksum); a failed check is an error.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from remote_store import codec
from remote_store.backends.base import ByteStore, StoreError
from vericache_sglang.core.kv import FullKV, KVLayout, dtype_name
from vericache_sglang.full_kv import subset
from vericache_sglang.full_kv.keys import KEY_PREFIX, ChunkRef, chunk_refs, salt_digest

log = logging.getLogger(__name__)

DEFAULT_CHUNK_TOKENS = 64
DEFAULT_DECODE_TTL_S = 3600.0
MAX_DEFERRED_RELEASES = 4096
# ``into(layer, (heads, tokens, head_dim))``: the K and V tensors a fetched layer is written into
Allocate = Callable[[int, tuple[int, int, int]], tuple[torch.Tensor, torch.Tensor]]


def _tensor_from(payload: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffer: copied right after
        return torch.frombuffer(payload, dtype=dtype).view(shape)


@dataclass
class TransferStats:
    fetches: int = 0
    fetch_bytes: int = 0
    last_fetch_bytes: int = 0
    put_bytes: int = 0
    fetch_bytes_per_verify: list[int] = field(default_factory=list)


class FullKVStore:
    """Full KV of one model layout in one namespace of a byte store."""

    def __init__(
        self,
        backend: ByteStore,
        layout: KVLayout,
        namespace: str = "default",
        chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
        decode_ttl_s: float = DEFAULT_DECODE_TTL_S,
        subset_min_fraction: float = 0.25,
    ):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.backend = backend
        self.layout = layout
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self.decode_ttl_s = decode_ttl_s
        # Fetch only the rows not held on the device once they are at least this share of a span;
        # below it, whole records (fewer, larger reads) cost less than the ranges save.
        self.subset_min_fraction = subset_min_fraction
        self.layout_digest = layout.digest()
        self._dtype = dtype_name(layout.dtype)
        self.salt = salt_digest(layout.model_id, self.layout_digest, namespace)
        self._deferred: list[tuple[RequestKV, bool]] = []  # releases a store error interrupted
        self._deferred_lock = threading.Lock()

    # keys and records
    def key(self, ref: ChunkRef, layer: int, owner: str | None = None) -> str:
        scope = "shared" if owner is None else f"req-{owner}"
        return f"{KEY_PREFIX}:{self.namespace}:{self.layout_digest}:{scope}:{ref.digest.hex()}:{ref.num_tokens}:{layer}"

    def encode(self, ref: ChunkRef, layer: int, k: torch.Tensor, v: torch.Tensor) -> bytes:
        self.layout.check_layer(k, v)
        payload = torch.stack([k, v]).contiguous().cpu().view(torch.uint8).numpy().tobytes()
        header = codec.ChunkHeader(
            codec.KIND_KV,
            dtype_name(self.layout.dtype),
            layer,
            self.layout.num_kv_heads,
            ref.num_tokens,
            self.layout.head_dim,
            ref.start,
            self.layout_digest,
            ref.digest,
            0,
            len(payload),
        )
        return codec.encode(header, payload)

    def expected_header(self, ref: ChunkRef, layer: int) -> codec.ChunkHeader:
        lay = self.layout
        header = codec.ChunkHeader(
            codec.KIND_KV,
            dtype_name(lay.dtype),
            layer,
            lay.num_kv_heads,
            ref.num_tokens,
            lay.head_dim,
            ref.start,
            self.layout_digest,
            ref.digest,
            0,
            0,
        )
        return dataclasses.replace(header, payload_len=header.expected_payload_len())

    def check_header(self, header: codec.ChunkHeader, ref: ChunkRef, layer: int) -> None:
        """Raise ChunkError unless ``header`` is that of chunk ``ref``'s layer ``layer`` in this layout."""
        codec.check(
            header,
            layout_digest=self.layout_digest,
            prefix_digest=ref.digest,
            layer=layer,
            tokens=ref.num_tokens,
            start=ref.start,
        )
        # The rest of the expected header (its payload length follows from the shape: decode_header
        # checked that); compared field by field, as this runs for every chunk of every fetch.
        lay = self.layout
        if (header.kind, header.dtype, header.heads, header.head_dim) != (
            codec.KIND_KV,
            self._dtype,
            lay.num_kv_heads,
            lay.head_dim,
        ):
            raise codec.ChunkError(
                f"chunk holds {header.dtype} kind {header.kind}, {header.heads} heads x "
                f"{header.head_dim}; expected raw {dtype_name(self.layout.dtype)} KV of this layout"
            )

    def decode(self, record: bytes, ref: ChunkRef, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        header, payload = codec.decode(record)
        self.check_header(header, ref, layer)
        kv = _tensor_from(payload, self.layout.dtype, (2, header.heads, header.tokens, header.head_dim))
        return kv[0], kv[1]

    def refs(self, tokens: Sequence[int], upto: int | None = None) -> list[ChunkRef]:
        return chunk_refs(tokens, self.chunk_tokens, self.salt, upto)

    # shared prefixes
    def longest_prefix(self, tokens: Sequence[int], start: int = 0) -> int:
        """How many leading tokens have their full KV stored in shared (whole) chunks (one round
        trip). With ``start``, the caller holds the tokens before it: chunks ending at or before it
        are not asked for, and 0 means none past it is stored."""
        whole = [r for r in self.refs(tokens) if r.num_tokens == self.chunk_tokens and r.end > start]
        if not whole:
            return 0
        layers = self.layout.num_layers
        present = self.backend.exists_many([self.key(r, layer) for r in whole for layer in range(layers)])
        found = 0
        for i, ref in enumerate(whole):
            if not all(present[i * layers : (i + 1) * layers]):
                break
            found = ref.end
        return found

    def load_prefix(self, tokens: Sequence[int], upto: int, start: int = 0) -> FullKV:
        """The shared full KV of ``tokens[start:upto]`` (``upto`` from ``longest_prefix``)."""
        return FullKV(self.layout, [(k, v) for _, k, v in self.stream_prefix(tokens, upto, start)])

    def stream_prefix(
        self, tokens: Sequence[int], upto: int, start: int = 0
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """``load_prefix`` layer by layer as the layers arrive: one streamed request for all of
        them (a round trip per layer cost a 2,880-token prefix half a second over loopback gRPC)."""
        refs = [r for r in self.refs(tokens, upto) if r.end > start]
        groups = [[self.key(r, layer) for r in refs] for layer in range(self.layout.num_layers)]
        for layer, records in enumerate(self.backend.stream_get(groups)):
            yield (layer, *self._join(refs, layer, records, None, (start, upto)))

    def _join(
        self,
        refs: list[ChunkRef],
        layer: int,
        records: list[bytes | None],
        owners: list[str | None] | None,
        span: tuple[int, int] | None = None,
        into: Allocate | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K/V of positions ``span`` (default: all of ``refs``), each chunk decoded
        straight into its place in the output (``into``'s tensors, or new ones)."""
        start, upto = span or (refs[0].start, refs[-1].end)
        k_out, v_out = self._outputs(layer, upto - start, into)
        for i, (ref, record) in enumerate(zip(refs, records, strict=True)):
            if record is None:
                owner = owners[i] if owners else None
                raise StoreError(
                    f"chunk {ref.index} (tokens [{ref.start}, {ref.end}), layer {layer}) is "
                    f"missing from the store (key {self.key(ref, layer, owner)})"
                )
            k, v = self.decode(record, ref, layer)
            a, b = max(ref.start, start), min(ref.end, upto)
            k_out[:, a - start : b - start] = k[:, a - ref.start : b - ref.start]
            v_out[:, a - start : b - start] = v[:, a - ref.start : b - ref.start]
        return k_out, v_out

    def _outputs(self, layer: int, tokens: int, into: Allocate | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Where a layer's K/V of ``tokens`` positions is decoded: ``into``'s tensors, or new ones."""
        lay = self.layout
        shape = (lay.num_kv_heads, tokens, lay.head_dim)
        if into is not None:
            return into(layer, shape)
        return torch.empty(shape, dtype=lay.dtype), torch.empty(shape, dtype=lay.dtype)

    def defer_release(self, kv: RequestKV, delete_private: bool) -> None:
        with self._deferred_lock:
            self._deferred.append((kv, delete_private))
            if len(self._deferred) > MAX_DEFERRED_RELEASES:  # a store gone for good: leases and TTLs end them
                dropped = self._deferred.pop(0)[0]
                log.warning(
                    "dropped the deferred release of request %s (%d keys)", dropped.request_id, dropped.unreleased
                )

    def retry_releases(self) -> None:
        """Retry the releases a store error interrupted (each re-defers itself if it fails again)."""
        with self._deferred_lock:
            deferred, self._deferred = self._deferred, []
        for kv, delete_private in deferred:
            kv._release(delete_private)

    def open_request(self, tokens: Sequence[int], request_id: str | None = None, shared: bool = True) -> RequestKV:
        """A request of prompt ``tokens``; ``shared=False``: its prompt's chunks are its own too
        (never found by another request's prefix lookup)."""
        return RequestKV(self, tokens, request_id or uuid.uuid4().hex[:16], shared)


class RequestKV:
    """One request's full KV in the store: written as it is committed, fetched layer by layer."""

    def __init__(self, store: FullKVStore, prompt: Sequence[int], request_id: str, shared: bool = True):
        self.store = store
        self.request_id = request_id
        self.tokens: list[int] = list(prompt)
        # whole prompt chunks are shared (content-keyed, found by other requests' prefix lookups)
        self.shared_end = len(prompt) - len(prompt) % store.chunk_tokens if shared else 0
        self.stored = 0  # positions [0, stored) have their KV in the store
        self._tail: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # KV of the partial last chunk
        self._pinned: list[str] = []
        self._private: list[str] = []
        self.stats = TransferStats()
        self._lock = threading.Lock()

    def _owner(self, ref: ChunkRef) -> str | None:
        return None if ref.end <= self.shared_end and ref.num_tokens == self.store.chunk_tokens else self.request_id

    def extend_tokens(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def adopt_prefix(self, n: int) -> None:
        """Take the stored shared chunks of ``tokens[:n]`` (whole prompt chunks) as this request's first
        ``n`` positions, pinned like its own. Raises StoreError if any is missing."""
        store = self.store
        with self._lock:
            if self.stored:
                raise ValueError("adopt_prefix comes before any write")
            if n % store.chunk_tokens or n > self.shared_end:
                raise ValueError(
                    f"a prefix of {n} tokens is not whole shared chunks of this prompt "
                    f"(chunks of {store.chunk_tokens}, {self.shared_end} shareable)"
                )
            keys = [store.key(r, layer) for r in store.refs(self.tokens, n) for layer in range(store.layout.num_layers)]
            store.backend.pin(keys)
            if not all(store.backend.exists_many(keys)):
                store.backend.unpin(keys)
                raise StoreError(f"the prefix of {n} tokens is not (all) in the store")
            self._pinned.extend(keys)
            self.stored = n

    def _held_shared(self, per_ref: list[list[str]], owners: list[str | None]) -> set[int]:
        """Indices of the shared chunks (no owner) whose every layer the store already holds."""
        shared = [i for i, owner in enumerate(owners) if owner is None]
        if not shared:
            return set()
        found = self.store.backend.exists_many([key for i in shared for key in per_ref[i]])
        n = self.store.layout.num_layers
        return {i for j, i in enumerate(shared) if all(found[j * n : (j + 1) * n])}

    def write(
        self, start: int, layers: Sequence[tuple[torch.Tensor, torch.Tensor]], *, skip_existing_shared: bool = True
    ) -> None:
        """Store the exact KV of positions ``[start, start + n)``; ``start`` must be ``stored``."""
        store = self.store
        with self._lock:
            if start != self.stored:
                raise ValueError(f"write at {start}, but positions [0, {self.stored}) are what is stored")
            n = layers[0][0].shape[1]
            if start + n > len(self.tokens):
                raise ValueError(f"KV for positions up to {start + n}, only {len(self.tokens)} tokens known")
            chunk0 = start - start % store.chunk_tokens
            if self._tail is not None:
                layers = [
                    (torch.cat([tk, k], 1), torch.cat([tv, v], 1))
                    for (tk, tv), (k, v) in zip(self._tail, layers, strict=True)
                ]
            refs = [r for r in store.refs(self.tokens, start + n) if r.end > chunk0]
            old_tail = [r for r in store.refs(self.tokens, start) if r.start == chunk0 and r.end > chunk0]
            shared_items, private_items, private = [], [], []
            owners = [self._owner(ref) for ref in refs]
            per_ref = [
                [store.key(ref, layer, owner) for layer in range(store.layout.num_layers)]
                for ref, owner in zip(refs, owners, strict=True)
            ]
            all_new = [key for keys in per_ref for key in keys]
            # Pinned before they are written, so no other writer can evict them in between: one
            # round trip for the whole write, and one existence check for its shared chunks.
            if all_new:
                store.backend.pin(all_new)
            self._pinned.extend(all_new)
            held = self._held_shared(per_ref, owners) if skip_existing_shared else set()
            for i, (ref, owner, keys) in enumerate(zip(refs, owners, per_ref, strict=True)):
                if i in held:
                    continue
                lo, hi = ref.start - chunk0, ref.end - chunk0
                out = shared_items if owner is None else private_items
                for layer, (k, v) in enumerate(layers):
                    out.append((keys[layer], store.encode(ref, layer, k[:, lo:hi], v[:, lo:hi])))
                if owner is not None:
                    private.extend(keys)
            for group, ttl in ((shared_items, None), (private_items, store.decode_ttl_s)):
                if group:
                    store.backend.put_many(group, ttl)
                    self.stats.put_bytes += sum(len(r) for _, r in group)
            self._private.extend(private)
            if old_tail:
                keep = set(all_new)
                superseded = [
                    store.key(old_tail[0], layer, self._owner(old_tail[0])) for layer in range(store.layout.num_layers)
                ]
                superseded = [k for k in superseded if k not in keep]
                store.backend.unpin(superseded)
                store.backend.delete_many(superseded)
                drop = set(superseded)
                self._pinned = [k for k in self._pinned if k not in drop]
                self._private = [k for k in self._private if k not in drop]
            last = refs[-1]
            if last.num_tokens < store.chunk_tokens:
                lo = last.start - chunk0
                self._tail = [(k[:, lo:].clone(), v[:, lo:].clone()) for k, v in layers]
            else:
                self._tail = None
            self.stored = start + n

    def fetch_layers(
        self,
        upto: int | None = None,
        layers: Sequence[int] | None = None,
        *,
        start: int = 0,
        held: Callable[[int], subset.Held | None] | None = None,
        into: Allocate | None = None,
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield ``(layer, keys, values)`` of positions ``[start, upto)``, layer by layer as they arrive.

        ``held(layer)`` names the rows the caller already holds bit-exactly (a compressor's kept
        tokens); when they are at least ``subset_min_fraction`` of the span, only the other rows
        are read, as byte ranges checked row by row, and the held ones are filled in.
        ``into(layer, shape)``: the tensors each layer is written into (a caller's buffer: the
        chunks land there, no copy after); default new ones.
        """
        store = self.store
        upto = self.stored if upto is None else upto
        if not 0 <= start < upto <= self.stored:
            raise ValueError(f"fetch of [{start}, {upto}), but [0, {self.stored}) is what is stored")
        refs = [r for r in store.refs(self.tokens, self.stored) if r.start < upto and r.end > start]
        owners = [self._owner(r) for r in refs]
        layers = list(range(store.layout.num_layers) if layers is None else layers)
        lay = store.layout
        held_by_layer = {layer: held(layer) for layer in layers} if held else {}
        fraction = (
            (sum(subset.held_fraction(h, lay.num_kv_heads, start, upto) for h in held_by_layer.values()) / len(layers))
            if held_by_layer
            else 0.0
        )
        total = 0
        if not held_by_layer or fraction < store.subset_min_fraction:
            groups = [[store.key(r, layer, o) for r, o in zip(refs, owners, strict=True)] for layer in layers]
            for layer, records in zip(layers, store.backend.stream_get(groups), strict=True):
                total += sum(len(r) for r in records if r is not None)
                k, v = store._join(refs, layer, records, owners, (start, upto), into)
                yield layer, k, v
        else:
            outs, plans = [], []
            for layer in layers:
                k_out, v_out = store._outputs(layer, upto - start, into)
                mask = subset.place_held(held_by_layer[layer], k_out, v_out, start)
                plans.append(subset.plan(refs, [store.expected_header(r, layer) for r in refs], mask, start, upto))
                outs.append((k_out, v_out))
            groups = [
                [(store.key(p.ref, layer, o), p.ranges) for p, o in zip(lp, owners, strict=True)]
                for layer, lp in zip(layers, plans, strict=True)
            ]
            replies = store.backend.stream_get_ranges(groups)
            for layer, lp, (k_out, v_out), reply in zip(layers, plans, outs, replies, strict=True):
                total += sum(len(part) for parts in reply if parts is not None for part in parts)
                subset.assemble(
                    lp, reply, k_out, v_out, start, lambda h, ref, layer=layer: store.check_header(h, ref, layer)
                )
                yield layer, k_out, v_out
        self.stats.fetches += 1
        self.stats.fetch_bytes += total
        self.stats.last_fetch_bytes = total
        self.stats.fetch_bytes_per_verify.append(total)

    def release(self, delete_private: bool = True) -> None:
        """Unpin the request's chunks; delete its private ones (shared ones stay cached).

        Best effort: a store that is down by now cannot fail a request that already finished. What
        it could not release is kept and retried after the store's next successful release (pins
        and private chunks would otherwise hold their records until their leases and TTLs end). A
        retried unpin the store had applied before its reply was lost unpins twice: a shared chunk
        then loses a protection against eviction, and a request that misses it recomputes it.
        """
        if self._release(delete_private):
            self.store.retry_releases()

    def _release(self, delete_private: bool) -> bool:
        """Release what this request holds; False (and deferred) where the store refused."""
        with self._lock:
            self._tail = None  # nothing more is written; a deferred release keeps only keys
            try:
                if self._pinned:
                    self.store.backend.unpin(self._pinned)
                self._pinned = []
                if delete_private and self._private:
                    self.store.backend.delete_many(self._private)
                self._private = []
            except StoreError as e:
                log.warning(
                    "could not release request %s in the store (retried after the next release): %s", self.request_id, e
                )
                self.store.defer_release(self, delete_private)
                return False
        return True

    @property
    def unreleased(self) -> int:
        """Keys this request still holds in the store (pinned or its own), 0 once released."""
        return len(self._pinned) + len(self._private)
