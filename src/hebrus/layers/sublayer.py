"""The frame every layer kind's stage sits in: `scan` (a chunk as one call in fast mode, token
by token in exact mode), `Sublayer` (the residual's pre, RMSNorm, the sublayer, the residual's
post) and `FeedForward`, the ffn stage around a kind's feed-forward function and the branches'
terms."""
from __future__ import annotations

from typing import Callable

import torch

from hebrus.layers.hyper import PlainResidual, residual
from hebrus.layers.kernels import Kernels
from hebrus.ops.norm import add_rms_norm, rms_norm
from hebrus.state.context import StepContext
from hebrus.state.step import StepBatch

Params = dict[str, torch.Tensor]


def scan(step: Callable, whole_chunk: bool, batch: StepBatch, inputs: tuple[torch.Tensor | None, ...], state,
         ragged: bool = False):
    """`step(batch, *inputs, state) -> (out, state)` over the step; `out` a tensor or a tuple of
    tensors, and an input or a part of `out` may be None (taken and given back whole). Its two shapes: one
    session's chunk (state its value), or several sessions' single tokens at once (fast mode,
    `batch.one_each`: state [N, ...]); any other step of several sessions runs session by
    session (state i its value), the states stacked back [N, ...], but in fast mode a step
    without state (None), or one that says it takes any step (`ragged`, state [N, ...]),
    takes the whole step in one call. One session's chunk runs as
    one call with `whole_chunk` (fast mode), else token by token (on fresh copies, with
    `batch.token(t)`). For a prefix transaction (`batch.each`), the state after every token,
    stacked, instead of the last: exact mode keeps each token's, and a whole-chunk step is
    called with `each=True` to return them itself. With `batch.marks`, each session's chunk
    runs in pieces that end at its marks, the state after each piece kept: stacked, session
    after session ([M, ...], `StepBatch.keeps`); a step that takes any step runs every
    session's r-th piece in one call (`_by_rounds`)."""
    marked = batch.marks is not None and state is not None
    if marked and batch.sessions > 1 and whole_chunk and ragged and not batch.one_each:
        return _by_rounds(step, batch, inputs, state)
    if batch.sessions > 1 and not (whole_chunk and (batch.one_each or state is None or ragged)):
        outs, states = [], []
        for i in range(batch.sessions):
            mine = None if state is None else _index(state, i)
            out, mine = scan(step, whole_chunk, batch.session(i), tuple(_rows(batch, i, x) for x in inputs), mine)
            outs.append(out)
            states.append(mine)
        return _cat(outs), (None if state is None else (_cat if marked else _stack)(states))
    if marked and batch.sessions == 1:
        return _by_marks(step, whole_chunk, batch, inputs, state)
    each = batch.each and state is not None     # a step without state has nothing to keep per token
    if whole_chunk:
        return step(batch, *inputs, state, each=True) if each else step(batch, *inputs, state)
    outs, states = [], []
    for t in range(inputs[0].shape[0]):
        out, state = step(batch.token(t), *(None if x is None else x[t:t + 1].clone() for x in inputs), state)
        outs.append(out)
        states.append(state)
    if each:
        state = _stack(states)
    return _cat(outs), state


def _by_marks(step: Callable, whole_chunk: bool, batch: StepBatch, inputs: tuple, state):
    """`scan` of one session's chunk in pieces ending at its marks -> (out, the state after
    each piece [len(marks), ...])."""
    outs, states, start = [], [], 0
    for end in batch.marks[0]:
        out, state = scan(step, whole_chunk, batch.span(start, end),
                          tuple(None if x is None else x[start:end] for x in inputs), state)
        outs.append(out)
        states.append(state)
        start = end
    return _cat(outs), _stack(states)


def _by_rounds(step: Callable, batch: StepBatch, inputs: tuple, state):
    """`scan` of several sessions' chunks, each in pieces ending at its marks, for a step that
    takes any step: round r runs the r-th piece of every session that has one in one call (a
    ragged step of pieces, each from the state its session's previous piece left) -> (out, the
    state after every piece, session after session [M, ...])."""
    edges = [(0,) + counts for counts in batch.marks]           # session i's piece r: edges[i][r]..edges[i][r + 1]
    now = [_index(state, i) for i in range(batch.sessions)]
    kept: list[list] = [[] for _ in range(batch.sessions)]
    pieces = []                                                  # (first row, its out)
    for r in range(max(map(len, batch.marks))):
        who = [i for i in range(batch.sessions) if r < len(batch.marks[i])]
        rows = [(batch.bounds[i] + edges[i][r], batch.bounds[i] + edges[i][r + 1]) for i in who]
        piece = StepBatch.ragged(torch.cat([batch.ids[a:b] for a, b in rows]),
                                 [batch.starts[i] + edges[i][r] for i in who], [b - a for a, b in rows])
        piece.members = tuple(batch.which[i] for i in who)
        ins = tuple(None if x is None else torch.cat([x[a:b] for a, b in rows]) for x in inputs)
        out, after = scan(step, True, piece, ins, now[who[0]] if len(who) == 1 else _stack([now[i] for i in who]),
                          ragged=True)
        for j, i in enumerate(who):
            now[i] = after if len(who) == 1 else _index(after, j)
            kept[i].append(now[i])
            pieces.append((rows[j][0], _part(out, piece.bounds[j], piece.bounds[j + 1])))
    pieces.sort(key=lambda p: p[0])
    return _cat([out for _, out in pieces]), _cat([_stack(states) for states in kept])


