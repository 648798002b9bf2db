"""The OpenAI-compatible wire format: request models (pydantic), response bodies, error bodies.

Requests follow OpenAI's `/v1/completions` and `/v1/chat/completions`; the fields this server
does not implement are refused with a 400 when set to anything but their neutral value, never
silently ignored. Extensions (as in vLLM): `top_k`, `ignore_eos`, and `block_size` (an int or
"auto": the draft block size; default the runner's, i.e. the predictor's choice when one is
loaded). Responses carry the extension field `blockpilot` with the request's block size, tau and
verify steps.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class APIError(Exception):
    """An error answered with an OpenAI-style body `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Sampling(BaseModel):
    """Fields shared by both endpoints."""

    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    ignore_eos: bool = False
    block_size: int | Literal["auto"] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "logit_bias", "tools", "functions",
               "tool_choice", "response_format")
"""Request fields refused when set to a value other than null/false/empty."""


def check_supported(request: _Sampling) -> None:
    """Raise `APIError` 400 for what this server does not do (n > 1, penalties, logprobs, ...)."""
    if request.n != 1:
        raise APIError(400, f"n={request.n} is not supported; this server returns one choice (n=1)", param="n")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(request, name):
            raise APIError(400, f"{name} is not supported (speculative decoding here is lossless "
                           "sampling from the target); leave it at 0", param=name)
    for name in UNSUPPORTED:
        if (request.model_extra or {}).get(name) not in (None, False, [], {}, 0):
            raise APIError(400, f"{name} is not supported by this server; drop it", param=name)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]  # OpenAI's; others are answered 400
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The content as one string (text parts of a list joined)."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise APIError(400, f"content part of type {part.get('type')!r} is not supported; "
                               "send text", param="messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def token_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def extension(result) -> dict:
    """The `blockpilot` field: the block size the request ran at, its tau, its verify steps."""
    return {"block_size": result.block_size, "tau": round(result.tau, 4), "steps": len(result.accept_lengths),
            "block_size_prob": result.block_size_prob}
