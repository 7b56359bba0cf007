"""The HTTP routes: OpenAI's `/v1/chat/completions`, `/v1/completions` and `/v1/models`, `/health`, and the chat
page at `/`; every refusal an OpenAI error object with one log line and no traceback.

Before a route reads anything, a guard refuses a `/v1` request without the API key (401, the key compared in
constant time) and a body over the size limit (413: by its Content-Length, or while it is read, so a large
body is never held whole).
"""

from __future__ import annotations

import dataclasses
import hmac
import importlib.resources
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from minigpt.serve import protocol
from minigpt.serve.protocol import APIError, ChatRequest, CompletionRequest, Sampling
from minigpt.serve.service import Choice, Service

log = logging.getLogger("minigpt.serve")


@dataclasses.dataclass(frozen=True)
class ApiOptions:
    """What the routes enforce besides the request bodies' own rules."""

    api_key: str | None = None
    """When set, every /v1 route requires `Authorization: Bearer KEY`."""
    max_body_bytes: int = 1 << 20
    """Larger request bodies are refused (413) before they are read whole."""


class _TooLarge(HTTPException):
    pass


def _refusal(e: APIError, path: str) -> JSONResponse:
    log.warning("%d %s: %s", e.status, path, e.message)
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


class Guard:
    """ASGI middleware: the API key and the body size, checked before the route reads the body."""

    def __init__(self, app: Any, options: ApiOptions) -> None:
        self.app, self.options = app, options
        self.key = None if options.api_key is None else options.api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        refused = self._check(scope["path"], headers)
        if refused is not None:
            return await _refusal(refused, scope["path"])(scope, receive, send)
        limit, seen = self.options.max_body_bytes, 0

        async def limited() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > limit:
                raise _TooLarge(413, f"the request body is over the server's limit of {limit} bytes")
            return message

        try:
            await self.app(scope, limited, send)
        except Exception as e:  # answered already (500, by `failed`); one line here rather than a traceback
            log.error(
                "500 %s: %s: %s",
                scope["path"],
                type(e).__name__,
                str(e).splitlines()[0][:300] if str(e) else "",
            )

    def _check(self, path: str, headers: dict[str, bytes]) -> APIError | None:
        if self.key is not None and path.startswith("/v1"):
            given = headers.get("authorization", b"")
            if not hmac.compare_digest(given, b"Bearer " + self.key):
                return APIError(401, "a valid API key is required: send the header 'Authorization: Bearer "
                                "KEY' with the server's --api-key", code="invalid_api_key")  # fmt: skip
        length = headers.get("content-length", b"0")
        if not length.isdigit() or int(length) > self.options.max_body_bytes:
            return APIError(413, f"the request body is over the server's limit of {self.options.max_body_bytes} "
                            "bytes (or its Content-Length is not a number)", code="request_too_large")  # fmt: skip
        return None


def _validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    """The first problem of a request body, as one line naming the field."""
    errors = e.errors()
    if not errors:
        return "the request body is not valid", None
    first = errors[0]
    where = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    if not where:
        return f"the request body must be a JSON object of the API's fields ({first.get('msg')})", None
    field = ".".join(where)
    return f"{field}: {first.get('msg')} (got {json.dumps(first.get('input'))[:80]})", field


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError) -> JSONResponse:
        return _refusal(e, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(e)
        return _refusal(APIError(400, message, param=param), request.url.path)

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception) -> JSONResponse:
        body = protocol.error_body("the server failed on this request (see its log)", "server_error")
        return JSONResponse(body, status_code=500)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException) -> JSONResponse:
        kinds = {404: "not_found_error", 413: "invalid_request_error", 405: "invalid_request_error"}
        message = e.detail if e.status_code != 404 else f"no route {request.url.path}"
        return _refusal(APIError(e.status_code, str(message), kinds.get(e.status_code, "invalid_request_error")),
                        request.url.path)  # fmt: skip


def create_app(service: Service, options: ApiOptions = ApiOptions()) -> FastAPI:
    """The server's application: the routes over `service`, behind the guard."""
    app = FastAPI(title="minigpt", docs_url=None, redoc_url=None, openapi_url=None)
    _handlers(app)
    page = importlib.resources.files("minigpt.serve").joinpath("static/chat.html").read_text("utf-8")
    created = int(time.time())

    @app.get("/", response_class=HTMLResponse)
    async def chat_page() -> str:
        name = json.dumps(service.name).replace("<", "\\u003c")  # never a </script> inside the script
        return page.replace("{{MODEL}}", name).replace("{{CHAT}}", json.dumps(service.template is not None))

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "model": service.name, **service.engine.load()}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model(service.name, created)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> dict:
        service.check_model(name)
        return _model(name, created)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Any:
        service.check_model(body.model)
        prompt = service.chat_ids(body.messages)
        budget = service.budget(prompt, body.budget(), "messages")
        return await _respond(service, request, body, [prompt], [budget], chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        service.check_model(body.model)
        prompts = [service.text_ids(p) for p in body.prompts()]
        budgets = [service.budget(p, body.budget(), "prompt") for p in prompts]
        return await _respond(service, request, body, prompts, budgets, chat=False)

    return Guard(app, options)


def _model(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "minigpt"}


async def _respond(
    service: Service, request: Request, body: Sampling, prompts: list, budgets: list, chat: bool
) -> Any:
    rid = protocol.new_id("chatcmpl" if chat else "cmpl")
    choices = service.start(prompts, budgets, body)
    if body.stream:
        stream = _stream(service, choices, body, rid, chat, sum(map(len, prompts)))
        return StreamingResponse(
            stream, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    async for _ in service.events(choices, request.is_disconnected):
        pass
    use = protocol.usage(sum(map(len, prompts)), sum(len(c.ids) for c in choices))
    texts = [(c.text, c.finish) for c in choices]
    make = protocol.chat_response if chat else protocol.completion_response
    return make(rid, service.name, texts, use)


async def _stream(
    service: Service, choices: list[Choice], body: Sampling, rid: str, chat: bool, prompt_tokens: int
) -> AsyncIterator[str]:
    """OpenAI's server-sent events: a chunk per piece of text, one with each choice's finish reason (the
    last with the usage), a usage chunk if stream_options ask for it, and [DONE]. A failure after the
    stream began is an error event."""
    name, left = service.name, len(choices)
    data = lambda obj: f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
    if chat:
        for c in choices:
            yield data(protocol.chunk(rid, name, True, c.index, None, None))
    try:
        async for c, delta in service.events(choices):
            if delta:
                yield data(protocol.chunk(rid, name, chat, c.index, delta, None))
            if c.finish is not None:
                left -= 1
                end = protocol.chunk(rid, name, chat, c.index, "", c.finish)
                use = protocol.usage(prompt_tokens, sum(len(x.ids) for x in choices))
                yield data({**end, "usage": use} if not left else end)
        if body.stream_options is not None and body.stream_options.include_usage:
            yield data(protocol.usage_chunk(rid, name, chat, use))
    except APIError as e:
        log.warning("%d %s (while streaming): %s", e.status, "stream " + rid, e.message)
        yield data(e.body())
    yield "data: [DONE]\n\n"
