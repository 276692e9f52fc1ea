"""The HTTP side of `hebrus serve`: OpenAI-style routes on FastAPI, every request checked before
it reaches the engine (`hebrus.scheduling`), errors in OpenAI's shape.

Refused with a 4xx and nothing in the engine touched: malformed JSON, a known field of the
wrong type or out of range, an unknown model, a prompt with no tokens or past the context
limit, a body over `max_body_bytes` (read no further) or slower than BODY_SECONDS, a missing or
wrong API key (on every route but /health, which load balancers ask), an unknown route or
method. A full waiting line is a 429 with Retry-After. A request whose transaction aborts gets
a 500 naming the failure kind and stage, or, once streaming has begun, an error event; no
other request notices.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import threading
import time
import weakref
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hebrus.errors import ChunkAborted
from hebrus.sampling import Sampling
from hebrus.text.generation import MAX_NEW_TOKENS, TextOptions
from hebrus.serve.metrics import Metrics
from hebrus.serve.reply import Reply
from hebrus.scheduling.scheduler import Overloaded, Request, Scheduler


BODY_SECONDS = 30.0             # a body that takes longer to arrive is refused


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    """The fields both completion routes take; unknown fields are ignored, known ones checked."""
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=100.0)     # None: the text-level default
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = Field(default=None, max_length=256)

    @field_validator("temperature", "top_p", "min_p", mode="before")
    @classmethod
    def _number(cls, value):
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError("must be a number")
        return float(value)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("up to 4 non-empty strings")
        return stops


class CompletionBody(_Common):
    prompt: str | list[int]
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    logprobs: int | None = None

    @field_validator("echo", "best_of", "suffix", "logprobs")
    @classmethod
    def _unsupported(cls, value, info):
        fine = value is None or value is False or (info.field_name == "best_of" and value == 1)
        if not fine:
            raise ValueError("is not supported by this server")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str = Field(pattern="^text$")
    text: str


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str = Field(pattern="^(system|user|assistant|developer)$")
    content: str | list[TextPart]

    def plain(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": self.role, "content": content}


class ChatBody(_Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: bool = False
    tools: list | None = None

    @field_validator("logprobs", "tools")
    @classmethod
    def _unsupported(cls, value):
        if value:
            raise ValueError("is not supported by this server")
        return value


class Outbox:
    """Engine events on their way to the event loop's request queues. The engine thread puts
    them from its side; the first one put since the loop last drained asks the loop to drain,
    so the events of one engine turn (a token for every running request) wake the loop about
    once instead of once each. Each queue gets its events in the order they were put. Events
    for a loop that is gone (closed, or collected) are dropped: nobody is left to read them."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = weakref.ref(loop)           # the app's table of outboxes is keyed by the loop
        self.items, self.lock = [], threading.Lock()

    def put(self, queue: asyncio.Queue, event) -> None:
        with self.lock:
            self.items.append((queue, event))
            first = len(self.items) == 1
        if not first:
            return
        loop = self.loop()
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._drain)
                return
            except RuntimeError:                # closed
                pass
        with self.lock:                         # gone: drop what waits, so later puts try again
            self.items = []

    def _drain(self) -> None:
        with self.lock:
            items, self.items = self.items, []
        for queue, event in items:
            queue.put_nowait(event)


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


