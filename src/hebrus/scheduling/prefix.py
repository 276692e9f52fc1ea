"""The automatic prefix cache: sessions that hold a prompt's state after its first t tokens, found
by token content, so that a later prompt beginning with those tokens forks one and feeds only
the rest (the server's `Scheduler` owns one).

What is kept: a session every `every` tokens of a prompt (k, taken as its chunks pass:
`Session.feed_keeping`), one at the end of every prompt and every finished turn, and one at each
point where a prompt left a cached one (a cut inside a block, so that the next prompt sharing
that much recomputes nothing). A kept session is never fed: a hit forks it. Its rows are the
prompt's own blocks, shared by reference, so a kept session costs its slot (the banked state)
and whichever blocks no other entry holds already.

How a prompt is matched: a tree of k-token blocks per space, each node the prefix of its depth
(dict lookups on the blocks' tokens: hash chains that compare the tokens themselves), then an
exact match down to the token among the entries that end inside the next block. The nearest
kept state at or below the longest shared prefix is the hit; how far the prompt runs along the
cached tokens beyond it is the cut.

Spaces keep users apart: the scheduler names one per API key (and `cache_salt`), or one for all
keys when sharing is on. Each space has a holder, whom its bytes count against (`holder(space)`;
by default the space itself): the scheduler's is the API key, so a key spreading its prompts
over many salts still keeps to one key's share. Least recently used entries go first, in two segments (a segmented
LRU): those on probation (never found, or let back from the other) before those a prompt has
found, which are protected up to PROTECTED of the budget's slots (past it, their least recently
found goes back on probation): a burst of prompts that each leave states no other prompt shares,
as every prompt's own end does, does not push out the prefix they all hit, and states found once
long ago do not hold the cache for ever. A holder's own entries go once they pass `per_holder`
bytes while another holder has entries (a share protects the others; alone, a holder may fill
the budget); once all pass `budget`, first those of a holder past its share, then anyone's. The
bytes counted are what the cache holds: each entry's slot, and each block once, however many
entries share it.
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Callable

PROTECTED = 0.75        # the part of the budget's slots that entries a prompt found may keep protected


@dataclass(eq=False)
class _Node:
    """The prefix of `depth` tokens: its entry (a state after exactly them), the entries that
    end inside the next block (by the tokens past `depth`), and the blocks that go on."""
    depth: int
    parent: "_Node | None" = None
    block: tuple = ()
    entry: "_Entry | None" = None
    tails: dict = field(default_factory=dict)
    children: dict = field(default_factory=dict)


@dataclass(eq=False)
class _Entry:
    space: object
    holder: object                      # whom its bytes count against (`PrefixCache.holder`)
    tokens: tuple
    session: object
    node: _Node
    blocks: tuple
    id: int = field(default_factory=itertools.count().__next__)


@dataclass(frozen=True)
class Hit:
    """What `PrefixCache.find` found: the kept session (None: nothing), the tokens it holds, and
    the cut: how many of the prompt's tokens the cache has seen in a row (at least `length`;
    the scheduler keeps the state there as it feeds the rest)."""
    session: object
    length: int
    cut: int


class PrefixCache:
    def __init__(self, budget: int, every: int = 64, per_holder: int | None = None,
                 holder: Callable[[object], object] | None = None):
        per_holder = budget if per_holder is None else per_holder
        if budget < 0 or per_holder < 0:
            raise ValueError(f"prefix cache byte budgets must be at least 0, got budget {budget}, per holder {per_holder}")
        if not 1 <= every:
            raise ValueError(f"the prefix cache keeps a state every k tokens, k at least 1; got {every}")
        self.budget, self.per_holder, self.every = budget, per_holder, every
        self.holder = holder or (lambda space: space)      # a space -> whom its bytes count against
        self.roots: dict[object, _Node] = {}
        self.entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()   # least recently used first
        # the two segments, each least recently used first: never found (or let back), and found
        self.probation: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self.protected: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self.blocks: collections.Counter = collections.Counter()         # block -> entries holding it
        self.held_blocks: dict[object, collections.Counter] = {}           # holder -> its blocks
        self.held_slots: collections.Counter = collections.Counter()      # holder -> its entries
        self.slot_bytes = self.block_bytes = 0                            # learnt from the first entry
        # what /metrics reports: lookups, lookups that found a state, prompt tokens not fed
        # again, and states kept as a chunk passed that could not be cached (the caller counts)
        self.lookups = self.hits = self.saved = self.lost = 0

    @property
    def keeps(self) -> bool:
        return min(self.budget, self.per_holder) > 0

    @property
    def used(self) -> int:
        return len(self.entries) * self.slot_bytes + len(self.blocks) * self.block_bytes

    def used_by(self, holder) -> int:
        """The bytes `holder`'s entries hold (a block once, however many of them share it)."""
        return self.held_slots[holder] * self.slot_bytes + len(self.held_blocks.get(holder, ())) * self.block_bytes

    def marks(self, start: int, stop: int, cut: int = 0) -> list[int]:
        """The positions in (start, stop] where a prompt fed from `start` to `stop` (its end)
        keeps its state: every k-th, the cut, the end."""
        first = (start // self.every + 1) * self.every
        out = set(range(first, stop + 1, self.every)) | {stop}
        if start < cut < stop:
            out.add(cut)
        return sorted(out)

    # ---- finding --------------------------------------------------------------------------
    def find(self, space, prompt) -> Hit:
        """The kept session of `space` holding the longest prefix of `prompt`, and the cut. The
        one found becomes the most recently used."""
        self.lookups += 1
        node, best, k = self.roots.get(space), None, self.every
        if node is None:
            return Hit(None, 0, 0)
        prompt = tuple(prompt)
        while True:                 # deeper is longer: a node's entry, then its tails, then its child's
            rest = prompt[node.depth:node.depth + k]
            if node.entry is not None:
                best = node.entry
            for tail, entry in node.tails.items():
                if len(tail) <= len(rest) and rest[:len(tail)] == tail and (best is None or len(entry.tokens) > len(best.tokens)):
                    best = entry
            child = node.children.get(rest)
            if child is None:
                break
            node = child
        seen = max((_common(rest, other) for other in itertools.chain(node.children, node.tails)), default=0)
        cut = node.depth + seen
        if best is None:
            return Hit(None, 0, cut)
        self.entries.move_to_end(best.id)
        self._protect(best)
        self.hits += 1
        self.saved += len(best.tokens)
        return Hit(best.session, len(best.tokens), max(cut, len(best.tokens)))

    # ---- keeping --------------------------------------------------------------------------
    def put(self, space, tokens, session) -> None:
        """Keep `session`, which holds `tokens` and is never fed again, for `space` (replacing
        one that holds the same tokens); not kept if it alone is over the budget, or over its
        holder's share while another holder has entries. A holder's entries are brought within
        its share as it keeps one (a holder over it, alone until another's first entry came,
        stays so until its next entry kept, or until all pass the budget)."""
        if not self.keeps or not len(tokens):
            return
        tokens = tuple(tokens)
        image = session.image
        if not self.slot_bytes:
            self.slot_bytes, self.block_bytes = image.pool.slot_nbytes, image.pool.block_nbytes
        blocks = image.public.table
        holder = self.holder(space)
        shared = any(other != holder for other in self.held_slots)     # a share protects other holders' entries
        if self.slot_bytes + len(blocks) * self.block_bytes > (min(self.budget, self.per_holder) if shared else self.budget):
            return
        node = self._node(space, tokens)
        rest = tokens[node.depth:]
        old = node.tails.get(rest) if rest else node.entry
        found = old is not None and old.id in self.protected      # a replaced entry keeps its segment
        if old is not None:
            self._drop(old)
        node = self._node(space, tokens)                # dropping may have pruned it
        entry = _Entry(space, holder, tokens, session, node, blocks)
        if rest:
            node.tails[rest] = entry
        else:
            node.entry = entry
        self.entries[entry.id] = entry
        self.probation[entry.id] = entry
        if found:
            self._protect(entry)
        self.blocks.update(blocks)
        self.held_blocks.setdefault(holder, collections.Counter()).update(blocks)
        self.held_slots[holder] += 1
        # the new one fits alone: it is never dropped
        while shared and self.used_by(holder) > self.per_holder:
            self._drop(self._first(lambda e: e.holder == holder and e is not entry))
        while self.used > self.budget:
            over = self._first(lambda e: e is not entry and e.holder != holder and self.used_by(e.holder) > self.per_holder)
            self._drop(over or self._first(lambda e: e is not entry))

    def _first(self, among) -> _Entry | None:
        """The entry of those `among` admits that goes first: the least recently used on
        probation, else the least recently used protected one (None: no entry is admitted)."""
        return next((e for segment in (self.probation, self.protected) for e in segment.values() if among(e)), None)

    def _protect(self, entry: _Entry) -> None:
        """`entry` found: the most recently used of the protected segment, whose least recently
        found go back on probation (as its most recently used) past PROTECTED of the budget's slots."""
        self.probation.pop(entry.id, None)
        self.protected.pop(entry.id, None)
        self.protected[entry.id] = entry
        room = max(1, int(PROTECTED * self.budget) // max(self.slot_bytes, 1))
        while len(self.protected) > room:
            _, demoted = self.protected.popitem(last=False)
            self.probation[demoted.id] = demoted

    def shed(self) -> bool:
        """Drop the entry that goes first (the pool needs its slot): False if none is held."""
        if not self.entries:
            return False
        self._drop(self._first(lambda e: True))
        return True

    def forget(self, space) -> None:
        """Drop every entry of `space`."""
        for entry in [e for e in self.entries.values() if e.space == space]:
            self._drop(entry)

    def _node(self, space, tokens: tuple) -> _Node:
        """The node of `tokens`' whole blocks, made where missing."""
        node, k = self.roots.setdefault(space, _Node(0)), self.every
        for depth in range(k, len(tokens) + 1, k):
            block = tokens[depth - k:depth]
            child = node.children.get(block)
            if child is None:
                child = node.children[block] = _Node(depth, node, block)
            node = child
        return node

    def _drop(self, entry: _Entry) -> None:
        del self.entries[entry.id]
        self.probation.pop(entry.id, None)
        self.protected.pop(entry.id, None)
        node, rest = entry.node, entry.tokens[entry.node.depth:]
        if rest:
            del node.tails[rest]
        else:
            node.entry = None
        self.blocks.subtract(entry.blocks)
        own = self.held_blocks[entry.holder]
        own.subtract(entry.blocks)
        for counter in (self.blocks, own):
            for block in entry.blocks:
                if counter[block] <= 0:
                    del counter[block]
        self.held_slots[entry.holder] -= 1
        if not self.held_slots[entry.holder]:
            del self.held_slots[entry.holder], self.held_blocks[entry.holder]
        while node is not None and node.entry is None and not node.tails and not node.children:
            if node.parent is None:
                del self.roots[entry.space]
                break
            del node.parent.children[node.block]
            node = node.parent


def _common(a: tuple, b: tuple) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
