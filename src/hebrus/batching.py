"""Several sessions fed together in one pass (`feed_many`, `Batch`): each its own chunk (one
token, or a prompt's tokens), the stages run once for all of them, each session its own
transaction."""
from __future__ import annotations


import numpy as np
import torch

from hebrus import arguments, faults
from hebrus.engine import batch
from hebrus.errors import InvalidInput
from hebrus.engine.graphs import decode_route
from hebrus.session import Session, check_allowed, exclusive


def feed_many(sessions, tokens, outs=None) -> list:
    """A chunk for each of several sessions of one model, in one pass (the stages run once for
    all of them); each session is its own transaction. `tokens[i]` is session i's: one token id,
    or a list (or 1-D tensor) of them, of any length ≥ 1; a 1-D tensor of ids is one each. Fast
    mode runs the step's tokens together; exact mode runs each session's chunk token by token,
    as it would alone. Returns, per session in order, its last logits (a new tensor, or
    `outs[i]`, written only if that session publishes) or the `ChunkAborted` that aborted it:
    one session's failure (a NaN, a failed check, refused blocks or budget in its rows) leaves
    the others published. A failure of the pass itself (an exception, device work that did not
    complete) leaves every session unchanged, and each session that did not fail on its own
    then runs its chunk alone, so only a session that fails again is reported. A fault armed for
    one session (`hebrus.inject(..., session=s)`) fires in its part of the pass; one armed for
    no session in particular makes the sessions feed one at a time. Every argument is checked
    first; a bad one raises `InvalidInput` and changes nothing. A signal that arrives while the
    sessions publish is delivered once they all have; its exception carries `.results`, the
    list above. (`Batch` does the same for a fixed list of sessions, step after step, from CUDA
    graphs on a GPU.) Sessions of a model over tensor-parallel ranks step together on every
    rank (`ParallelModel.feed_many`)."""
    over = _over_ranks(sessions)
    if over is not None:
        return over.feed_many(sessions, tokens, outs)
    sessions, model = _batch_sessions(sessions)
    runners = {id(s._steps) for s in sessions}
    return _feed_together(sessions, model, tokens, outs, sessions[0]._steps if len(runners) == 1 else None)


def feed_keeping_many(sessions, tokens, marks) -> list:
    """`feed_many` that also keeps states, as `Session.feed_keeping` does for one session:
    `marks[i]` holds session i's counts of its chunk's tokens (strictly increasing, from 1 to
    the chunk's length; empty: it keeps none). Returns, per session in order, (its last logits,
    a new session after each of its marks, None where the pool had no slot) or the
    `ChunkAborted` that aborted it. Fast mode runs every chunk in one pass (a stage that takes
    any step runs the sessions' pieces between marks in rounds, each round one call); exact mode
    runs each session's chunk as it would alone, so each kept session is bit for bit what
    `feed_keeping` keeps. Failures, checks and faults as `feed_many`'s; nothing is changed by a
    bad argument. Sessions of a model over tensor-parallel ranks: as `feed_many`'s."""
    over = _over_ranks(sessions)
    if over is not None:
        return over.feed_keeping_many(sessions, tokens, marks)
    sessions, model = _batch_sessions(sessions)
    chunks = _chunks(tokens, sessions, model)
    chunks = list(chunks) if isinstance(chunks, torch.Tensor) else chunks
    if not isinstance(marks, (list, tuple)) or len(marks) != len(sessions):
        raise InvalidInput(f"marks must be a list of {len(sessions)} lists of token counts, one per session")
    counts = []
    for i, (chunk, mine) in enumerate(zip(chunks, marks)):
        try:
            empty = isinstance(mine, (list, tuple, range)) and not len(mine)
            counts.append(() if empty else arguments.marks(mine, len(chunk)))
        except InvalidInput as exc:
            raise InvalidInput(f"session {i}: {exc}") from None
    if faults.armed():
        for s in sessions:
            s._check_faults()
    with exclusive(sessions):
        _check_rooms(sessions, [len(c) for c in chunks])
        _check_constraints(sessions, chunks)
        with torch.inference_mode():
            starts = [s.image.public for s in sessions]
            every = [c if c and c[-1] == len(chunk) else c + (len(chunk),) for c, chunk in zip(counts, chunks)]
            if any(f.session is None for f in faults.armed()):      # a fault for whichever comes first: one at a time
                results = [batch.run_marked_alone(model, s, c, e) for s, c, e in zip(sessions, chunks, every)]
            else:
                results = batch.run_marked_step(model, sessions, chunks, every)
            return [r if isinstance(r, BaseException) else (r[0], s._kept_at(start, chunk, c, r[1]))
                    for r, s, start, chunk, c in zip(results, sessions, starts, chunks, counts)]


class Batch:
    """A fixed list of sessions of one model that step together, call after call (a decode loop
    over many conversations). `feed` is `feed_many` for them; the static step plan of one token
    each is kept between calls (a step that carries a longer chunk runs eagerly), captured as CUDA graphs with `decode="graph"` (the
    default on a GPU; "planned" runs the plan uncaptured, "eager" runs every step as
    `feed_many` does)."""

    def __init__(self, sessions, decode: str = "auto"):
        self.sessions, self.model = _batch_sessions(sessions)
        self.decode = decode_route(self.model, decode)
        self._steps = (self.model.steps(capture=self.decode == "graph")
                       if self.decode in ("planned", "graph") else None)

    def feed(self, tokens, outs=None) -> list:
        return _feed_together(self.sessions, self.model, tokens, outs, self._steps)


