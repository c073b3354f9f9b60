"""``vericache rag-client | sglang-client | health``: the demo cluster's clients and its health check."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_client_commands(sub: argparse._SubParsersAction) -> None:
    """``rag-client``, ``sglang-client`` and ``health`` under ``vericache``'s subcommands."""
    p = sub.add_parser(
        "rag-client",
        help="the demo cluster's client: shared documents, questions about them, "
        "acceptance, time to first token, identity with full-KV decoding",
    )
    p.add_argument("--servers", required=True, help="comma-separated server URLs (http://HOST:PORT)")
    p.add_argument("--documents", type=Path, nargs="+", required=True, help="text files, one document each")
    p.add_argument("--question", action="append", help="a question to ask about every document (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--doc-chars", type=int, default=2500, help="characters of each file used as its document")
    p.add_argument("--wait-s", type=float, default=300.0, help="how long to wait for servers and documents")
    p.add_argument("--api-key-file", type=Path)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_rag_client)
    p = sub.add_parser(
        "sglang-client",
        help="the demo cluster's SGLang client: questions about shared documents "
        "to an SGLang server with --enable-vericache, checked against full-KV "
        "decoding here",
    )
    p.add_argument("--server", required=True, help="the SGLang server's or its router's URL (http://HOST:PORT)")
    p.add_argument(
        "--workers",
        nargs="+",
        default=(),
        help="the servers behind the router: each is also asked about every document directly",
    )
    p.add_argument("--documents", type=Path, nargs="+", required=True, help="text files, one document each")
    p.add_argument("--question", action="append", help="a question to ask about every document (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--doc-chars", type=int, default=2500, help="characters of each file used as its document")
    p.add_argument("--wait-s", type=float, default=900.0, help="how long to wait for the server")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.set_defaults(func=cmd_sglang_client)
    p = sub.add_parser("health", help="exit 0 when every URL's service answers (http, grpc, lmcache, redis)")
    p.add_argument("urls", nargs="+")
    p.set_defaults(func=cmd_health)


def cmd_health(args: argparse.Namespace) -> int:
    from remote_store.health import main

    return main(args.urls)


def cmd_rag_client(args: argparse.Namespace) -> int:
    from vericache_sglang.serve import rag_client

    key = args.api_key_file.read_text().strip() if args.api_key_file else None
    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    summary = rag_client.run(
        args.servers.split(","),
        args.documents,
        tuple(args.question or rag_client.QUESTIONS),
        args.max_tokens,
        args.doc_chars,
        key,
        args.wait_s,
        log,
    )
    if args.json:
        print(json.dumps(summary))
    ok = summary["identical"] and summary["every_server_served_shared_documents"]
    return 0 if ok else 1


def cmd_sglang_client(args: argparse.Namespace) -> int:
    from vericache_sglang.serve import rag_client, sglang_client

    log = (lambda s: print(s, file=sys.stderr)) if args.json else print
    summary = sglang_client.run(
        args.server,
        args.documents,
        tuple(args.question or rag_client.QUESTIONS),
        args.max_tokens,
        args.doc_chars,
        args.wait_s,
        log,
        tuple(args.workers),
    )
    if args.json:
        print(json.dumps(summary))
    ok = summary["identical"] and summary["later_questions_cached"]
    return 0 if ok and summary["every_document_from_the_store"] in (None, True) else 1