def create_app(model, name: str, scheduler: Scheduler, api_key: str | list[str] | None = None,
               max_body_bytes: int = 1 << 20, max_tokens_default: int = MAX_NEW_TOKENS,
               metrics: Metrics | None = None):
    """The app serving `model` as `name`, its text through `model.tokenizer`. `api_key`: one key
    or several; each key's cached prefixes are its own unless the scheduler shares them (without
    keys, nothing is cached unless it does: no one could be told apart). What a request leaves out takes the
    text-level defaults (`hebrus.text.generation`): sampling from the checkpoint's generation
    config, else temperature 1.0; a random seed."""
    text = model.tokenizer
    app = FastAPI(title="hebrus", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, exc: HTTPException):
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: HTTPRequest, exc: RequestValidationError):
        return error(400, f"the request is not valid: {exc.errors()[:1]}")
    metrics = metrics or Metrics()
    outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Outbox] = weakref.WeakKeyDictionary()
    limit = model.spec.max_context
    keys = None if api_key is None else {f"Bearer {k}" for k in ([api_key] if isinstance(api_key, str) else api_key)}

    def refused(request: HTTPRequest) -> JSONResponse | None:
        """The key and the declared size of a /v1 or /metrics request, checked before its body is
        read. (In the routes: an HTTP middleware would hide a client's going away from them.)"""
        if keys is not None and request.headers.get("authorization") not in keys:
            return error(401, "missing or wrong API key (Authorization: Bearer KEY)",
                         "authentication_error", code="invalid_api_key")
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > max_body_bytes):
            return error(413, f"the body is over {max_body_bytes} bytes")
        return None

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(request: HTTPRequest):
        denied = refused(request)
        if denied is not None:
            return denied
        running, waiting = scheduler.depth
        return PlainTextResponse(metrics.render(running, waiting, scheduler.cache),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        denied = refused(request)
        if denied is not None:
            return denied
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "hebrus"}]}

    async def read_body(request: HTTPRequest) -> bytes | None:
        """The body, or None past `max_body_bytes` (read no further than that)."""
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > max_body_bytes:
                return None
            parts.append(part)
        return b"".join(parts)

    async def body_of(request: HTTPRequest, kind) -> Any:
        try:
            raw = await asyncio.wait_for(read_body(request), BODY_SECONDS)
        except asyncio.TimeoutError:
            return error(408, f"the body did not arrive within {BODY_SECONDS:g} s")
        except ClientDisconnect:
            return error(400, "the client went away while sending the body")
        if raw is None:
            return error(413, f"the body is over {max_body_bytes} bytes")
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError):
            return error(400, "the body is not valid JSON")
        if not isinstance(data, dict):
            return error(400, "the body must be a JSON object")
        try:
            body = kind.model_validate(data)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            return error(400, f"{where}: {first['msg']}", param=where)
        if body.model != name:
            return error(404, f"the model {body.model!r} does not exist; this server has {name!r}",
                         code="model_not_found", param="model")
        return body

    def sampling_of(body) -> Sampling:
        return TextOptions(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                           min_p=body.min_p).sampling(text)

    def key_of(request: HTTPRequest) -> str:
        return request.headers.get("authorization", "")

    async def run(request: HTTPRequest, body, prompt: list[int], chat: bool):
        if not prompt:
            return error(400, "the prompt has no tokens", param="prompt")
        if any(not 0 <= t < model.spec.vocab_size for t in prompt):
            return error(400, f"token ids must lie in [0, {model.spec.vocab_size})", param="prompt")
        wanted = body.max_completion_tokens or body.max_tokens or max(1, min(max_tokens_default, limit - len(prompt)))
        if len(prompt) + wanted > limit:
            return error(400, f"the prompt's {len(prompt)} tokens and max_tokens {wanted} pass the context "
                              f"limit of {limit}", param="max_tokens", code="context_length_exceeded")
        loop = asyncio.get_running_loop()
        outbox = outboxes.get(loop) or outboxes.setdefault(loop, Outbox(loop))
        events: asyncio.Queue = asyncio.Queue()
        job = Request(key=key_of(request), prompt=prompt, max_tokens=wanted, sampling=sampling_of(body),
                      seed=body.seed if body.seed is not None else secrets.randbits(63),
                      stop_ids=frozenset(text.stop_ids), salt=body.cache_salt or "",
                      keep=keys is not None or scheduler.share_prefixes,
                      emit=lambda kind, value: outbox.put(events, (kind, value)))
        started = time.monotonic()
        try:
            scheduler.submit(job)
        except Overloaded as exc:
            return error(429, f"overloaded: {exc}; try again", "rate_limit_error", headers={"Retry-After": "1"})
        metrics.request(chat)
        stops = tuple(body.stop or ()) + (text.chat_stops if chat else ())
        reply = Reply(text, stops, chat, name, len(prompt), job, metrics, started)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            first = await next_event(events, request, job)   # before the first byte: a failure is a 500
            if first is None:
                return error(400, "the client went away")
            if first[0] == "error":
                return failure(first[1])
            return StreamingResponse(reply.stream(first, events, include_usage, request),
                                     media_type="text/event-stream")
        while True:
            event = await next_event(events, request, job)
            if event is None:
                return error(400, "the client went away")
            kind, value = event
            if kind == "error":
                return failure(value)
            if not reply.take(kind, value):
                return JSONResponse(reply.whole())

    async def next_event(events: asyncio.Queue, request: HTTPRequest, job: Request):
        """The request's next engine event, or None (the request cancelled) once its client is
        gone: a read of the connection races the event (the body is read by now, so the only
        message left to come is the disconnect)."""
        get = asyncio.ensure_future(events.get())
        gone = asyncio.ensure_future(request.receive())
        try:
            while True:
                done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if get in done:
                    return get.result()
                if gone.result().get("type") == "http.disconnect":
                    job.cancelled.set()
                    return None
                gone = asyncio.ensure_future(request.receive())
        finally:
            for task in (get, gone):
                task.cancel()

    def failure(exc: BaseException) -> JSONResponse:
        if isinstance(exc, ChunkAborted):
            return error(500, f"the request's transaction aborted ({exc.kind} at {exc.stage}): {exc}; nothing "
                              f"else was affected", "server_error", code=f"aborted_{exc.kind}")
        return error(500, f"internal error: {type(exc).__name__}", "server_error")

    async def route(request: HTTPRequest, kind, chat: bool, prompt_of, param: str):
        denied = refused(request)
        if denied is not None:
            return denied
        body = await body_of(request, kind)
        if isinstance(body, JSONResponse):
            return body
        try:
            if chat or isinstance(body.prompt, str):    # templates and tokenizers off the loop
                prompt = await asyncio.to_thread(prompt_of, body)
            else:                                       # token ids: nothing to run
                prompt = prompt_of(body)
        except Exception as exc:                    # noqa: BLE001 - a template's or tokenizer's refusal
            return error(400, f"{param}: {exc}", param=param)
        return await run(request, body, prompt, chat=chat)

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await route(request, CompletionBody, False, lambda body: text.encode(body.prompt)
                           if isinstance(body.prompt, str) else list(body.prompt), "prompt")

    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        return await route(request, ChatBody, True, lambda body: text.apply_chat_template(
            [m.plain() for m in body.messages]), "messages")

    return app