def _part(out, a: int, b: int):
    """Rows a..b of `scan`'s out (each part of a tuple; None stays None)."""
    if isinstance(out, tuple):
        return tuple(None if x is None else x[a:b] for x in out)
    return out[a:b]


def _rows(batch: StepBatch, i: int, x: torch.Tensor | None):
    return None if x is None else batch.rows_of(i, x)


def _cat(outs: list):
    """The pieces of `scan`'s out put back together (each part of a tuple; None stays None)."""
    if isinstance(outs[0], tuple):
        return tuple(None if parts[0] is None else torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


def _index(state, i: int):
    return tuple(s[i] for s in state) if isinstance(state, tuple) else state[i]


def _stack(states: list):
    return tuple(map(torch.stack, zip(*states))) if isinstance(states[0], tuple) else torch.stack(states)


class Sublayer:
    """Shared shape of the mixer and ffn stages: the residual's pre, RMSNorm, the sublayer, the
    residual's post (`framed`: a kind writes only the sublayer, from its normed input to its
    output). With one plain stream in fast mode the post's add is left to the next sublayer
    (`StepBatch.pending`), whose norm takes it in the same kernel (`ops.norm.add_rms_norm`)."""

    # whether a planned step of lanes does work here up to its tables' width (rows gathered up to
    # it), not only up to each lane's position: then the runner keys its graphs by finer widths
    reads_to_width = False

    def __init__(self, s, params: Params, layer: int, part: str, kernels: Kernels):
        p = f"layers.{layer}."
        self.layer, self.kernels, self.eps = layer, kernels, s.rms_norm_eps
        self.residual = residual(s, params, f"{p}{part}_hc", kernels)
        self.norm = params[f"{p}{part}_norm.weight"]
        self.rms_norm, self.add_rms_norm = kernels.fused(rms_norm), kernels.fused(add_rms_norm)
        self.defer = kernels.whole_chunk and isinstance(self.residual, PlainResidual)
        self.reduce = kernels.reduce

    def framed(self, batch: StepBatch, body: Callable, state, inputs: tuple = (), ragged: bool = False,
               whole: bool = False):
        """The sublayer over the step, through `scan`: `body(at, h, *inputs, state) -> (y, state)`
        (called with `each=True` where `scan` says) gets its normed input h [T, D] and gives its
        output y [T, D]; the residual's pre and the norm run before it, the residual's post after
        it, and the streams and the pending output move on in `batch`. Under tensor parallelism
        a rank's output is its part of the sum, added up across ranks here (`Kernels.reduce`),
        unless the body gives it `whole` (it adds its own parts up). -> the state `scan` gives
        back."""
        def step(at, X, pending, *rest, **each):
            if pending is not None:             # the last sublayer's output, added in the norm's op
                X, h = self.add_rms_norm(X, pending, self.norm, self.eps)
                post = comb = None
            else:
                c, post, comb = self.residual.pre(X)
                h = self.rms_norm(c, self.norm, self.eps)
            y, state = body(at, h, *rest, **each)
            if not whole:
                y = self.reduce(y)
            if self.defer:                      # left pending where the next sublayer adds it
                return (X, y), state
            return (self.residual.post(X, y, post, comb), None), state

        (batch.streams, batch.pending), state = scan(step, self.kernels.whole_chunk, batch,
                                                     (batch.streams, batch.pending, *inputs), state, ragged)
        return state


class FeedForward(Sublayer):
    """y = feed(h) plus each branch's term for this layer. `feed` is the ffn kind's: called as
    `feed.bind(txn)` once a step, which gives `f(h [T, D], step) -> y [T, D]`; a branch's term
    reads its value (`StepBatch.terms`, by the branch's place in the spec) at this layer."""

    def __init__(self, s, params: Params, layer: int, kernels: Kernels, feed, terms: dict[int, Callable]):
        super().__init__(s, params, layer, "ffn", kernels)
        self.name = f"layers.{layer}.ffn"
        self.feed, self.terms = feed, terms

    def run(self, txn: StepContext, batch: StepBatch) -> None:
        f = self.feed.bind(txn)
        terms = list(self.terms.values())

        def body(at, h, *rest):
            *inputs, state = rest
            y = self.reduce(f(h, at))               # the branches' terms are whole on every rank
            for term, x in zip(terms, inputs):
                y = y + term(h, x)
            return y, state

        self.framed(batch, body, None, tuple(batch.terms[i][:, self.layer] for i in self.terms), whole=True)
