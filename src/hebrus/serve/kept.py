"""Finished conversations kept for later turns, by API key (the server's `Scheduler` owns one).

`find` looks only among the asking key's own conversations; `put` keeps one. Least recently used
go first: a key's own once its conversations pass `per_key` bytes, anyone's once all pass `budget`.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class Kept:
    """Finished conversations by API key, with their rows' and banked state's bytes counted.
    `per_key` (default: all of `budget`) keeps one key from evicting every other key's;
    `size_of` (default: the session's bytes) is for tests."""

    def __init__(self, budget: int, per_key: int | None = None,
                 size_of: Callable[[object], int] | None = None):
        per_key = budget if per_key is None else per_key
        if budget < 0 or per_key < 0:
            raise ValueError(f"kept byte budgets must be at least 0, got budget {budget}, per_key {per_key}")
        self.budget, self.per_key, self.used = budget, per_key, 0
        self.size_of = size_of or _session_bytes
        # least recently used first: (key, tokens) -> (session, bytes), and per key tokens -> bytes
        self.entries: OrderedDict[tuple, tuple] = OrderedDict()
        self.own: dict[str, OrderedDict[tuple, int]] = {}
        self.used_by: dict[str, int] = {}                   # key -> its entries' bytes

    @property
    def keeps(self) -> bool:
        """Whether anything at all can be kept (a budget of 0 keeps nothing)."""
        return min(self.budget, self.per_key) > 0

    def find(self, key: str, prompt: list[int]):
        """The kept session of `key` whose tokens are the longest prefix of `prompt`, and how
        many tokens it holds; (None, 0) if none. The one found becomes the most recently used."""
        best, length, whole = None, 0, tuple(prompt)
        for tokens in self.own.get(key, ()):
            n = len(tokens)
            if length < n <= len(whole) and whole[n - 1] == tokens[-1] and whole[:n] == tokens:
                best, length = tokens, n
        if best is None:
            return None, 0
        self.own[key].move_to_end(best)
        self.entries.move_to_end((key, best))
        return self.entries[(key, best)][0], length

    def put(self, key: str, tokens: list[int], session) -> None:
        """Keep `session`, which holds `tokens`, for `key` (replacing one that holds the same);
        not kept if it alone is over `key`'s share or the budget."""
        size = self.size_of(session)
        if size > min(self.budget, self.per_key):
            return
        tokens = tuple(tokens)
        self._drop(key, tokens)
        self.entries[(key, tokens)] = (session, size)
        self.own.setdefault(key, OrderedDict())[tokens] = size
        self.used_by[key] = self.used_by.get(key, 0) + size
        self.used += size
        while self.used_by[key] > self.per_key:             # the new one fits alone: it is never dropped
            self._drop(key, next(iter(self.own[key])))
        while self.used > self.budget:
            self._drop(*next(iter(self.entries)))

    def _drop(self, key: str, tokens: tuple) -> None:
        entry = self.entries.pop((key, tokens), None)
        if entry is None:
            return
        size = entry[1]
        self.used -= size
        self.used_by[key] -= size
        del self.own[key][tokens]
        if not self.own[key]:
            del self.own[key], self.used_by[key]


def _session_bytes(session) -> int:
    return session.image.held_bytes()