def _over_ranks(sessions):
    """The `ParallelModel` whose sessions these are, or None (sessions of a model in this process)."""
    return getattr(sessions[0], "over_ranks", None) if isinstance(sessions, (list, tuple)) and sessions else None


def _batch_sessions(sessions) -> tuple[list, object]:
    sessions = list(sessions) if isinstance(sessions, (list, tuple)) else None
    if not sessions or not all(isinstance(s, Session) for s in sessions):
        raise InvalidInput("sessions must be a non-empty list of hebrus sessions")
    if len({id(s) for s in sessions}) != len(sessions):
        raise InvalidInput("each session may appear once in a batch")
    model = sessions[0].model
    if any(s.model is not model for s in sessions):
        raise InvalidInput("the sessions of a batch must share one model object")
    if any(s.journal is not None for s in sessions):
        raise InvalidInput("journaled sessions feed one at a time (a batch does not write journals yet)")
    return sessions, model


def _chunks(tokens, sessions: list, model):
    """Each session's token ids as a 1-D tensor, checked: a chunk each (a list), or one id each
    (a tensor [N, 1]: row i session i's chunk)."""
    vocab, limit = model.spec.vocab_size, model.spec.max_context
    sequence = (list, tuple, range, np.ndarray, torch.Tensor)
    if (isinstance(tokens, (list, tuple)) and not all(type(t) is int for t in tokens)
            and any(isinstance(t, sequence) for t in tokens)):
        if len(tokens) != len(sessions):
            raise InvalidInput(f"tokens must hold {len(sessions)} chunks, one per session; got {len(tokens)}")
        chunks = []
        for i, chunk in enumerate(tokens):
            try:
                ids = arguments.in_vocabulary(arguments.token_ids(chunk if isinstance(chunk, sequence) else [chunk],
                                                                  limit), vocab)
            except InvalidInput as exc:
                raise InvalidInput(f"session {i}: {exc}") from None
            if not len(ids):
                raise InvalidInput(f"session {i}: a chunk holds at least one token id")
            chunks.append(ids)
        return chunks
    ids = arguments.in_vocabulary(arguments.token_ids(tokens, limit), vocab)
    if len(ids) != len(sessions):
        raise InvalidInput(f"tokens must hold {len(sessions)} token ids, one per session; got {len(ids)}")
    return ids[:, None]


def _feed_together(sessions, model, tokens, outs, steps) -> list:
    chunks = _chunks(tokens, sessions, model)
    if outs is None:
        outs = [None] * len(sessions)
    elif not isinstance(outs, (list, tuple)) or len(outs) != len(sessions):
        raise InvalidInput(f"outs must be None or a list of {len(sessions)} tensors or Nones")
    outs = list(outs)                           # checked and used from this copy only
    for s, out in zip(sessions, outs):
        s._check_out(out)
    spans = sorted((o.data_ptr(), o.data_ptr() + o.numel() * o.element_size()) for o in outs if o is not None)
    if any(end > start for (_, end), (start, _) in zip(spans, spans[1:])):
        raise InvalidInput("outs must not overlap: each session's logits need their own memory")
    if faults.armed():
        for s in sessions:
            s._check_faults()
    with exclusive(sessions):
        lengths = [1] * len(sessions) if isinstance(chunks, torch.Tensor) else [c.shape[0] for c in chunks]
        _check_rooms(sessions, lengths)
        _check_constraints(sessions, chunks)
        with torch.inference_mode():
            if any(f.session is None for f in faults.armed()):      # a fault for whichever comes first: one at a time
                return [batch.run_alone(model, s, c, o) for s, c, o in zip(sessions, chunks, outs)]
            if steps is not None and max(lengths) == 1 and steps.accepts(1):
                def conclude(txn, work) -> list:
                    return batch.conclude(model, txn, work, sessions, chunks, outs)
                ids = chunks[:, 0] if isinstance(chunks, torch.Tensor) else torch.cat(chunks)
                return steps.run([s.image for s in sessions], [s.budget for s in sessions], ids, 1,
                                 False, conclude)
            return batch.run_step(model, sessions, chunks, outs)


def _check_rooms(sessions, lengths: list[int]) -> None:
    """Each session has room for its chunk (the caller holds their locks); the first that has
    not is named."""
    for i, (s, length) in enumerate(zip(sessions, lengths)):
        try:
            s._check_room(length)
        except InvalidInput as exc:
            raise InvalidInput(f"session {i}: {exc}") from None


def _check_constraints(sessions, chunks) -> None:
    """Each session's constraint, if it has one, allows its chunk; the first that does not is
    named. (The ids come to the host in one call: a row of a tensor at a time cost some 5 µs a
    session, a third of a millisecond a step of 64 constrained sessions.)"""
    held = [s.constraint for s in sessions]
    if all(c is None for c in held):
        return
    rows = chunks.tolist() if isinstance(chunks, torch.Tensor) else [c.tolist() for c in chunks]
    for i, (constraint, tokens) in enumerate(zip(held, rows)):
        if constraint is not None:
            try:
                check_allowed(constraint, tokens)
            except InvalidInput as exc:
                raise InvalidInput(f"session {i}: {exc}") from None
