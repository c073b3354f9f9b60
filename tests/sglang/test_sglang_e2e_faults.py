"""What goes wrong, through SGLang's own launcher and servers: configurations the plugin refuses
(the launch fails fast, says why, and leaves no process behind) and a full-KV store that dies
mid-generation (nothing unverified is streamed, the server stays healthy and serves correctly once
the store is back)."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
from services import StoreServer, free_port
from sglang_e2e import compare_answers, prompt

from vericache_sglang.bench.sglang_server import (
    REPO,
    Ask,
    SGLangServer,
    ask,
    ask_all,
    cpu_env,
    group_alive,
    launch_command,
)

pytestmark = [pytest.mark.sglang]

BAD = [
    (
        "unknown compressor",
        ["--enable-vericache", "--vericache-config", json.dumps({"compressor": "zipper"})],
        "unknown compressor 'zipper'",
    ),
    (
        "horizon 0",
        ["--enable-vericache", "--vericache-config", json.dumps({"horizon": 0})],
        "horizon must be in [1, 64], got 0",
    ),
    (
        "EAGLE with VeriCache",
        ["--enable-vericache", "--speculative-algorithm", "EAGLE"],
        "--enable-vericache sets --speculative-algorithm 'VERICACHE', but --speculative-algorithm 'EAGLE' was given",
    ),
    (
        "a query-aware sparse compressor",
        ["--enable-vericache", "--vericache-config", json.dumps({"compressor": "quest"})],
        "is a sparse compressor; the SGLang worker drafts over token droppers and quantizers",
    ),
    (
        "an attention backend VeriCache cannot verify with",
        [
            "--enable-vericache",
            "--prefill-attention-backend",
            "torch_native",
            "--decode-attention-backend",
            "flex_attention",
        ],
        "VeriCache needs one attention backend",
    ),
]


def _launch(args: list[str]) -> tuple[int, str, bool]:
    proc = subprocess.Popen(
        launch_command(free_port(), *args),
        cwd=REPO,
        env=cpu_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return -1, out, True
    time.sleep(1)
    return proc.returncode, out, group_alive(proc.pid)


# Through the launcher: one case in the default set (each message is checked in process for every
# case, tests/sglang/test_sglang_plugin.py), all of them in the heavy set.
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(case, id=case[0].replace(" ", "-"), marks=() if i == 0 else pytest.mark.slow)
        for i, case in enumerate(BAD)
    ],
)
def test_bad_configurations_fail_the_launch_fast_saying_why_and_leave_nothing_behind(case):
    what, args, message = case
    started = time.monotonic()
    code, out, left = _launch(args)
    assert code not in (0, -1), f"{what}: the launch did not fail ({code})"
    assert message in out, f"{what}: {out[-3000:]}"
    assert not left, f"{what}: processes left behind"
    assert time.monotonic() - started < 240


@pytest.mark.real_model
@pytest.mark.slow
def test_a_store_that_dies_mid_generation_never_costs_a_verified_token(stock_server, sglang_logs, tmp_path, exactness):
    """``full_kv: "store"``, the full KV only in the store: killed mid-stream, the fetches fail and
    the request's positions are recomputed from its committed tokens before each verification, the
    writes fail and its new positions stay on the device; every token streamed is still stock
    SGLang's, both counted. The server serves correctly after the store returns (empty) and
    writes to it again."""
    store = StoreServer(tmp_path)
    config = {"compressor": "snapkv:ratio=0.125", "horizon": 8, "full_kv": "store", "store": store.url}
    server = SGLangServer(sglang_logs, "snapkv-store-faults", vericache=config)
    try:
        q = Ask(prompt("prose"), "completion", stream=True, max_tokens=96)
        expected = ask(stock_server, q)
        client = server.client()
        text, killed = "", False
        for chunk in client.completions.create(
            model="default", prompt=q.prompt, max_tokens=q.max_tokens, stream=True, temperature=0.0
        ):
            text += chunk.choices[0].text
            if not killed and len(text) > 40:
                store.kill()
                killed = True
        assert killed and text == expected.text, (text, expected.text)
        down = server.metrics()
        assert down["vericache_store_errors_total"] > 0 and down["vericache_full_kv_recomputes_total"] > 0
        store.start()  # back, empty
        after = ask(server, Ask(prompt("code"), "chat", max_tokens=48))
        cmp = compare_answers(ask(stock_server, Ask(prompt("code"), "chat", max_tokens=48)), after)
        exactness("sglang store fault, request after the store returned", cmp)
        assert cmp["identical"]
        up = server.metrics()
        assert up["vericache_full_kv_written_bytes_total"] > down["vericache_full_kv_written_bytes_total"]
        assert server.alive()
    finally:
        server.stop()
        store.stop()


@pytest.mark.real_model
@pytest.mark.slow
def test_retracted_and_aborted_requests_leave_the_others_exact(stock_server, sglang_logs, exactness):
    """SGLang retracts running requests when its pool runs short (they prefill again later, from
    scratch): its own test switch (``SGLANG_TEST_RETRACT``) makes it retract every few steps here. A
    client that walks away mid-stream aborts its request. Every answer that completes is stock
    SGLang's, and the server keeps serving."""
    server = SGLangServer(
        sglang_logs,
        "snapkv-retracting",
        vericache={"compressor": "snapkv:ratio=0.125", "horizon": 8},
        env={"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "7"},
    )
    try:
        load = [
            Ask(prompt(name, 1000), kind, max_tokens=96)
            for name, kind in (("prose", "completion"), ("code", "completion"), ("tools", "completion"))
        ]
        client = server.client()
        stream = client.completions.create(
            model="default", prompt=prompt("prose", 1400), max_tokens=200, stream=True, temperature=0.0
        )
        for i, _ in enumerate(stream):
            if i == 5:
                stream.close()  # the client leaves: SGLang aborts the request
                break
        expected = ask_all(stock_server, load)
        got = ask_all(server, load)
        for q, ref, out in zip(load, expected, got, strict=True):
            cmp = compare_answers(ref, out)
            exactness(f"sglang retractions {q.label()}", cmp)
            assert cmp["identical"], (ref.text, out.text)
        m = server.metrics()
        assert m.get("sglang:num_retracted_requests_total", 0) > 0, "the load did not make SGLang retract"
        after = ask(server, Ask("Say hello.", "chat", max_tokens=16))
        assert after.text == ask(stock_server, Ask("Say hello.", "chat", max_tokens=16)).text
    finally:
        server.stop()
