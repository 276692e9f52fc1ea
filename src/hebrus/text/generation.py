"""Text in, text out: the defaults every text-level entry point shares (`hebrus generate` and
`hebrus chat`, `hebrus.generate`, `Session.generate_text`, the server), and generation from a
prompt or a conversation, streamed as text.

`Session.generate` stays the engine-level call (token ids; greedy and seed 0 unless told
otherwise); everything here speaks text and takes its sampling from the checkpoint."""
from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, fields, replace
from typing import Callable, Iterator

from hebrus import arguments
from hebrus.errors import InvalidInput, note_published
from hebrus.sampling import Sampling
from hebrus.text import templates

# The defaults of the text-level entry points (README: "Defaults"). Sampling fields left None
# come from the checkpoint's generation_config.json, else from SAMPLING; the seed, when None, is
# drawn at random for each call.
MODEL = "shakespeare"
MODE = "fast"
DEVICE = "auto"                 # CUDA when there is one, else the CPU
DTYPE = "auto"                  # bfloat16 on a GPU, float32 on the CPU
MAX_NEW_TOKENS = 256
SAMPLING = Sampling(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0, presence_penalty=0.0,
                    frequency_penalty=0.0)


@dataclass(frozen=True)
class TextOptions:
    """How one text generation runs. None: the default (the checkpoint's generation config for
    sampling, else SAMPLING; a random seed)."""
    max_new_tokens: int = MAX_NEW_TOKENS
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    grammar: object = None          # what the text must match: a `text.grammar.Grammar`, or a JSON schema (a dict)

    @classmethod
    def of(cls, **options) -> "TextOptions":
        """From keyword arguments; an unknown one is InvalidInput naming those allowed."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidInput(f"unknown option {unknown[0]!r}; text generation takes: {', '.join(sorted(known))}")
        options = {name: value for name, value in options.items() if value is not None}     # None: the default
        stop = options.pop("stop", ())
        stop = (stop,) if isinstance(stop, str) else tuple(stop) if isinstance(stop, (list, tuple)) else stop
        if not isinstance(stop, tuple) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidInput("stop must be a non-empty string or a list of them")
        grammar = options.pop("grammar", None)
        if grammar is not None:
            from hebrus.text.grammar import Grammar
            grammar = Grammar.of(grammar)
        return cls(stop=stop, grammar=grammar, **{name: _checked(name, value) for name, value in options.items()})

    def sampling(self, tokenizer) -> Sampling:
        """The sampling these options ask for: each field given here, else the checkpoint's
        generation config, else SAMPLING."""
        config = tokenizer.generation_config
        chosen = {f.name: next(v for v in (getattr(self, f.name), config.get(f.name), getattr(SAMPLING, f.name))
                               if v is not None) for f in fields(Sampling)}
        return Sampling(**chosen)


def _checked(name: str, value):
    if name == "max_new_tokens":
        return arguments.count(name, value)
    if name == "seed":
        arguments.generator(value)
        return int(value)
    return arguments.sampling_option(name, value)


class StopText:
    """Text as it grows, cut at the first stop string: `add` returns what may be shown now,
    holding back a tail that could still become a stop string; `stopped` once one appeared."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.text, self.shown, self.stopped = stops, "", 0, False
        self.longest = max(map(len, stops), default=0)

    def add(self, piece: str) -> str:
        start = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
            return self._show(len(self.text))
        held = max((_partial(self.text, s) for s in self.stops), default=0)
        return self._show(len(self.text) - held)

    def finish(self) -> str:
        """The rest, once no more text comes."""
        return self._show(len(self.text))

    def _show(self, end: int) -> str:
        out = self.text[self.shown:end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return out


def _partial(text: str, stop: str) -> int:
    """How many trailing characters of `text` are a proper prefix of `stop`."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0


class TextStream:
    """One generation as text: iterate for the pieces as they come. Afterwards (or during),
    `prompt_tokens`, `prompt_seconds`, `generated`, `seconds`, `finish` ("stop": an
    end-of-sequence id or a stop string; "length": max_new_tokens, or the model's context
    limit when that came first, `context_ended`) and `ids` (the tokens generated) say how it
    went. With a grammar (`TextOptions.grammar`), the text generated matches it: "stop" once it
    is complete, and the session is left without a constraint afterwards."""

    def __init__(self, session, tokenizer, prompt: list[int], options: TextOptions, stops: tuple[str, ...],
                 progress: Callable[[int, int], None] | None = None, seen: list[int] = (),
                 after_prompt: Callable[[], None] | None = None, after: Callable[["TextStream"], None] | None = None):
        self.session, self.tokenizer, self.prompt, self.options = session, tokenizer, prompt, options
        self.sampling = options.sampling(tokenizer)
        self.seed = options.seed if options.seed is not None else secrets.randbits(63)
        self.stops, self.progress, self.seen = stops + options.stop, progress, list(seen)
        self.after_prompt, self.after = after_prompt, after
        self.prompt_tokens, self.prompt_seconds, self.generated, self.seconds = len(prompt), 0.0, 0, 0.0
        self.finish, self.ids, self.text_so_far = None, [], ""
        self.context_ended = False              # the context's end, not max_new_tokens, ended it
        # the grammar compiled now: one the library cannot take is refused before anything is fed
        self.constraint = (options.grammar.start(tokenizer, session.spec.vocab_size)
                           if options.grammar is not None else None)
        self._pieces = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._pieces

    def text(self) -> str:
        return "".join(self)

    def _run(self) -> Iterator[str]:
        try:
            yield from self._pieces_of_run()
        finally:
            if self.after is not None:
                self.after(self)

    def _pieces_of_run(self) -> Iterator[str]:
        started = time.perf_counter()
        try:
            self._prefill()
        finally:
            self.prompt_seconds = time.perf_counter() - started
        if self.after_prompt is not None:
            self.after_prompt()
        room = self.session.spec.max_context - self.session.frontier      # the context's end stops it too
        tokens = self.session.generate([], max_new_tokens=min(self.options.max_new_tokens, room),
                                       temperature=self.sampling.temperature, top_p=self.sampling.top_p,
                                       seed=self.seed, top_k=self.sampling.top_k, min_p=self.sampling.min_p,
                                       repetition_penalty=self.sampling.repetition_penalty,
                                       presence_penalty=self.sampling.presence_penalty,
                                       frequency_penalty=self.sampling.frequency_penalty,
                                       stop_ids=self.tokenizer.stop_ids, seen=self.seen + self.prompt,
                                       constraint=self.constraint)
        decoder, stop = self.tokenizer.stream(), StopText(self.stops)
        started = time.perf_counter()
        try:
            for token in tokens:
                self.generated += 1
                self.ids.append(token)
                if token in self.tokenizer.stop_ids:
                    self.finish = "stop"
                    break
                piece = stop.add(decoder.push(token))
                self.seconds = time.perf_counter() - started
                if piece:
                    self.text_so_far += piece
                    yield piece
                if stop.stopped:
                    self.finish = "stop"
                    break
            if not stop.stopped:
                piece = stop.add(decoder.flush())
                piece += stop.finish() if not stop.stopped else ""
                self.finish = "stop" if stop.stopped else self.finish
                self.text_so_far += piece
                yield piece
        finally:
            tokens.close()
            self.seconds = time.perf_counter() - started
            if self.constraint is not None:
                done = self.session.constraint is not None and self.session.constraint.finished
                self.finish = self.finish or ("stop" if done else None)
                self.session.constrain(None)    # the next turn's text is free again
            self.finish = self.finish or "length"
            self.context_ended = self.finish == "length" and room < self.options.max_new_tokens

    def _prefill(self) -> None:
        """The prompt in chunks of the model's `prefill_chunk`, a transaction each,
        `progress(done, total)` after every one; a prompt that cannot fit the context is refused
        before any of it is fed."""
        ids, start = self.prompt, self.session.frontier
        chunk = self.session.model.prefill_chunk
        limit = self.session.spec.max_context
        if start + len(ids) > limit:
            raise InvalidInput(f"the prompt's {len(ids)} tokens would take the session past the model's context "
                               f"limit of {limit} tokens ({limit - start} left)")
        try:
            for begin in range(0, len(ids), chunk):
                self.session.prefill(ids[begin:begin + chunk], chunk_size=chunk)
                if self.progress is not None:
                    self.progress(min(begin + chunk, len(ids)), len(ids))
        except BaseException as exc:
            note_published(exc, self.session.frontier - start)
            raise


def summary(stream: TextStream) -> str:
    """A generation's closing line: the prompt and the generation (a rate where there are enough
    tokens for one to mean something, else the time) and the process's peak memory."""
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20       # KiB -> GiB (Linux)
    return (f"prompt: {_rate(stream.prompt_tokens, stream.prompt_seconds)} | "
            f"generation: {_rate(stream.generated, stream.seconds)} | peak memory: {peak:.2f} GiB")


