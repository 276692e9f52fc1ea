"""The HTTP side of `hebrus serve`: OpenAI-style routes on FastAPI, every request checked before
it reaches the engine (`hebrus.scheduling`), errors in OpenAI's shape.

A route is one function over the app's `Server` (`server_of`); the API key and the declared body
size are checked by a dependency (`admitted`) before a body is read. Refused with a 4xx and
nothing in the engine touched: malformed JSON, a known field of the wrong type or out of range,
an unknown model, a prompt with no tokens or past the context limit, a body over
`max_body_bytes` (read no further) or slower than BODY_SECONDS, a missing or wrong API key (on
every route but /health, which load balancers ask), an unknown route or method. A full waiting
line is a 429 with Retry-After. A request whose transaction aborts gets a 500 naming the failure
kind and stage, or, once streaming has begun, an error event; no other request notices.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import time
import weakref
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from pydantic import ValidationError

from hebrus.errors import ChunkAborted, InvalidInput
from hebrus.models import tool_calls
from hebrus.sampling import Sampling
from hebrus.scheduling.scheduler import Overloaded, Request, Scheduler
from hebrus.serve.bodies import ChatBody, CompletionBody
from hebrus.serve.link import EngineGone
from hebrus.serve.metrics import Metrics
from hebrus.serve.outbox import Outbox
from hebrus.serve.reply import Answer, Reply
from hebrus.text.generation import MAX_NEW_TOKENS, TextOptions
from hebrus.text.grammar import Grammar
from hebrus.text.tools import forced

BODY_SECONDS = 30.0             # a body that takes longer to arrive is refused


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status, headers=headers)


class Refused(Exception):
    """A request refused before its body is read: `response` is the answer."""

    def __init__(self, response: JSONResponse):
        self.response = response


class Server:
    """What the routes serve: the model as `name`, its text through `model.tokenizer`, the
    engine loop, the keys (None: no key needed; each key's cached prefixes are its own unless
    the scheduler shares them, and without keys nothing is cached unless it does: no one could
    be told apart), the limits and the metrics. What a request leaves out takes the text-level
    defaults (`hebrus.text.generation`): sampling from the checkpoint's generation config, else
    temperature 1.0; a random seed."""

    def __init__(self, model, name: str, scheduler: Scheduler, api_key: str | list[str] | None = None,
                 max_body_bytes: int = 1 << 20, max_tokens_default: int = MAX_NEW_TOKENS,
                 metrics: Metrics | None = None):
        self.model, self.name, self.scheduler, self.text = model, name, scheduler, model.tokenizer
        self.keys = (None if api_key is None
                     else {f"Bearer {k}" for k in ([api_key] if isinstance(api_key, str) else api_key)})
        self.max_body_bytes, self.max_tokens_default = max_body_bytes, max_tokens_default
        self.limit = model.spec.max_context
        self.metrics = metrics or Metrics()
        # one outbox per event loop serving the app
        self.outboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Outbox] = weakref.WeakKeyDictionary()

    # ---- checks before the engine -----------------------------------------------------------
    def check_head(self, request: HTTPRequest) -> None:
        """The key and the declared size, before the body is read: `Refused` if either fails."""
        if self.keys is not None and request.headers.get("authorization") not in self.keys:
            raise Refused(error(401, "missing or wrong API key (Authorization: Bearer KEY)",
                                "authentication_error", code="invalid_api_key"))
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > self.max_body_bytes):
            raise Refused(error(413, f"the body is over {self.max_body_bytes} bytes"))

    async def read_body(self, request: HTTPRequest) -> bytes | None:
        """The body, or None past `max_body_bytes` (read no further than that)."""
        parts, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body_bytes:
                return None
            parts.append(part)
        return b"".join(parts)

    async def body_of(self, request: HTTPRequest, kind) -> Any:
        """The body as a `kind`, or the JSONResponse that refuses it."""
        try:
            raw = await asyncio.wait_for(self.read_body(request), BODY_SECONDS)
        except asyncio.TimeoutError:
            return error(408, f"the body did not arrive within {BODY_SECONDS:g} s")
        except ClientDisconnect:
            return error(400, "the client went away while sending the body")
        if raw is None:
            return error(413, f"the body is over {self.max_body_bytes} bytes")
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
            if first["type"] == "extra_forbidden":
                return error(400, f"{where}: this server does not take this field", param=where)
            message = first["msg"].removeprefix("Value error, ")
            return error(400, f"{where}: {message}" if where else message, param=where or None)
        if body.model != self.name:
            return error(404, f"the model {body.model!r} does not exist; this server has {self.name!r}",
                         code="model_not_found", param="model")
        return body

    def sampling_of(self, body) -> Sampling:
        return TextOptions(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
                           repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
                           frequency_penalty=body.frequency_penalty).sampling(self.text)

    def tools_of(self, body) -> tuple[str, list[dict]] | None:
        """(the family's tool-call format, the tools as dicts) where the body offers tools the
        model may call (tool_choice not "none"); InvalidInput where the model cannot."""
        if not getattr(body, "tools", None) or body.tool_choice == "none":
            return None
        form = tool_calls(self.model.family)
        if form is None or not self.text.takes_tools:
            raise InvalidInput(f"this model ({self.model.family}) has no tool-call format or its chat template "
                               f"does not take tools")
        return form, [t.model_dump(exclude_none=True) for t in body.tools]

    def prompts_of(self, body, chat: bool) -> list[list[int]]:
        """Each prompt's ids: the conversation through the chat template (with the tools the
        model may call), or each of the completion's prompts."""
        if chat:
            tools = self.tools_of(body)
            messages = [m.model_dump(exclude_none=True) | {"content": m.text()} for m in body.messages]
            return [self.text.apply_chat_template(messages, tools=tools[1] if tools else None)]
        return [self.text.encode(p) if isinstance(p, str) else list(p) for p in body.prompts()]

    def constraint_of(self, body, chat: bool):
        """What every choice's output must match, compiled (`text.grammar`), or None: the
        response_format's, or the tool calls a "required" or named tool_choice forces."""
        fmt = body.response_format
        grammar = None
        if fmt is not None and fmt.type != "text":
            grammar = {"json_object": lambda: Grammar.json(),
                       "json_schema": lambda: Grammar.json(fmt.json_schema.schema_),
                       "regex": lambda: Grammar.regex(fmt.regex),
                       "grammar": lambda: Grammar.lark(fmt.grammar)}[fmt.type]()
        tools = self.tools_of(body) if chat else None
        choice = getattr(body, "tool_choice", None)
        if tools is not None and (choice == "required" or not isinstance(choice, (str, type(None)))):
            if grammar is not None:
                raise InvalidInput("a response_format and a tool_choice that forces a call cannot be combined")
            name = None if choice == "required" else choice.function.name
            grammar = forced(*tools, name, body.parallel_tool_calls is not False)
        return grammar.start(self.text, self.model.spec.vocab_size) if grammar is not None else None

    # ---- a completion ---------------------------------------------------------------------
    async def complete(self, request: HTTPRequest, kind, chat: bool, param: str):
        """A completion route's whole answer: the body read and checked, the prompts made (a
        template's or a tokenizer's refusal is a 400), the constraint compiled (one the library
        cannot take is a 400 naming what), then `run`."""
        body = await self.body_of(request, kind)
        if isinstance(body, JSONResponse):
            return body
        try:
            prompts = await asyncio.to_thread(self.prompts_of, body, chat)
        except Exception as exc:                    # noqa: BLE001 - a template's or tokenizer's refusal
            return error(400, f"{param}: {exc}", param=param)
        where = "tool_choice" if getattr(body, "tool_choice", None) not in (None, "auto", "none") else "response_format"
        try:
            constraint = await asyncio.to_thread(self.constraint_of, body, chat)
        except InvalidInput as exc:
            return error(400, f"{where}: {exc}", param=where)
        return await self.run(request, body, prompts, chat, constraint)

    def checked_prompt(self, prompt: list[int], body) -> tuple[int, JSONResponse | None]:
        """(the tokens a prompt's choices may generate, or the 400 that refuses it)."""
        if not prompt:
            return 0, error(400, "the prompt has no tokens", param="prompt")
        if any(not 0 <= t < self.model.spec.vocab_size for t in prompt):
            return 0, error(400, f"token ids must lie in [0, {self.model.spec.vocab_size})", param="prompt")
        limit = self.limit
        wanted = (body.max_completion_tokens or body.max_tokens
                  or max(1, min(self.max_tokens_default, limit - len(prompt))))
        if len(prompt) + wanted > limit:
            return 0, error(400, f"the prompt's {len(prompt)} tokens and max_tokens {wanted} pass the context "
                                 f"limit of {limit}", param="max_tokens", code="context_length_exceeded")
        return wanted, None

    async def run(self, request: HTTPRequest, body, prompts: list[list[int]], chat: bool, constraint=None):
        """Each prompt's `n` choices as requests of the engine (the first of a prompt feeds it;
        the others fork its session then: `Request.copies`), their events into one answer."""
        wanted = []
        for prompt in prompts:
            count, refused = self.checked_prompt(prompt, body)
            if refused is not None:
                return refused
            wanted.append(count)
        loop = asyncio.get_running_loop()
        outbox = self.outboxes.get(loop) or self.outboxes.setdefault(loop, Outbox(loop))
        events: asyncio.Queue = asyncio.Queue()
        seed = body.seed if body.seed is not None else secrets.randbits(63)
        sampling, tools = self.sampling_of(body), self.tools_of(body) if chat else None
        top = ((body.top_logprobs or 0) if body.logprobs else None) if chat else body.logprobs
        stops = tuple(body.stop or ()) + (self.text.chat_stops if chat else ())
        parents, replies = [], []
        for p, (prompt, count) in enumerate(zip(prompts, wanted)):
            jobs = [Request(key=request.headers.get("authorization", ""), prompt=prompt, max_tokens=count,
                            sampling=sampling, seed=_wrapped(seed + j), stop_ids=frozenset(self.text.stop_ids),
                            salt=body.cache_salt or "", keep=self.keys is not None or self.scheduler.share_prefixes,
                            emit=lambda kind, value, i=p * body.n + j: outbox.put(events, (i, kind, value)),
                            constraint=constraint, logprobs=top)
                    for j in range(body.n)]
            jobs[0].copies = jobs[1:]
            parents.append(jobs[0])
            replies += [Reply(p * body.n + j, self.text, stops, job, tools, first=j == 0) for j, job in enumerate(jobs)]
        started = time.monotonic()
        try:
            self.scheduler.submit(*parents)
        except Overloaded as exc:
            for job in parents:
                job.cancelled.set()
            return _overloaded(exc)
        except EngineGone as exc:
            return _gone(exc)
        self.metrics.request(chat)
        answer = Answer(replies, chat, self.name, sum(map(len, prompts)), self.metrics, started)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            first = await _next_event(events, request, answer)  # before the first byte: a failure is a 500
            if first is None:
                return error(400, "the client went away")
            if first[1] == "error":
                answer.cancel()
                return _failure(first[2])
            return StreamingResponse(answer.stream(first, events, include_usage, request),
                                     media_type="text/event-stream")
        while True:
            event = await _next_event(events, request, answer)
            if event is None:
                return error(400, "the client went away")
            index, kind, value = event
            if kind == "error":
                answer.cancel()
                return _failure(value)
            try:
                going = answer.take(index, kind, value)
            except Exception as exc:                # noqa: BLE001 - reading the output failed: the rest stop
                answer.cancel()
                return _failure(exc)
            if not going:
                return JSONResponse(answer.whole())


