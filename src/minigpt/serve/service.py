"""The model behind the API: messages and prompts into token ids (the chat template, as `minigpt chat` renders
it), each choice a request to the engine, and the tokens back into text as they come, cut at the caller's
stop sequences.

Text is streamed as it grows, holding back an incomplete UTF-8 character at the end and any end that could be
the start of a stop sequence, so no client ever sees text that a stop sequence then takes back.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from minigpt.config import ConfigError
from minigpt.inference.engine import Engine, QueueFull, Request
from minigpt.serve.protocol import APIError, Message, Sampling

RETRY_AFTER_S = 1
"""What a refused request is told to wait (`Retry-After`) when the queue is full."""


class Choice:
    """One completion of one prompt: its engine request, its tokens so far, the text already handed out."""

    def __init__(self, index: int, prompt: list[int], stops: list[str]) -> None:
        self.index, self.prompt, self.stops = index, prompt, stops
        self.ids: list[int] = []
        self.text, self.shown, self.finish = "", "", None
        self.request: Request | None = None
        self.events: asyncio.Queue | None = None

    def update(self, decode: Callable[[list[int]], str], tokens: list[int], reason: str | None) -> str:
        """Take the engine's new tokens (and its finish reason); the text to hand out now."""
        self.ids += tokens
        text = decode(self.ids) if tokens or not self.text else self.text
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, reason = text[:cut], "stop"
        self.text = text
        if reason is not None:
            self.finish = reason
            safe = text
        else:
            safe = text.rstrip("\ufffd")
            held = max((k for s in self.stops for k in range(1, len(s)) if safe.endswith(s[:k])), default=0)
            safe = safe[: len(safe) - held]
        if not safe.startswith(self.shown) or len(safe) <= len(self.shown):
            return ""
        delta, self.shown = safe[len(self.shown) :], safe
        return delta