def _rate(tokens: int, seconds: float) -> str:
    count = f"{tokens} token{'s' if tokens != 1 else ''}"
    if tokens >= 16 and seconds > 0:
        return f"{count}, {tokens / seconds:.1f} tokens/s"
    return f"{count} in {seconds * 1e3:.1f} ms"


class Conversation:
    """A conversation kept in one session: each turn feeds only what the session does not hold
    yet. A turn whose ids do not continue what the session holds (a template that renders the
    history anew, or a reply it would encode otherwise) resumes from a fork taken at the end of
    the last prompt, and failing that starts the session over."""

    def __init__(self, model, system: str | None = None, **options):
        self.model, self.tokenizer = model, model.tokenizer
        self.options = TextOptions.of(**options)
        self.messages = [{"role": "system", "content": system}] if system else []
        self.session, self.held = model.session(), []
        self.mark = None                        # (a fork at the last prompt's end, the ids it holds)
        self.turns = 0

    def say(self, text: str, progress=None, **options) -> TextStream:
        """The assistant's reply to `text`, as it comes."""
        messages = self.messages + [{"role": "user", "content": text}]
        ids = self.tokenizer.apply_chat_template(messages)
        self._resume(ids)
        settings = TextOptions.of(**{**{f.name: getattr(self.options, f.name) for f in fields(TextOptions)},
                                     **options})
        if settings.seed is not None and "seed" not in options:   # a seed given once: a new draw each turn
            settings = replace(settings, seed=(settings.seed + self.turns) % 2**63)
        self.turns += 1
        start = len(self.held)

        def marked() -> None:
            self.mark = (self.session.fork(), ids)

        def done(stream: TextStream) -> None:
            held = ids + stream.ids
            self.held = held if self.session.frontier == len(held) else None    # None: start over next turn
            if self.held is not None:
                self.messages = messages + [{"role": "assistant", "content": stream.text_so_far}]
        return TextStream(self.session, self.tokenizer, ids[start:], settings, self.tokenizer.chat_stops, progress,
                          seen=ids[:start], after_prompt=marked, after=done)

    def _resume(self, ids: list[int]) -> None:
        """A session that holds a prefix of `ids`: this one, the fork at the last prompt, or a new one."""
        if self.held is not None and ids[:len(self.held)] == self.held:
            return
        if self.mark is not None and ids[:len(self.mark[1])] == self.mark[1]:
            self.session, self.held = self.mark[0].fork(), list(self.mark[1])
            return
        self.session, self.held, self.mark = self.model.session(), [], None

    def reset(self) -> None:
        """Forget the conversation (the system message stays)."""
        self.messages = [m for m in self.messages if m["role"] == "system"][:1]
        self.session, self.held, self.mark = self.model.session(), [], None

    def save(self, path) -> None:
        """The session, with the conversation as the snapshot's note (`Session.save`)."""
        note = json.dumps({"messages": self.messages, "held": self.held})
        self.session.save(path, note=note)

    def load(self, path) -> None:
        """The conversation `save` wrote to `path`; InvalidInput (nothing changed) if it is not one."""
        from hebrus.snapshot import read_note
        note = read_note(path)
        try:
            data = json.loads(note) if note is not None else None
            messages, held = templates.checked(data["messages"]) if data["messages"] else [], data["held"]
            if held is not None and not all(type(i) is int for i in held):
                raise ValueError
        except (ValueError, KeyError, TypeError, InvalidInput):
            raise InvalidInput(f"{path} is a saved session but not a saved conversation") from None
        session = self.model.restore(path)
        if held is not None and len(held) != session.frontier:
            raise InvalidInput(f"{path}: its conversation holds {len(held)} tokens, its session {session.frontier}")
        self.session, self.messages, self.held, self.mark = session, messages, held, None


def prompt_ids(tokenizer, prompt) -> tuple[list[int], tuple[str, ...]]:
    """(the ids, the stop strings that end its turn) of a prompt: text, continued as it is, or
    a conversation (a list of {"role", "content"} dicts), the assistant's turn opened."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), ()
    return tokenizer.apply_chat_template(prompt), tokenizer.chat_stops


def stream_text(session, prompt, tokenizer=None, progress=None, **options) -> TextStream:
    """`session` continued with `prompt` (text or a conversation), streamed as text."""
    tokenizer = tokenizer if tokenizer is not None else session.model.tokenizer
    settings = TextOptions.of(**options)
    ids, stops = prompt_ids(tokenizer, prompt)
    if not ids and session.frontier == 0:
        raise InvalidInput("the prompt is empty: a new session needs at least one token of text")
    return TextStream(session, tokenizer, ids, settings, stops, progress)