async def _next_event(events: asyncio.Queue, request: HTTPRequest, answer: Answer):
    """The request's next engine event, or None (its choices cancelled) once its client is
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
                answer.cancel()
                return None
            gone = asyncio.ensure_future(request.receive())
    finally:
        for task in (get, gone):
            task.cancel()


def _wrapped(seed: int) -> int:
    """A choice's seed (the request's plus its index) kept within a generator's range."""
    return seed - 2**64 if seed >= 2**64 else seed


def _overloaded(exc: Overloaded) -> JSONResponse:
    return error(429, f"overloaded: {exc}; try again", "rate_limit_error", headers={"Retry-After": "1"})


def _gone(exc: EngineGone) -> JSONResponse:
    return error(503, f"{exc}; the server is stopping", "server_error", code="engine_gone")


def _failure(exc: BaseException) -> JSONResponse:
    if isinstance(exc, Overloaded):                 # (refused by an engine in another process: `serve.link`)
        return _overloaded(exc)
    if isinstance(exc, EngineGone):
        return _gone(exc)
    if isinstance(exc, ChunkAborted):
        return error(500, f"the request's transaction aborted ({exc.kind} at {exc.stage}): {exc}; nothing "
                          f"else was affected", "server_error", code=f"aborted_{exc.kind}")
    return error(500, f"internal error: {type(exc).__name__}", "server_error")


