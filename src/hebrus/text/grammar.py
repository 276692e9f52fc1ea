"""Structured output: what generated text must match — a JSON schema, any JSON object, a regular
expression or a Lark grammar — as a constraint on a session's tokens (`hebrus.state.constraint`).

Matching runs in llguidance: it has no dependencies of its own (xgrammar's Linux wheel needs
triton, which the CPU route keeps out), computes a token mask from the grammar's state in tens
of microseconds without precomputing per-state tables, and supports most of JSON Schema; what it
does not support is refused up front, by name. `Grammar` is the user's description; `start(a
tokenizer)` compiles it into a `GrammarState`, the constraint value: immutable, each `after`
a new one (the matcher copied, then advanced), so a chunk's transaction can publish it or drop it.
"""
from __future__ import annotations

import functools
import json
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch

from hebrus.errors import InvalidInput

KINDS = ("json", "regex", "lark")
# masks computed on llguidance's threads from this many at once, where there are cores for them
# (on two cores, 64 masks took 5.9 ms on its threads and 1.5 ms one after another)
PARALLEL_MASKS = 8 if (os.cpu_count() or 1) >= 8 else 1 << 30
# JSON as one line with a space after each separator and no other whitespace: a model may not
# pad its output with whitespace forever (flexible whitespace lets a small model do just that)
JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@dataclass(frozen=True)
class Grammar:
    """What the text must match: `kind` "json" (`source`: a JSON schema as a JSON string; "{}"
    with `any_object`: any JSON object), "regex" (a regular expression the whole text matches) or
    "lark" (a grammar in Lark's syntax, llguidance's dialect)."""
    kind: str
    source: str

    @classmethod
    def json(cls, schema: dict | str | None = None) -> "Grammar":
        """Text that is one JSON value valid under `schema` (a dict or its JSON text); None: any
        JSON object."""
        if schema is None:
            schema = {"type": "object"}
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidInput(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidInput(f"a JSON schema is an object (or true/false), not {type(schema).__name__}")
        return cls("json", json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        if not isinstance(pattern, str) or not pattern:
            raise InvalidInput("a regular expression is a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        if not isinstance(text, str) or not text.strip():
            raise InvalidInput("a Lark grammar is a non-empty string")
        return cls("lark", text)

    @classmethod
    def of(cls, value) -> "Grammar":
        """`value` as a Grammar: one already, or a dict (a JSON schema)."""
        if isinstance(value, Grammar):
            return value
        if isinstance(value, dict):
            return cls.json(value)
        raise InvalidInput(f"grammar must be a hebrus.text.grammar.Grammar or a JSON schema (a dict), "
                           f"not {type(value).__name__}")

    def start(self, tokenizer, vocab_size: int) -> "GrammarState":
        """The constraint at the start of the text, for `tokenizer`'s ids in a vocabulary of
        `vocab_size`: InvalidInput (naming what is wrong, or the schema keywords not supported)
        when the grammar cannot be compiled."""
        from llguidance import LLMatcher
        compiled = self._compiled()
        ll = _ll_tokenizer(tokenizer, vocab_size)
        error, messages = LLMatcher.validate_grammar_with_warnings(compiled, ll)
        if error:
            raise InvalidInput(f"the {_WHAT[self.kind]} is not supported: {'; '.join(messages)}")
        matcher = LLMatcher(ll, compiled, log_level=0)
        if matcher.is_error():
            raise InvalidInput(f"the {_WHAT[self.kind]} is not supported: {matcher.get_error()}")
        return GrammarState(matcher, vocab_size, ll.vocab_size, self)

    def _compiled(self) -> str:
        from llguidance import LLMatcher
        try:
            if self.kind == "json":
                return LLMatcher.grammar_from_json_schema(self.source, overrides=JSON_LAYOUT)
            if self.kind == "regex":
                return LLMatcher.grammar_from_regex(self.source)
            return LLMatcher.grammar_from_lark(self.source)
        except ValueError as exc:
            raise InvalidInput(f"the {_WHAT[self.kind]} is not valid: {exc}") from None


_WHAT = {"json": "JSON schema", "regex": "regular expression", "lark": "Lark grammar"}


class GrammarState:
    """A grammar's state after the tokens so far: a constraint value (`state.constraint`). Never
    changed: `after` advances a copy."""

    __slots__ = ("_matcher", "_vocab", "_mask", "_matcher_vocab", "_next", "grammar")

    def __init__(self, matcher, vocab_size: int, matcher_vocab: int, grammar: Grammar):
        self._matcher, self._vocab, self._mask = matcher, vocab_size, None
        self.grammar = grammar                  # what it follows (started again in another process)
        self._matcher_vocab = matcher_vocab     # the ids llguidance's tokenizer knows (its mask's bits)
        # (token, the value after it): the last one-token `after`, so that a value made ahead of
        # a step (its mask computed while the step runs) is the one the step's flip publishes
        self._next = None

    def allows(self, tokens: Sequence[int]) -> int:
        return self._matcher.validate_tokens(list(tokens)) if tokens else 0

    def after(self, tokens: Sequence[int]) -> "GrammarState":
        one = tokens[0] if len(tokens) == 1 else None
        known = self._next
        if one is not None and known is not None and known[0] == one:
            return known[1]
        matcher = self._matcher.deep_copy()
        if not matcher.consume_tokens(list(tokens)):
            raise ValueError(f"the grammar does not allow these tokens: {matcher.get_error()}")
        value = GrammarState(matcher, self._vocab, self._matcher_vocab, self.grammar)
        if one is not None:
            with _memo:                         # two threads making the same value keep one of them
                known = self._next
                if known is not None and known[0] == one:
                    return known[1]
                self._next = (one, value)
        return value

    def mask(self) -> torch.Tensor:
        if self._mask is None:                  # computed once per value (a value is never changed)
            self._mask = torch.frombuffer(bytearray(self._matcher.compute_bitmask()), dtype=torch.int32)
        return self._mask

    @staticmethod
    def masks(states: list["GrammarState"]) -> list[torch.Tensor]:
        """`mask()` of each of `states`, those not computed yet computed together on llguidance's
        threads (a step of many constrained sessions waits for the slowest, not for the sum)."""
        todo = list({id(s): s for s in states if s._mask is None}.values())   # a value shared by several: once
        if len(todo) >= PARALLEL_MASKS and len({s._matcher_vocab for s in todo}) == 1:
            words = (todo[0]._matcher_vocab + 31) // 32
            out = torch.zeros((len(todo), words), dtype=torch.int32)
            _executor().unsafe_compute_mask_ptr([(s._matcher, i) for i, s in enumerate(todo)], out.data_ptr(),
                                                words * 4, len(todo))
            for s, row in zip(todo, out):
                s._mask = row
        return [s.mask() for s in states]


    @property
    def finished(self) -> bool:
        return self._matcher.is_stopped()

    @property
    def complete(self) -> bool:
        """Whether the text so far is a whole match (it may still go on)."""
        return self._matcher.is_accepting()


# llguidance's view of a tokenizer, made once per tokenizer object (about a second for a large one)
_made: "weakref.WeakKeyDictionary[object, dict]" = weakref.WeakKeyDictionary()


def _ll_tokenizer(tokenizer, vocab_size: int):
    by_size = _made.setdefault(tokenizer, {})
    if vocab_size not in by_size:
        by_size[vocab_size] = _make_ll(tokenizer, vocab_size)
    return by_size[vocab_size]


def _make_ll(tokenizer, vocab_size: int):
    from llguidance import LLTokenizer, TokenizerWrapper
    inner = getattr(tokenizer, "tokenizer", None)
    stops = list(tokenizer.stop_ids)
    if inner is not None:                       # a checkpoint's tokenizer.json
        return LLTokenizer(inner.to_str(), n_vocab=vocab_size, eos_token=stops or None)
    listed = getattr(tokenizer, "token_bytes", None)
    if isinstance(listed, (list, tuple)):      # each id's bytes, listed (the bench's made-up vocabulary)
        return LLTokenizer(TokenizerWrapper(_Listed(listed, stops[0])), n_vocab=vocab_size)
    # bytes (token id = byte): an end token past the model's vocabulary when it has none, which
    # the mask never allows (the text ends when the grammar allows nothing more)
    end = stops[0] if stops else max(vocab_size, 256)
    return LLTokenizer(TokenizerWrapper(_Bytes(end)), n_vocab=max(vocab_size, end + 1))


class _Listed:
    """A vocabulary given as each id's bytes, for llguidance (it tokenizes text greedily)."""

    def __init__(self, tokens: list[bytes], end: int):
        self.eos_token_id, self.bos_token_id, self.tokens, self.special_token_ids = end, None, tokens, [end]
        self._ids = {t: i for i, t in enumerate(tokens) if len(t) == 1}

    def __call__(self, text: bytes) -> list[int]:
        return [self._ids[bytes([b])] for b in text]


class _Bytes:
    """Bytes as llguidance's generic tokenizer: token i is byte i, `end` the end token."""

    def __init__(self, end: int):
        self.eos_token_id, self.bos_token_id = end, None
        self.tokens = [bytes([i]) for i in range(256)] + [b""] * (end - 256) + [b"<|end|>"]
        self.special_token_ids = [end]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


_memo = threading.Lock()


@functools.lru_cache(maxsize=1)
def _executor():
    """llguidance's pool of threads that compute many masks at once (one per core)."""
    from llguidance import LLExecutor
    return LLExecutor()
