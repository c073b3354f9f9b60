"""Our full-KV store server: ``python -m remote_store.server --listen 127.0.0.1:PORT ...``.

A gRPC service (``remote_store/proto/store.proto``) over a byte-capacity LRU with pins and TTLs.
It handles bytes only: it never imports torch, so it deploys small. Auth is a bearer token
(``--auth-token-file``); TLS is optional (``--tls-cert``/``--tls-key``); the standard gRPC health
service answers without a token; SIGTERM/SIGINT drain in-flight calls and exit 0.
"""

from __future__ import annotations

import argparse
import hmac
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from remote_store.backends.base import ByteStore, StoreError
from remote_store.backends.memory import DEFAULT_PIN_TTL_S, MemoryStore
from remote_store.proto import MAX_MESSAGE_BYTES, store_pb2, store_pb2_grpc

log = logging.getLogger("remote_store.server")
SERVICE_NAME = "vericache.store.v1.KVStore"


class KVStoreServicer(store_pb2_grpc.KVStoreServicer):
    def __init__(self, store: ByteStore):
        self.store = store

    def Put(self, request, context):
        try:
            self.store.put_many([(i.key, i.value) for i in request.items], request.ttl_s or None)
        except StoreError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        return store_pb2.PutReply(stored=len(request.items))

    def Get(self, request, context) -> Iterator[store_pb2.Record]:
        for g, group in enumerate(request.groups):
            for i, value in enumerate(self.store.get_many(list(group.keys))):
                yield store_pb2.Record(group=g, index=i, found=value is not None, value=value or b"")

    def GetRanges(self, request, context) -> Iterator[store_pb2.RangeRecord]:
        for g, group in enumerate(request.groups):
            asks = [(item.key, list(zip(item.offsets, item.lengths, strict=True))) for item in group.items]
            for i, parts in enumerate(self.store.get_ranges(asks)):
                yield store_pb2.RangeRecord(group=g, index=i, found=parts is not None, parts=parts or [])

    def Exists(self, request, context):
        return store_pb2.ExistsReply(exists=self.store.exists_many(list(request.keys)))

    def Delete(self, request, context):
        return store_pb2.DeleteReply(deleted=self.store.delete_many(list(request.keys)))

    def Pin(self, request, context):
        self.store.pin(list(request.keys))
        return store_pb2.Empty()

    def Unpin(self, request, context):
        self.store.unpin(list(request.keys))
        return store_pb2.Empty()

    def Stats(self, request, context):
        stats = self.store.stats()
        return store_pb2.StatsReply(
            values={k: float(v) for k, v in stats.items() if isinstance(v, int | float)},
            eviction_policy=str(stats.get("eviction_policy", "lru-with-pins")),
        )


class TokenAuth(grpc.ServerInterceptor):
    """Requires ``authorization: Bearer TOKEN`` on every call but the health checks."""

    def __init__(self, token: str):
        self.token = token.encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong store token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, details):
        if details.method.startswith("/grpc.health.v1.Health/"):
            return continuation(details)
        given = dict(details.invocation_metadata).get("authorization", "")
        if hmac.compare_digest(given.encode(), b"Bearer " + self.token):
            return continuation(details)
        streaming = details.method.endswith(("/Get", "/GetRanges"))
        return self._deny_stream if streaming else self._deny


def build_server(
    listen: str,
    store: ByteStore,
    token: str | None = None,
    tls_cert: Path | None = None,
    tls_key: Path | None = None,
    workers: int = 16,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """Build (not start) a server over ``store``; returns it, the bound port, and its health servicer."""
    interceptors = [TokenAuth(token)] if token else []
    options = [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ]
    from concurrent.futures import ThreadPoolExecutor

    server = grpc.server(ThreadPoolExecutor(max_workers=workers), interceptors=interceptors, options=options)
    store_pb2_grpc.add_KVStoreServicer_to_server(KVStoreServicer(store), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if tls_cert or tls_key:
        if not (tls_cert and tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        creds = grpc.ssl_server_credentials([(tls_key.read_bytes(), tls_cert.read_bytes())])
        port = server.add_secure_port(listen, creds)
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, port, health_servicer


def server_args(prog: str, description: str) -> argparse.ArgumentParser:
    """The arguments every store server takes (ours and the LMCache sidecar)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--listen", default="127.0.0.1:50051", help="HOST:PORT (port 0 picks a free one)")
    p.add_argument("--auth-token-file", type=Path, help="file holding the bearer token clients must send")
    p.add_argument("--tls-cert", type=Path)
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--port-file", type=Path, help="write the bound port here once serving")
    p.add_argument("--grace-s", type=float, default=5.0, help="drain time on SIGTERM")
    return p


def serve(args: argparse.Namespace, store: ByteStore, what: str) -> int:
    """Serve ``store`` until SIGTERM/SIGINT, then drain in-flight calls and exit 0."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    token = args.auth_token_file.read_text().strip() if args.auth_token_file else None
    if args.auth_token_file and not token:
        raise SystemExit(f"{args.auth_token_file} is empty")
    server, port, health_servicer = build_server(args.listen, store, token, args.tls_cert, args.tls_key)
    server.start()
    host = args.listen.rpartition(":")[0]
    log.info(
        "%s serving on %s:%d (auth %s, tls %s)",
        what,
        host,
        port,
        "on" if token else "off",
        "on" if args.tls_cert else "off",
    )
    if args.port_file:
        args.port_file.write_text(str(port))
    stopping = threading.Event()

    def stop(signum, frame):
        if stopping.is_set():
            return
        stopping.set()
        log.info("signal %d: draining for up to %.1f s", signum, args.grace_s)
        health_servicer.enter_graceful_shutdown()
        server.stop(args.grace_s)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.wait_for_termination()
    store.close()
    log.info("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = server_args("python -m remote_store.server", __doc__)
    p.add_argument("--capacity-bytes", type=int, default=1 << 30, help="LRU capacity (0: unbounded)")
    p.add_argument(
        "--pin-ttl-s",
        type=float,
        default=DEFAULT_PIN_TTL_S,
        help="a pin's lease: a client that never unpins (it died) holds records no longer than this",
    )
    args = p.parse_args(argv)
    return serve(
        args,
        MemoryStore(args.capacity_bytes, pin_ttl_s=args.pin_ttl_s),
        f"store (capacity {args.capacity_bytes} bytes, pins lease {args.pin_ttl_s:g} s)",
    )


if __name__ == "__main__":
    sys.exit(main())
