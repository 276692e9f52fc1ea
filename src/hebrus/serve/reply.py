"""A request's answer as the engine's events arrive: each choice's text decoded as its tokens
come, cut at a stop string, its tool calls read out of it, shaped as OpenAI's whole completions
or server-sent event chunks (the choices of one request interleaved, each chunk naming its
index)."""
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
from hebrus.text.tools import Streamer


class Reply:
    """One choice's output as it arrives: text decoded as tokens come, cut at a stop string;
    with `tools` (their format and list), tool calls taken out of the text as each closes;
    with logprobs, each token's."""

    def __init__(self, index: int, tokenizer, stops: tuple[str, ...], job: Request, tools=None, first: bool = True):
        # `first`: the first choice of its prompt, which counts the prompt's cached tokens
        self.index, self.tokenizer, self.job, self.first = index, tokenizer, job, first
        self.decoder, self.stop = tokenizer.stream(), StopText(stops)
        self.tools = Streamer(*tools) if tools is not None else None
        self.pending, self.tokens, self.reason = "", 0, None
        self.content = ""                               # the text shown (tool calls taken out)
        self.calls: list[dict] = []                     # tool calls, OpenAI's shape
        self.fresh_calls: list[dict] = []               # ... not sent yet
        self.scores: list[tuple[int, float, list]] = [] # (token, log probability, likeliest) per token
        self._offset = (0, 0)       # completions' text offsets: (scores counted, the text's length before them)
        self._score = None
        self.last: float | None = None
        self.closed = False                             # its last chunk sent (streaming)

    def take(self, kind: str, value, metrics: Metrics, started: float) -> bool:
        """Fold one engine event in; False once the choice is finished (what comes after, a
        token sent before the engine saw the stop string, is dropped)."""
        if self.reason is not None:
            return False
        if kind == "logprobs":
            self._score = value
            return True
        if kind == "token":
            now = time.monotonic()
            metrics.token(now - (self.last or started), first=self.last is None)
            self.last = now
            self.tokens += 1
            if self._score is not None:
                self.scores.append((value, *self._score))
                self._score = None
            if value not in self.job.stop_ids:         # an end-of-sequence id is counted, not shown
                self._show(self.stop.add(self.decoder.push(value)))
            if self.stop.stopped:
                self.reason = "stop"
                self.job.cancelled.set()                # the engine drops it at its next turn
                self._close()
                return False
            return True
        if self.reason is None:                         # "done": the engine's reason
            self._show(self.stop.add(self.decoder.flush()))
            self._show(self.stop.finish() if not self.stop.stopped else "")
            self.reason = "stop" if value == "stop" or self.stop.stopped else "length"
            self._close()
        return False

    def _show(self, piece: str) -> None:
        if self.tools is None:
            self.pending += piece
            self.content += piece
            return
        shown, calls = self.tools.add(piece)
        self.pending += shown
        self.content += shown
        for call in calls:
            self.fresh_calls.append(call.openai(len(self.calls)))
            self.calls.append(self.fresh_calls[-1])

    def _close(self) -> None:
        if self.tools is not None:
            rest = self.tools.finish()
            self.pending += rest
            self.content += rest
            if self.calls:
                self.reason = "tool_calls"
                self.content = self.content.strip()

    def fresh(self) -> tuple[str, list[dict]]:
        """Text and tool calls not sent yet (a tail that could still become a stop string or
        begin a tool call is held back)."""
        out, calls, self.pending, self.fresh_calls = self.pending, self.fresh_calls, "", []
        return out, calls

    def logprobs(self, chat: bool, scores=None) -> dict | None:
        """The choice's log probabilities in OpenAI's shape (chat's or completions'), or None
        when they were not asked for."""
        if self.job.logprobs is None:
            return None
        scores = self.scores if scores is None else scores
        word, raw = self.word, self.tokenizer.bytes_of
        if chat:
            return {"content": [{"token": word(t), "logprob": p, "bytes": list(raw(t)),
                                 "top_logprobs": [{"token": word(i), "logprob": q, "bytes": list(raw(i))}
                                                  for i, q in top]} for t, p, top in scores]}
        first = len(self.scores) - len(scores)          # where `scores` begin among the choice's
        counted, at = self._offset
        if first != counted:                            # not the tail after the last call's: counted afresh
            at = sum(len(word(t)) for t, _, _ in self.scores[:first])
        offsets = []
        for t, _, _ in scores:
            offsets.append(at)
            at += len(word(t))
        self._offset = (len(self.scores), at)
        return {"tokens": [word(t) for t, _, _ in scores], "token_logprobs": [p for _, p, _ in scores],
                "top_logprobs": [{word(i): q for i, q in top} for _, _, top in scores], "text_offset": offsets}

    def word(self, token: int) -> str:
        """A token as text: its decoding, or where that is not whole characters (a piece of a
        character's bytes), its name in the tokenizer (`bytes:\\xNN` for a byte), one per id."""
        text = self.tokenizer.decode([token])
        if text and "\ufffd" not in text:
            return text
        inner = getattr(self.tokenizer, "tokenizer", None)
        name = inner.id_to_token(token) if inner is not None else None
        return name if name is not None else f"bytes:\\x{token:02x}" if token < 256 else f"<id {token}>"

    def choice(self, chat: bool) -> dict:
        if chat:
            message = {"role": "assistant", "content": self.content if self.content or not self.calls else None}
            if self.calls:
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
            return {"index": self.index, "message": message, "finish_reason": self.reason,
                    "logprobs": self.logprobs(True)}
        return {"index": self.index, "text": self.content, "finish_reason": self.reason,
                "logprobs": self.logprobs(False)}


