"""The OpenAI-compatible HTTP API: ``/v1/completions``, ``/v1/chat/completions`` (both streaming),
``/v1/models``, ``/health``, Prometheus ``/metrics``, and ``/v1/prefixes`` (shared documents:
register, list, remove). Field names follow OpenAI and, where it
adds some (``top_k``), SGLang; per-request VeriCache options go in a ``vericache`` object
(``compressor``, ``horizon``, ``adaptive_horizon``) and every response carries the request's
verification statistics under ``vericache``. Streamed text only ever holds verified tokens, and
is held back where it could still turn out to be part of a stop string.

Every request field is honoured or refused: an unknown field, a value of the wrong type, out of
range or not finite, and a field this server does not implement yet (``REFUSED``) are 400s naming
the field; a body over ``max_body_bytes`` is a 413 before anything parses it."""

from __future__ import annotations

import hmac
import json
import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from vericache_sglang.core.sampling import SamplingParams
from vericache_sglang.engine.constraint import Constraint, ConstraintError
from vericache_sglang.engine.generation import GenerationResult
from vericache_sglang.engine.prefix import document_tokens
from vericache_sglang.serve.protocol import ChatRequest, CompletionRequest, DocumentRequest, GenerationRequest
from vericache_sglang.serve.service import EngineService, Handle, ServeError
from vericache_sglang.serve.tools import ToolError, ToolPrompt, check_tools, required_function, tool_format

STREAM_IDLE_S = 600.0  # a stream with no event for this long ends with an error
MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused before it is parsed
# OpenAI fields this server does not implement yet, with their neutral values: a request that sets
# one to anything else is refused with a 400 naming it (never silently ignored).
REFUSED = {
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "functions": None,
    "function_call": None,
    "top_logprobs": 0,
    "echo": False,
    "best_of": 1,
    "suffix": None,
}
TOOL_FIELDS = {"tools": None, "tool_choice": None, "parallel_tool_calls": None}  # chat only


def _error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def vericache_stats(handle: Handle, result: GenerationResult) -> dict[str, Any]:
    s = result.stats
    return {
        "compressor": handle.compressor,
        "horizon": handle.horizon,
        "prefix_tokens": handle.prefix_tokens,
        "document": handle.prefix_name,
        "verify_passes": s.verify_passes,
        "mean_accepted_length": s.mean_accepted_length,
        "acceptance_rate": s.acceptance_rate,
        "full_kv_bytes_fetched": sum(s.fetch_bytes),
        "link_wait_s": s.fetch_wait_s,
        "store_fallbacks": s.store_fallbacks,
        "decode_tokens_per_second": result.tokens_per_second,
        "check": handle.check,
    }


class TextDeltas:
    """Streamed text: what the verified tokens spell, minus a tail that could begin a stop string."""

    def __init__(self, tokenizer: object, stop: tuple[str, ...]):
        self.tokenizer, self.tokens, self.sent = tokenizer, [], ""
        self.hold = max((len(s) for s in stop), default=1) - 1

    def push(self, tokens: list[int]) -> str:
        self.tokens += tokens
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        safe = text[: max(0, len(text) - self.hold)].rstrip("\ufffd")  # never half a character
        if not safe.startswith(self.sent) or len(safe) <= len(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent) :], safe
        return delta

    def finish(self, final: str) -> str:
        return final[len(self.sent) :] if final.startswith(self.sent) else ""


class BodyLimit:
    """ASGI middleware: a request body over ``max_bytes`` is answered 413 before any of it is parsed,
    by its Content-Length or, without one, as it streams in (the body is read here, up to the limit,
    and handed on whole)."""

    def __init__(self, app: Any, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                return await self._refuse(scope, receive, send)
        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)

    async def _refuse(self, scope: dict, receive: Any, send: Any) -> None:
        await _error(413, f"the request body is over {self.max_bytes} bytes", param="body")(scope, receive, send)


def _refused_fields(req: BaseModel) -> list[str]:
    refused = REFUSED if isinstance(req, ChatRequest) else {**REFUSED, **TOOL_FIELDS}
    return [
        name
        for name, neutral in refused.items()
        if name in req.model_fields_set and getattr(req, name, neutral) not in (neutral, None)
    ]