class Service:
    """A served model: its name, tokenizer, chat template (None: completions only) and engine."""

    def __init__(self, engine: Engine, tokenizer: Any, name: str, request_timeout: float = 600.0) -> None:
        self.engine, self.tokenizer, self.name = engine, tokenizer, name
        self.max_seq_len, self.request_timeout = engine.max_seq_len, request_timeout
        self.template = tokenizer.chat_template() if hasattr(tokenizer, "chat_template") else None

    def chat_ids(self, messages: list[Message]) -> list[int]:
        if self.template is None:
            raise APIError(
                400, "this model has no chat template (it was trained with minigpt's own tokenizer); use "
                "/v1/completions", param="messages",
            )  # fmt: skip
        try:
            rendered = self.template.render(
                [{"role": m.role, "content": m.text()} for m in messages], add_generation_prompt=True
            )
        except ConfigError as e:
            raise APIError(400, str(e), param="messages") from None
        return list(self.tokenizer.encode_chat(rendered.text))

    def text_ids(self, prompt: str) -> list[int]:
        """A prompt as `minigpt generate` reads it: after the BOS where the tokenizer has one; an empty
        prompt starts a new document."""
        bos = [] if self.tokenizer.bos_id is None else [self.tokenizer.bos_id]
        return (bos + self.tokenizer.encode(prompt)) or [self.tokenizer.eot_id]

    def budget(self, ids: list[int], asked: int | None, param: str) -> int:
        """New tokens for a prompt of `ids`: `asked`, or what the context leaves; refused when the prompt
        fills the context or `asked` goes past it."""
        room = self.max_seq_len - len(ids)
        if room < 1:
            raise APIError(
                400, f"the prompt is {len(ids)} tokens; this model's context is {self.max_seq_len} tokens: "
                f"shorten it to at most {self.max_seq_len - 1}", param=param, code="context_length_exceeded",
            )  # fmt: skip
        if asked is not None and asked > room:
            raise APIError(
                400, f"this model's context is {self.max_seq_len} tokens; the prompt is {len(ids)}, which "
                f"leaves {room} for the completion, and {asked} were asked for: ask for at most {room}",
                param="max_tokens", code="context_length_exceeded",
            )  # fmt: skip
        return room if asked is None else asked

    def check_model(self, asked: str | None) -> None:
        if asked is not None and asked != self.name:
            raise APIError(
                404, f"the model '{asked}' is not served here; this server serves '{self.name}' (GET /v1/models)",
                param="model", code="model_not_found",
            )  # fmt: skip

    def start(self, prompts: list[list[int]], budgets: list[int], req: Sampling) -> list[Choice]:
        """Submit req.n choices per prompt to the engine; all or none (APIError: the queue is full, ...)."""
        loop, events = asyncio.get_running_loop(), asyncio.Queue()
        seed = req.seed if req.seed is not None else secrets.randbelow(2**31)
        choices = [Choice(i * req.n + j, p, req.stops()) for i, p in enumerate(prompts) for j in range(req.n)]
        try:
            for c in choices:
                c.events = events
                on_tokens = lambda toks, why, c=c: loop.call_soon_threadsafe(
                    events.put_nowait, (c, toks, why)
                )
                c.request = Request(
                    c.prompt, budgets[c.index // req.n], on_tokens, temperature=req.temperature,
                    top_k=req.top_k, top_p=req.top_p, seed=seed % 2**31, sample=c.index % req.n,
                )  # fmt: skip
                self._submit(c.request)
        except APIError:
            self.cancel(choices)
            raise
        return choices

    def cancel(self, choices: list[Choice]) -> None:
        """End the choices still running (the client went away, or stopped reading)."""
        for c in choices:
            if c.request is not None and c.finish is None:
                c.finish = "cancelled"
                self.engine.cancel(c.request)

    async def events(
        self, choices: list[Choice], disconnected: Callable[[], Awaitable[bool]] | None = None
    ) -> AsyncIterator[tuple[Choice, str]]:
        """(choice, new text) as text comes, and once as each choice finishes (choice.finish set). Choices
        still running when the caller stops reading, or the client disconnects, are cancelled."""
        try:
            async for item in self._events(choices, choices[0].events, disconnected):
                yield item
        finally:
            self.cancel(choices)

    def _submit(self, request: Request) -> None:
        try:
            self.engine.submit(request)
        except QueueFull as e:
            raise APIError(
                429, f"the server is busy ({e}); try again in a moment", kind="rate_limit_error",
                code="queue_full", headers={"Retry-After": str(RETRY_AFTER_S)},
            ) from None  # fmt: skip
        except RuntimeError as e:
            raise APIError(503, str(e), kind="server_error", headers={"Retry-After": "5"}) from None
        except ConfigError as e:
            raise APIError(400, str(e)) from None

    async def _events(self, choices, events, disconnected) -> AsyncIterator[tuple[Choice, str]]:
        deadline, running = time.monotonic() + self.request_timeout, len(choices)
        while running:
            left = deadline - time.monotonic()
            if left <= 0:
                raise APIError(504, f"the request ran past the server's --request-timeout "
                               f"({self.request_timeout:g} s)", kind="timeout_error", code="timeout")  # fmt: skip
            try:
                c, tokens, reason = await asyncio.wait_for(events.get(), min(left, 1.0))
            except TimeoutError:
                if disconnected is not None and await disconnected():
                    return
                continue
            if c.finish is not None:
                continue  # what the engine says after a stop sequence ended the choice, or a cancel
            if reason in ("shutdown", "error"):
                raise APIError(503, "the server is shutting down" if reason == "shutdown" else
                               "the model failed on this request", kind="server_error")  # fmt: skip
            delta = c.update(self.tokenizer.decode, tokens, reason)
            if c.finish is not None:
                running -= 1
                if reason is None:  # a stop sequence: the engine has more to say, unasked
                    self.engine.cancel(c.request)
            if delta or c.finish is not None:
                yield c, delta
