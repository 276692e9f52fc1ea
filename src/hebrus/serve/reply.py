"""One request's answer as the engine's events arrive: text decoded as tokens come, cut at a
stop string, shaped as OpenAI's whole completions or server-sent event chunks."""
from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request as HTTPRequest

from hebrus.errors import ChunkAborted
from hebrus.serve.metrics import Metrics
from hebrus.scheduling.scheduler import Request
from hebrus.text.generation import StopText


class Reply:
    """One request's output as it arrives: text decoded as tokens come, cut at a stop string."""

    def __init__(self, tokenizer, stops: tuple[str, ...], chat: bool, name: str, prompt_tokens: int, job: Request,
                 metrics: Metrics, started: float):
        self.decoder, self.stop, self.chat, self.name = tokenizer.stream(), StopText(stops), chat, name
        self.prompt_tokens, self.job, self.metrics, self.started = prompt_tokens, job, metrics, started
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.pending, self.tokens, self.reason = "", 0, None
        self.last = None

    @property
    def text(self) -> str:
        return self.stop.text

    def take(self, kind: str, value) -> bool:
        """Fold one engine event in; False once the request is finished."""
        if kind == "token":
            now = time.monotonic()
            self.metrics.token(now - (self.last or self.started), first=self.last is None)
            self.last = now
            self.tokens += 1
            if value not in self.job.stop_ids:         # an end-of-sequence id is counted, not shown
                self.pending += self.stop.add(self.decoder.push(value))
            if self.stop.stopped:
                self.reason = "stop"
                self.job.cancelled.set()                # the engine drops it at its next turn
                return False
            return True
        if self.reason is None:                         # "done": the engine's reason
            self.pending += self.stop.add(self.decoder.flush())
            self.pending += self.stop.finish() if not self.stop.stopped else ""
            self.reason = "stop" if value == "stop" or self.stop.stopped else "length"
        return False

    def fresh(self) -> str:
        """Text not sent yet (a tail that could still become a stop string is held back)."""
        out, self.pending = self.pending, ""
        return out

    def usage(self) -> dict:
        cached = self.job.cached
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.tokens,
                "total_tokens": self.prompt_tokens + self.tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def whole(self) -> dict:
        self.metrics.finished(self.prompt_tokens, self.tokens)
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": self.text},
                      "finish_reason": self.reason, "logprobs": None}
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": self.text, "finish_reason": self.reason, "logprobs": None}
            kind = "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.name,
                "choices": [choice], "usage": self.usage()}

    def chunk(self, piece: str, reason: str | None, first: bool = False) -> str:
        if self.chat:
            delta = ({"role": "assistant", "content": piece} if first else {"content": piece}) if piece or first else {}
            choice = {"index": 0, "delta": delta, "finish_reason": reason, "logprobs": None}
            kind = "chat.completion.chunk"
        else:
            choice = {"index": 0, "text": piece, "finish_reason": reason, "logprobs": None}
            kind = "text_completion"
        return _event({"id": self.id, "object": kind, "created": self.created, "model": self.name,
                       "choices": [choice]})

    async def stream(self, first, events: asyncio.Queue, include_usage: bool, request: HTTPRequest):
        event, opened = first, False
        try:
            while True:
                kind, value = event
                if kind == "error":
                    exc = value
                    what = (f"the request's transaction aborted ({exc.kind} at {exc.stage})"
                            if isinstance(exc, ChunkAborted) else f"internal error: {type(exc).__name__}")
                    yield _event({"error": {"message": what, "type": "server_error", "param": None,
                                            "code": f"aborted_{exc.kind}" if isinstance(exc, ChunkAborted) else None}})
                    break
                going = self.take(kind, value)
                piece = self.fresh()
                if piece or not opened:
                    yield self.chunk(piece, None, first=not opened)
                    opened = True
                if not going:
                    yield self.chunk("", self.reason)
                    if include_usage:
                        yield _event({"id": self.id, "object": "chat.completion.chunk" if self.chat else
                                      "text_completion", "created": self.created, "model": self.name,
                                      "choices": [], "usage": self.usage()})
                    self.metrics.finished(self.prompt_tokens, self.tokens)
                    break
                event = await events.get()
            yield "data: [DONE]\n\n"
        finally:                                        # a client gone mid-stream frees its request
            if self.reason is None:
                self.job.cancelled.set()


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"