class Answer:
    """A request's choices (`Reply`s, one per choice, by index) as one answer."""

    def __init__(self, replies: list[Reply], chat: bool, name: str, prompt_tokens: int, metrics: Metrics,
                 started: float):
        self.replies, self.chat, self.name = replies, chat, name
        self.prompt_tokens, self.metrics, self.started = prompt_tokens, metrics, started
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.open = {r.index for r in replies}          # choices not finished
        self.kind = "chat.completion.chunk" if chat else "text_completion"

    def cancel(self) -> None:
        for reply in self.replies:
            reply.job.cancelled.set()

    def take(self, index: int, kind: str, value) -> bool:
        """Fold one choice's event in; False once every choice is finished."""
        if not self.replies[index].take(kind, value, self.metrics, self.started):
            self.open.discard(index)
        return bool(self.open)

    def usage(self) -> dict:
        tokens = sum(r.tokens for r in self.replies)
        cached = sum(r.job.cached for r in self.replies if r.first)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": tokens,
                "total_tokens": self.prompt_tokens + tokens, "prompt_tokens_details": {"cached_tokens": cached}}

    def whole(self) -> dict:
        self.metrics.finished(self.prompt_tokens, sum(r.tokens for r in self.replies))
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.name, "choices": [r.choice(self.chat) for r in self.replies],
                "usage": self.usage()}

    def chunk(self, reply: Reply, piece: str, calls: list[dict], reason: str | None, first: bool, scores) -> str:
        if self.chat:
            delta = {"role": "assistant", "content": piece} if first else {"content": piece} if piece else {}
            if calls:
                delta["tool_calls"] = calls
            choice = {"index": reply.index, "delta": delta, "finish_reason": reason,
                      "logprobs": reply.logprobs(True, scores) if scores else None}
        else:
            choice = {"index": reply.index, "text": piece, "finish_reason": reason,
                      "logprobs": reply.logprobs(False, scores) if scores else None}
        return _event({"id": self.id, "object": self.kind, "created": self.created, "model": self.name,
                       "choices": [choice]})

    async def stream(self, first, events: asyncio.Queue, include_usage: bool, request: HTTPRequest):
        event, opened, sent = first, set(), {r.index: 0 for r in self.replies}
        try:
            while True:
                index, kind, value = event
                if kind == "error":
                    exc = value
                    what = (f"the request's transaction aborted ({exc.kind} at {exc.stage})"
                            if isinstance(exc, ChunkAborted) else f"internal error: {type(exc).__name__}")
                    yield _event({"error": {"message": what, "type": "server_error", "param": None,
                                            "code": f"aborted_{exc.kind}" if isinstance(exc, ChunkAborted) else None}})
                    self.cancel()
                    break
                going = self.take(index, kind, value)
                reply = self.replies[index]
                piece, calls = reply.fresh()
                scores = reply.scores[sent[index]:] if reply.job.logprobs is not None else None
                if piece or calls or index not in opened or (scores and kind == "token"):
                    yield self.chunk(reply, piece, calls, None, index not in opened, scores)
                    sent[index] = len(reply.scores)
                    opened.add(index)
                if reply.reason is not None and not reply.closed:
                    reply.closed = True
                    yield self.chunk(reply, "", [], reply.reason, False, None)
                if not going:
                    if include_usage:
                        yield _event({"id": self.id, "object": self.kind, "created": self.created, "model": self.name,
                                      "choices": [], "usage": self.usage()})
                    self.metrics.finished(self.prompt_tokens, sum(r.tokens for r in self.replies))
                    break
                event = await events.get()
            yield "data: [DONE]\n\n"
        finally:                                        # a client gone mid-stream frees its requests
            if self.open:
                self.cancel()


def _event(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"
