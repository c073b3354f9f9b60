"""The OpenAI-compatible API's request bodies (``openai_api``), strict: an unknown field, a value
of the wrong type, out of range or not finite is a 400 naming the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_STRICT = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class VeriCacheOptions(BaseModel):
    model_config = _STRICT
    compressor: str | None = None
    horizon: int | None = None
    adaptive_horizon: bool = False
    check: bool = False  # also decode with the full KV and report the comparison (slow: a full decode)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = True  # the last chunk carries usage either way


class GenerationRequest(BaseModel):
    """The fields completions and chat share."""

    model_config = _STRICT
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    seed: int | None = Field(None, ge=0, lt=1 << 63)
    stop: str | list[str] | None = Field(None, max_length=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1)
    user: str | None = Field(None, max_length=256)  # an end-user id: accepted, not used
    vericache: VeriCacheOptions = Field(default_factory=VeriCacheOptions)
    # refused unless neutral (REFUSED)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=1)  # the chosen tokens' log-probabilities only
    echo: bool = False
    best_of: int = Field(1, ge=1)
    suffix: str | None = None


class DocumentRequest(BaseModel):
    model_config = _STRICT
    name: str | None = None
    text: str | None = None
    role: str = "system"  # the chat-template segment it is rendered as; "raw": plain text tokens
    token_ids: list[int] | None = None


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None  # None only for an assistant turn that made tool calls
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (OpenAI's shape)
    tool_call_id: str | None = None  # a tool turn's answer to one


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)
