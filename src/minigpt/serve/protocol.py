"""OpenAI's API as this server speaks it: the request bodies it accepts (checked field by field, so a mistake
is one error naming the field), the error object every refusal is, and the response and stream-chunk objects.

Fields OpenAI's API has and this server does not use (`user`, `logprobs` false, `presence_penalty` 0, ...) are
accepted and ignored where ignoring them changes nothing; `top_k` is an extension, as in vLLM.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class APIError(Exception):
    """A refused request: its HTTP status and OpenAI's error object (`body`)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class TextPart(BaseModel):
    """A message's content given as parts: only text parts are read."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class Sampling(BaseModel):
    """What both endpoints take: the model, sampling, budget, stops, streaming, and how many choices."""

    model_config = ConfigDict(extra="ignore", strict=False)
    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_tokens: int | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=16)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("at most 4 stop sequences, none empty")
        return value

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def budget(self) -> int | None:
        return self.max_tokens


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, gt=0)

    def budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, gt=0)  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and not value:
            raise ValueError("give at least one prompt")
        return value

    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def chat_response(rid: str, model: str, texts: list[tuple[str, str]], use: dict) -> dict:
    """A chat.completion: one choice per (text, finish reason)."""
    choices = [
        {"index": i, "message": {"role": "assistant", "content": t}, "logprobs": None, "finish_reason": f}
        for i, (t, f) in enumerate(texts)
    ]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}  # fmt: skip


def completion_response(rid: str, model: str, texts: list[tuple[str, str]], use: dict) -> dict:
    choices = [
        {"index": i, "text": t, "logprobs": None, "finish_reason": f} for i, (t, f) in enumerate(texts)
    ]
    return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": choices, "usage": use}  # fmt: skip


def chunk(rid: str, model: str, chat: bool, index: int, text: str | None, finish: str | None) -> dict:
    """One streamed piece of choice `index`: its text (for chat, a `delta`; None: the opening delta with
    the assistant's role) or its finish reason."""
    if chat:
        delta = {"role": "assistant", "content": ""} if text is None else {"content": text} if text else {}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, chat: bool, use: dict) -> dict:
    kind = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model, "choices": [],
            "usage": use}  # fmt: skip
