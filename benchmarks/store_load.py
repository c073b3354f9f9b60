"""Store load and bandwidth: several processes write and read full-KV-sized records on loopback.

Every record's bytes are derived from its key, so each read is checked: a lost record (missing when
it must exist) or a mixed-up one (other bytes) is counted as an error. A worker pins what it
writes, as the engine pins an in-flight request's chunks, so a full store must refuse new writes
(counted apart) rather than evict them. Also measures GB/s per backend (write and layer-grouped
read), which the README quotes.

    python benchmarks/store_load.py --url grpc://:TOKEN@127.0.0.1:50051 --procs 4 --seconds 10
    python benchmarks/store_load.py --bandwidth --urls memory:// redis://127.0.0.1:6379/0 grpc://...

Loads are bounded in count and time and go only to the URLs given (loopback).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import random
import sys
import time
from pathlib import Path

RECORD_BYTES = 98_368  # one SmolLM2 chunk-layer record: 64 tokens x 3 heads x 64 dims x fp32 x K,V + header
LAYERS = 30


def payload(key: str, size: int = RECORD_BYTES) -> bytes:
    seed = hashlib.blake2b(key.encode(), digest_size=8).digest()
    block = hashlib.blake2b(seed, digest_size=64).digest()
    return (block * (size // 64 + 1))[:size]


def worker(url: str, run: str, wid: int, ops: int, seconds: float, out: mp.Queue) -> None:
    from remote_store import StoreError, open_store

    store = open_store(url)
    rng = random.Random(wid)
    mine: list[str] = []
    shared = [f"load:{run}:shared:{i}" for i in range(8)]
    errors, moved, done, refused = [], 0, 0, 0
    deadline = time.monotonic() + seconds
    while done < ops and time.monotonic() < deadline:
        if rng.random() < 0.4 or not mine:
            keys = [f"load:{run}:{wid}:{done}:{i}" for i in range(LAYERS)]
            if rng.random() < 0.2:
                keys = shared  # every process writes the same keys with the same bytes
            store.pin(keys)
            try:
                store.put_many([(k, payload(k)) for k in keys])
            except StoreError:
                refused += 1  # the store is full of pinned records: a clear refusal, nothing lost
                store.unpin(keys)
                done += 1
                continue
            if keys is not shared:
                mine += keys
            else:
                store.unpin(keys)
            moved += RECORD_BYTES * len(keys)
        else:
            keys = rng.sample(mine, min(LAYERS, len(mine)))
            for _group in store.stream_get([keys[i::3] for i in range(3)]):
                pass
            values = store.get_many(keys)
            for k, v in zip(keys, values, strict=True):
                if v is None:
                    errors.append(f"lost {k}")
                elif v != payload(k):
                    errors.append(f"mixed up {k}")
            moved += sum(len(v) for v in values if v is not None)
        done += 1
    final = store.get_many(mine)
    errors += [f"lost {k}" for k, v in zip(mine, final, strict=True) if v is None]
    errors += [f"mixed up {k}" for k, v in zip(mine, final, strict=True) if v is not None and v != payload(k)]
    store.unpin(mine)
    store.delete_many(mine)
    out.put(
        {
            "worker": wid,
            "ops": done,
            "bytes": moved,
            "errors": errors[:20],
            "n_errors": len(errors),
            "records": len(mine),
            "refused": refused,
        }
    )


def load(url: str, procs: int = 4, ops: int = 200, seconds: float = 10.0) -> dict:
    run = f"{time.time_ns():x}"
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    started = time.monotonic()
    workers = [ctx.Process(target=worker, args=(url, run, i, ops, seconds, out)) for i in range(procs)]
    for w in workers:
        w.start()
    results = [out.get(timeout=seconds + 120) for _ in workers]
    for w in workers:
        w.join(30)
    elapsed = time.monotonic() - started
    return {
        "url": url.split("@")[-1],
        "procs": procs,
        "ops": sum(r["ops"] for r in results),
        "errors": sum(r["n_errors"] for r in results),
        "examples": [e for r in results for e in r["errors"]][:10],
        "refused_writes": sum(r["refused"] for r in results),
        "gb_s": sum(r["bytes"] for r in results) / elapsed / 1e9,
        "seconds": elapsed,
        "exit_codes": [w.exitcode for w in workers],
    }


def bandwidth(url: str, rounds: int = 5, chunks: int = 36) -> dict:
    """Single-client GB/s: write then read a 2,304-token SmolLM2 full KV (36 chunks x 30 layers)."""
    from remote_store import open_store

    store = open_store(url)
    run = f"bw:{time.time_ns():x}"
    groups = [[f"{run}:{c}:{layer}" for c in range(chunks)] for layer in range(LAYERS)]
    items = [(k, payload(k)) for g in groups for k in g]
    total = len(items) * RECORD_BYTES
    writes, reads = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        store.put_many(items)
        writes.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = sum(len(v) for g in store.stream_get(groups) for v in g if v is not None)
        reads.append(time.perf_counter() - t)
        assert got == total, f"read {got} of {total} bytes"
    store.delete_many([k for k, _ in items])
    med = lambda xs: sorted(xs)[len(xs) // 2]
    return {
        "url": url.split("@")[-1].split("?")[0],
        "bytes": total,
        "write_gb_s": total / med(writes) / 1e9,
        "read_gb_s": total / med(reads) / 1e9,
    }


def _label(url: str) -> str:
    scheme = url.split("://")[0]
    return {
        "memory": "memory:// (in-process: records are referenced, not copied)",
        "redis": "redis:// (redis-server 7.0, loopback)",
        "grpc": "grpc:// (our store server, loopback)",
    }.get(scheme, scheme)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="load test this store")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--ops", type=int, default=200)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--bandwidth", action="store_true", help="measure GB/s of each --urls store")
    p.add_argument("--urls", nargs="*", default=[])
    p.add_argument("--out", type=Path, help="write JSON and a markdown table here")
    args = p.parse_args()
    if args.bandwidth:
        rows = [bandwidth(u) for u in args.urls]
        table = ["| store | write GB/s | read GB/s (layer-grouped) |", "|---|---:|---:|"]
        table += [
            f"| {_label(u)} | {r['write_gb_s']:.2f} | {r['read_gb_s']:.2f} |"
            for u, r in zip(args.urls, rows, strict=True)
        ]
        print("\n".join(table))
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "store_bandwidth.json").write_text(json.dumps(rows, indent=2))
            (args.out / "store_bandwidth.md").write_text("\n".join(table) + "\n")
        return 0
    result = load(args.url, args.procs, args.ops, args.seconds)
    print(json.dumps(result, indent=2))
    return 0 if result["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
