"""Is a service up? ``python -m remote_store.health URL [URL ...]`` exits 0 when every one answers.

``http(s)://HOST:PORT`` (a VeriCache server: ``GET /health``), ``grpc(s)://`` and ``lmcache://``
(our store server and the LMCache sidecar: the standard gRPC health check), ``redis://`` (PING),
``redis-cluster://`` (the cluster's state is ok).
Used by docker-compose.yml's health checks and by ``deploy/cluster.py``, which runs the same
topology without Docker.
"""

from __future__ import annotations

import sys
import urllib.request
from urllib.parse import urlsplit

PROBE_TIMEOUT_S = 3.0


def probe(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Return when ``url``'s service answers healthy; raise otherwise."""
    parts = urlsplit(url)
    if parts.scheme in ("http", "https"):
        with urllib.request.urlopen(f"{parts.scheme}://{parts.netloc}/health", timeout=timeout_s) as r:
            if r.status != 200:
                raise RuntimeError(f"{url}: /health answered {r.status}")
    elif parts.scheme in ("grpc", "grpcs", "lmcache"):
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        target = f"{parts.hostname}:{parts.port}"
        channel = (
            grpc.insecure_channel(target)
            if parts.scheme != "grpcs"
            else grpc.secure_channel(target, grpc.ssl_channel_credentials())
        )
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"{url}: health status {reply.status}")
    elif parts.scheme in ("redis", "rediss"):
        import redis

        redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s).ping()
    elif parts.scheme in ("redis-cluster", "rediss-cluster"):
        import redis

        target = url.replace("-cluster://", "://", 1)
        cluster = redis.RedisCluster.from_url(target, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        if cluster.cluster_info().get("cluster_state") != "ok":
            raise RuntimeError(f"{url}: cluster state is not ok")
    else:
        raise ValueError(
            f"cannot probe {url!r}: expected http(s)://, grpc(s)://, lmcache://, redis:// or redis-cluster://"
        )


def main(argv: list[str] | None = None) -> int:
    urls = sys.argv[1:] if argv is None else argv
    if not urls:
        print("usage: python -m remote_store.health URL [URL ...]", file=sys.stderr)
        return 2
    for url in urls:
        try:
            probe(url)
        except Exception as e:
            print(f"unhealthy: {url}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