def create_app(
    service: EngineService, model_name: str, api_key: str | None = None, max_body_bytes: int = MAX_BODY_BYTES
) -> FastAPI:
    app = FastAPI(title="VeriCache", version="0.1")
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    tokenizer = service.engine.tokenizer

    @app.exception_handler(ServeError)
    async def _serve_error(_: Request, e: ServeError) -> JSONResponse:
        return _error(e.status, e.message, e.kind, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:])
        return _error(400, f"{where}: {first.get('msg', 'invalid request')}", param=where or None)

    @app.middleware("http")
    async def _auth(request: Request, call_next: Any) -> Response:
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(401, "missing or wrong API key (Authorization: Bearer ...)", "authentication_error")
        return await call_next(request)

    @app.get("/health")
    def health() -> JSONResponse:
        if not service.alive:
            return _error(503, "the engine thread is not running", "server_error")
        return JSONResponse({"status": "ok", "model": model_name})

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    def models() -> dict:
        return {
            "object": "list",
            "data": [{"id": model_name, "object": "model", "owned_by": "vericache", "created": 0}],
        }

    def constraint_of(req: GenerationRequest) -> Constraint | None:
        fmt = req.response_format
        if fmt is None or fmt.get("type") == "text":
            return None
        try:
            return service.engine.constraint(fmt)
        except ConstraintError as e:
            raise ServeError(400, str(e), param="response_format") from None

    def submit(
        req: GenerationRequest, tokens: list[int], max_tokens: int | None, constraint: Constraint | None = None
    ) -> tuple[Handle, tuple[str, ...]]:
        refused = _refused_fields(req)
        if refused:
            raise ServeError(400, f"{refused[0]} is not supported by this server yet", param=refused[0])
        if req.n != 1:
            raise ServeError(400, "n > 1 is not supported", param="n")
        if req.model not in (None, model_name):
            raise ServeError(
                404,
                f"model {req.model!r} is not served here; this server serves {model_name!r}",
                "not_found_error",
                "model",
            )
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        try:
            sampling = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p, seed=req.seed or 0)
        except ValueError as e:
            raise ServeError(400, str(e)) from None
        v = req.vericache
        handle = service.submit(
            tokens,
            max_new_tokens=16 if max_tokens is None else max_tokens,
            sampling=sampling,
            stop=stop,
            compressor=v.compressor,
            horizon=v.horizon,
            adaptive_horizon=v.adaptive_horizon,
            logprobs=bool(req.logprobs),
            check=v.check,
            constraint=constraint,
        )
        return handle, stop

    def wait(handle: Handle) -> GenerationResult:
        for kind, value in handle.stream(STREAM_IDLE_S):
            if kind == "done":
                return value
            if kind == "error":
                raise ServeError(500, f"request failed; no unverified token was returned: {value}", "server_error")
        raise AssertionError("unreachable")

    def usage(handle: Handle, result: GenerationResult) -> dict:
        return {
            "prompt_tokens": handle.prompt_tokens,
            "completion_tokens": len(result.tokens),
            "total_tokens": handle.prompt_tokens + len(result.tokens),
        }

    def sse(chunks: Iterator[dict]) -> StreamingResponse:
        def body() -> Iterator[str]:
            for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    def events(handle: Handle, stop: tuple[str, ...], make: Any) -> Iterator[dict]:
        """Chunks for a stream; ``make(text, finish_reason, extra)`` builds one."""
        deltas = TextDeltas(tokenizer, stop)
        for kind, value in handle.stream(STREAM_IDLE_S):
            if kind == "tokens":  # one chunk per verification: its verified token ids, and the text they add
                chunk = make(deltas.push(value), None, {})
                chunk["choices"][0]["token_ids"] = value
                yield chunk
            elif kind == "done":
                yield make(
                    deltas.finish(value.text),
                    value.finish_reason,
                    {"usage": usage(handle, value), "vericache": vericache_stats(handle, value)},
                )
            else:
                yield {
                    "error": {
                        "message": f"request failed; no unverified token was returned: {value}",
                        "type": "server_error",
                        "code": 500,
                    }
                }

    @app.get("/v1/prefixes")
    def documents() -> dict:
        return {"object": "list", "data": service.documents()}

    @app.post("/v1/prefixes")
    def add_document(req: DocumentRequest) -> dict:
        """Register a shared document (RAG): its full KV goes to the store, listed for every server."""
        if (req.text is None) == (req.token_ids is None):
            raise ServeError(400, "give the document as text or as token_ids (one of them)", param="text")
        if req.token_ids is not None:
            tokens = req.token_ids
            vocab = service.engine.runner.vocab_size
            if any(not 0 <= t < vocab for t in tokens):
                raise ServeError(400, f"token ids must be in [0, {vocab})", param="token_ids")
        else:
            try:
                tokens = document_tokens(tokenizer, req.text, req.role)
            except ValueError as e:
                raise ServeError(400, str(e), param="role") from None
        prefix = service.register_document(tokens, req.name)
        return {
            "object": "document",
            "digest": prefix.digest,
            "name": prefix.name,
            "tokens": len(prefix.tokens),
            "submitted_tokens": len(tokens),
            "compressor": prefix.compressor.spec,
            "compressed_kv_bytes": prefix.compressed_kv_bytes,
            "full_kv_bytes": prefix.full_kv_bytes,
            "seconds": prefix.seconds,
        }

    @app.delete("/v1/prefixes/{digest}")
    def remove_document(digest: str) -> dict:
        if not service.remove_document(digest):
            raise ServeError(404, f"no document {digest} is listed", "not_found_error", "digest")
        return {"object": "document.deleted", "digest": digest, "deleted": True}

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> Any:
        if isinstance(req.prompt, str):
            if tokenizer is None:
                raise ServeError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
            tokens = list(tokenizer(req.prompt)["input_ids"])
        else:
            tokens = list(req.prompt)
        handle, stop = submit(req, tokens, req.max_tokens, constraint_of(req))
        created = int(time.time())

        def chunk(text: str, finish: str | None, extra: dict) -> dict:
            return {
                "id": handle.id,
                "object": "text_completion",
                "created": created,
                "model": model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
                **extra,
            }

        if req.stream:
            return sse(events(handle, stop, chunk))
        result = wait(handle)
        body = chunk(
            result.text,
            result.finish_reason,
            {"usage": usage(handle, result), "vericache": vericache_stats(handle, result)},
        )
        if result.logprobs is not None:
            body["choices"][0]["logprobs"] = {
                "tokens": [tokenizer.decode([t]) if tokenizer else str(t) for t in result.tokens],
                "token_logprobs": result.logprobs,
            }
        body["choices"][0]["token_ids"] = result.tokens
        return body

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest) -> Any:
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise ServeError(400, "this model has no chat template: use /v1/completions")
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        for i, m in enumerate(messages):
            if m.get("content") is None and not (m["role"] == "assistant" and m.get("tool_calls")):
                raise ServeError(400, f"messages.{i}.content is missing", param=f"messages.{i}.content")
            if m["role"] == "tool" and not m.get("tool_call_id"):
                raise ServeError(
                    400,
                    f"messages.{i}.tool_call_id is missing: a tool turn answers a call",
                    param=f"messages.{i}.tool_call_id",
                )
        for field in ("tool_choice", "parallel_tool_calls"):
            if getattr(req, field) is not None and not req.tools:
                raise ServeError(400, f"{field} is given without tools", param=field)
        try:
            tools, constraint = render_tools(req, messages)
        except ToolError as e:
            raise ServeError(400, str(e), param=e.param) from None
        if tools is None:
            constraint = constraint_of(req)
        tokens = list(
            tokenizer.apply_chat_template(
                messages if tools is None else tools.messages,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
            )["input_ids"]
        )
        handle, stop = submit(req, tokens, req.max_completion_tokens or req.max_tokens, constraint)
        created = int(time.time())

        def chunk(text: str, finish: str | None, extra: dict) -> dict:
            return {
                "id": handle.id.replace("cmpl", "chatcmpl"),
                "object": "chat.completion.chunk",
                "created": created,
                "model": model_name,
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": finish}],
                **extra,
            }

        if req.stream:
            return sse(events(handle, stop, chunk))
        result = wait(handle)
        logprobs = None
        if result.logprobs is not None:  # the verifier's log-probabilities (OpenAI's chat shape)
            logprobs = {
                "content": [
                    {"token": tokenizer.decode([t]), "logprob": lp, "token_id": t}
                    for t, lp in zip(result.tokens, result.logprobs, strict=True)
                ]
            }
        message: dict[str, Any] = {"role": "assistant", "content": result.text}
        finish = result.finish_reason
        if tools is not None and tools.calls:
            content, calls = tools.format.parse(result.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": [c.to_openai() for c in calls]}
                finish = "tool_calls" if finish == "stop" else finish
        return {
            "id": handle.id.replace("cmpl", "chatcmpl"),
            "object": "chat.completion",
            "created": created,
            "model": model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}],
            "usage": usage(handle, result),
            "vericache": vericache_stats(handle, result),
        }

    def render_tools(req: ChatRequest, messages: list[dict]) -> tuple[ToolPrompt | None, Constraint | None]:
        """The conversation in the model's tool-call format when the request has tools (or tool
        turns), and the grammar of a required call."""
        history = any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
        if not req.tools and not history:
            return None, None
        fmt = tool_format(getattr(tokenizer, "chat_template", None))
        if req.tools:
            check_tools(req.tools)
        if req.stream:
            raise ToolError("streamed tool calls are not supported yet; send tools with stream false", "stream")
        if req.response_format is not None and req.response_format.get("type") != "text":
            raise ToolError("tools and response_format constrain the answer twice; send one of them", "response_format")
        tools = list(req.tools or [])
        required, name = required_function(tools, req.tool_choice) if tools else (False, None)
        constraint = None
        if required:
            grammar = fmt.grammar(tools, name, single=req.parallel_tool_calls is False)
            constraint = service.engine.constraint(grammar=grammar)
        return ToolPrompt(fmt, fmt.render(messages, tools), calls=bool(tools) and req.tool_choice != "none"), constraint

    return app