# ---- the routes ---------------------------------------------------------------------------
def server_of(request: HTTPRequest) -> Server:
    return request.app.state.server


def admitted(request: HTTPRequest) -> Server:
    """The dependency of every route but /health: the key and the declared size checked
    before the body is read (in a dependency, not a middleware, which would hide a client's
    going away from the route)."""
    server = server_of(request)
    server.check_head(request)
    return server


routes = APIRouter()


@routes.get("/health")
async def health():
    return {"status": "ok"}


@routes.get("/metrics")
async def prometheus(server: Server = Depends(admitted)):
    try:
        counts = await asyncio.to_thread(server.scheduler.counts)     # (the engine's process may be another)
    except EngineGone as exc:
        return _gone(exc)
    return PlainTextResponse(server.metrics.render(counts),
                             media_type="text/plain; version=0.0.4")


@routes.get("/v1/models")
async def models(server: Server = Depends(admitted)):
    return {"object": "list", "data": [{"id": server.name, "object": "model", "created": 0, "owned_by": "hebrus"}]}


@routes.post("/v1/completions")
async def completions(request: HTTPRequest, server: Server = Depends(admitted)):
    return await server.complete(request, CompletionBody, False, "prompt")


@routes.post("/v1/chat/completions")
async def chat(request: HTTPRequest, server: Server = Depends(admitted)):
    return await server.complete(request, ChatBody, True, "messages")


def create_app(model, name: str, scheduler: Scheduler, **options) -> FastAPI:
    """The app serving `model` as `name` through `scheduler` (`options`: `Server`'s)."""
    app = FastAPI(title="hebrus", docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False)
    app.state.server = Server(model, name, scheduler, **options)

    @app.exception_handler(Refused)
    async def refused(request: HTTPRequest, exc: Refused):
        return exc.response

    @app.exception_handler(HTTPException)
    async def http_error(request: HTTPRequest, exc: HTTPException):
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                     headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: HTTPRequest, exc: RequestValidationError):
        return error(400, f"the request is not valid: {exc.errors()[:1]}")
    app.include_router(routes)
    return app
