"""``grpc://`` and ``grpcs://``: a client of our store server (``remote_store.server``).

URL: ``grpc[s]://[:TOKEN@]HOST:PORT[?timeout_s=T&ca=CA_PEM&server_name=NAME]``. The token comes from the
URL's password part, ``VERICACHE_STORE_TOKEN`` or the file named by ``VERICACHE_STORE_TOKEN_FILE``;
for ``grpcs`` the CA bundle from ``ca`` or
``VERICACHE_STORE_CA`` (the system roots otherwise). A layer-grouped get is one server-streaming
call: each layer's records are yielded as soon as they have arrived.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from urllib.parse import parse_qsl, unquote, urlsplit

import grpc

from remote_store.backends.base import PROBE_KEY, ByteStore, RangeRequest, StoreConfigError, StoreError
from remote_store.proto import MAX_MESSAGE_BYTES, store_pb2, store_pb2_grpc

_PUT_BATCH_BYTES = 64 << 20
PROBE_TIMEOUT_S = 5.0
_REFUSED = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)


class GrpcStore(ByteStore):
    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in ("grpc", "grpcs") or not parts.hostname or not parts.port:
            raise ValueError(f"bad store URL {url!r}: expected grpc[s]://[:TOKEN@]HOST:PORT")
        query = dict(parse_qsl(parts.query))
        token = unquote(parts.password) if parts.password else os.environ.get("VERICACHE_STORE_TOKEN")
        token_file = os.environ.get("VERICACHE_STORE_TOKEN_FILE")
        if not token and token_file:  # a mounted secret (docker-compose.yml)
            with open(token_file) as f:
                token = f.read().strip()
        self.url = f"{parts.scheme}://{parts.hostname}:{parts.port}"
        self.timeout_s = float(query.get("timeout_s", 60))
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        target = f"{parts.hostname}:{parts.port}"
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            # A store that went away and came back is reconnected to within a second or two, and a
            # new client does not inherit another channel's reconnect back-off.
            ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", 100),
            ("grpc.min_reconnect_backoff_ms", 100),
            ("grpc.max_reconnect_backoff_ms", 2000),
        ]
        if parts.scheme == "grpcs":
            ca = query.get("ca") or os.environ.get("VERICACHE_STORE_CA")
            creds = grpc.ssl_channel_credentials(open(ca, "rb").read() if ca else None)
            if "server_name" in query:
                options.append(("grpc.ssl_target_name_override", query["server_name"]))
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.stub = store_pb2_grpc.KVStoreStub(self.channel)

    def _error(self, what: str, e: grpc.RpcError) -> StoreError:
        kind = StoreConfigError if e.code() in _REFUSED else StoreError
        return kind(f"store {what} failed at {self.url}: {e.code().name}: {e.details()}")

    def _call(self, what: str, method, request, timeout_s: float | None = None):
        try:
            return method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(what, e) from e

    def put_many(self, items: Sequence[tuple[str, bytes]], ttl_s: float | None = None) -> None:
        batch, size = [], 0
        for key, value in items:
            batch.append(store_pb2.Item(key=key, value=value))
            size += len(value)
            if size >= _PUT_BATCH_BYTES:
                self._call("put", self.stub.Put, store_pb2.PutRequest(items=batch, ttl_s=ttl_s or 0))
                batch, size = [], 0
        if batch:
            self._call("put", self.stub.Put, store_pb2.PutRequest(items=batch, ttl_s=ttl_s or 0))

    def _stream_groups(self, what: str, call, request, sizes: list[int], unpack) -> Iterator[list]:
        """Yield each group's replies, in order, as soon as the group is complete."""
        current: list = []
        group = 0
        try:
            stream = call(request, timeout=self.timeout_s, metadata=self._metadata)
            while group < len(sizes) and not sizes[group]:  # empty groups have no records
                yield []
                group += 1
            for record in stream:
                if record.group != group or record.index != len(current):
                    raise StoreError(f"store stream out of order at group {record.group} index {record.index}")
                current.append(unpack(record))
                if len(current) == sizes[group]:
                    yield current
                    current, group = [], group + 1
                    while group < len(sizes) and not sizes[group]:
                        yield []
                        group += 1
        except grpc.RpcError as e:
            raise self._error(what, e) from e
        if group != len(sizes):
            raise StoreError(f"store stream ended after {group} of {len(sizes)} groups")

    def stream_get(self, groups: Sequence[Sequence[str]]) -> Iterator[list[bytes | None]]:
        request = store_pb2.GetRequest(groups=[store_pb2.KeyGroup(keys=list(g)) for g in groups])
        return self._stream_groups(
            "get", self.stub.Get, request, [len(g) for g in groups], lambda r: r.value if r.found else None
        )

    def stream_get_ranges(self, groups: Sequence[Sequence[RangeRequest]]) -> Iterator[list[list[bytes] | None]]:
        request = store_pb2.GetRangesRequest(
            groups=[
                store_pb2.RangeGroup(
                    items=[
                        store_pb2.RangeRequest(key=key, offsets=[o for o, _ in ranges], lengths=[n for _, n in ranges])
                        for key, ranges in group
                    ]
                )
                for group in groups
            ]
        )
        return self._stream_groups(
            "get", self.stub.GetRanges, request, [len(g) for g in groups], lambda r: list(r.parts) if r.found else None
        )

    def get_ranges(self, requests: Sequence[RangeRequest]) -> list[list[bytes] | None]:
        return next(iter(self.stream_get_ranges([requests]))) if requests else []

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return next(iter(self.stream_get([keys]))) if keys else []

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return list(self._call("exists", self.stub.Exists, store_pb2.KeysRequest(keys=list(keys))).exists)

    def probe(self) -> None:
        # a short deadline: at start an address that does not answer is a configuration error
        self._call("probe", self.stub.Exists, store_pb2.KeysRequest(keys=[PROBE_KEY]), timeout_s=PROBE_TIMEOUT_S)

    def delete_many(self, keys: Sequence[str]) -> int:
        return self._call("delete", self.stub.Delete, store_pb2.KeysRequest(keys=list(keys))).deleted

    def pin(self, keys: Sequence[str]) -> None:
        self._call("pin", self.stub.Pin, store_pb2.KeysRequest(keys=list(keys)))

    def unpin(self, keys: Sequence[str]) -> None:
        self._call("unpin", self.stub.Unpin, store_pb2.KeysRequest(keys=list(keys)))

    def stats(self) -> dict[str, object]:
        reply = self._call("stats", self.stub.Stats, store_pb2.Empty())
        return {
            **{k: (int(v) if float(v).is_integer() else v) for k, v in reply.values.items()},
            "eviction_policy": reply.eviction_policy,
        }

    def close(self) -> None:
        self.channel.close()
