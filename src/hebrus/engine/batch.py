"""Several sessions stepped together: each its own chunk (one token, or a prompt's tokens), one
pass through the stages, one transaction per session (`state.txn`, a step of N sessions). The
stages run once for all of them, so the weights are read once for the step's tokens; each
session is then validated (all their checks come back in one transfer) and published on its
own, so a NaN or a failed check in one session's rows aborts that session only; so does a
refusal of its row storage's growth or of its share of the intermediates (its memory budget
sees what it would see alone). Any other exception in the shared pass cannot be pinned on one
session and aborts them all.
"""
from __future__ import annotations

import torch

from hebrus.engine.eager import OUTPUT, agreement_each, begun, run_chunk, run_marked, run_stages, transaction
from hebrus.errors import ChunkAborted, InvalidInput
from hebrus.state.step import StepBatch
from hebrus.state.interrupts import deferred_signals
from hebrus.state.txn import Transaction
from hebrus.uploads import upload


def run_step(model, sessions, chunks: list[torch.Tensor], outs) -> list:
    """chunks[i]: session i's token ids (the caller holds every session's lock, in inference
    mode). Returns, per session, its last logits (`outs[i]` or a new tensor) or the
    `ChunkAborted` that aborted it."""
    begun = _step(model, sessions, chunks)
    if begun is None:               # not begun on this rank: each alone, as on every rank
        return [run_alone(model, s, c, o) for s, c, o in zip(sessions, chunks, outs)]
    return conclude(model, *begun, sessions, chunks, outs)


def run_marked_step(model, sessions, chunks: list[torch.Tensor], marks: list[tuple[int, ...]]) -> list:
    """`run_step` that also keeps, for each of session i's `marks[i]` (counts of its tokens,
    increasing, the last its chunk's length), every banked value its chunk writes as it stood
    after that many tokens (`eager.run_marked`, each session's stateful stages in pieces that
    end at its marks) -> per session (its last logits, those values by owner [len(marks[i]),
    ...]) or the `ChunkAborted` that aborted it."""
    begun = _step(model, sessions, chunks, marks)
    if begun is None:               # not begun on this rank: each alone, as on every rank
        return [run_marked_alone(model, s, c, m) for s, c, m in zip(sessions, chunks, marks)]
    txn, work = begun
    results = _shared_pass(model, txn, work, [None] * len(sessions))
    out = []
    for i, (result, session, chunk) in enumerate(zip(results, sessions, chunks)):
        if result is None:              # the pass failed, not this session: its chunk alone
            out.append(run_marked_alone(model, session, chunk, marks[i]))
        elif isinstance(result, ChunkAborted):
            out.append(result)
        else:
            a, b = txn.step.kept_spans[i]
            out.append((result, {name: values[a:b] for name, values in txn.after_each.items()}))
    return out


def run_marked_alone(model, session, chunk: torch.Tensor, marks: tuple[int, ...]):
    """`run_alone` keeping values after `marks` (`eager.run_marked`) -> (its last logits, the
    values by owner) or the `ChunkAborted` that aborted it."""
    try:
        kept = run_marked(model, session.image, session.budget, chunk, None, marks, session.reserve)
    except ChunkAborted as exc:
        return exc
    return session.image.read(OUTPUT).clone(), kept


def _step(model, sessions, chunks: list[torch.Tensor], marks=None):
    """The transaction of a step of `chunks` over `sessions`, and the work of its one pass. Over
    tensor-parallel ranks, None where this rank could not begin it: the others, told at their
    first exchange, find the pass failed, and every rank agrees so (`_shared_pass`)."""
    lengths = [len(c) for c in chunks]
    try:
        txn = begun(model, lambda: transaction(model, [s.image for s in sessions], [s.budget for s in sessions],
                                               lengths, reserve=[s.reserve for s in sessions], tokens=chunks))
    except InvalidInput:
        raise
    except Exception:
        agreed = agreement_each(model)
        if agreed is None:
            raise
        agreed([None] * len(sessions), True)
        return None
    ids = upload(torch.cat(list(chunks)), torch.int64, model.device)

    def work() -> None:             # no fault is armed here: its injection points do nothing
        run_stages(model, txn, StepBatch.ragged(ids, [p.frontier for p in txn.parts], lengths, marks))
        txn.extend_reserved()
        if marks is not None:
            txn.check_each("marks")

    return txn, work


def conclude(model, txn: Transaction, work, sessions, chunks, outs) -> list:
    """Run `work` (the shared pass), read every session's checks back in one transfer, then
    publish each session that passed them on its own -> each session's outcome. A failure of
    the pass itself (an exception no session's own, device work that did not complete) leaves
    every session unchanged; then each session that did not fail on its own runs its chunk
    alone, so only a session that fails again is reported."""
    results = _shared_pass(model, txn, work, outs)
    return [r if r is not None else run_alone(model, s, c, o) for r, s, c, o in zip(results, sessions, chunks, outs)]


def _shared_pass(model, txn: Transaction, work, outs) -> list:
    """The pass, validation and publication of `conclude` -> each session's outcome, None for
    a session that did not fail on its own when the pass itself failed. Every session is
    finished (published or aborted) on the way out. Over tensor-parallel ranks every rank's
    outcomes decide each session's, alike on every rank (`Ranks.agree_each`)."""
    try:
        try:
            work()
            # the logits of sessions with no `out` copied now, while the device may still run the
            # step (the private rows the flip publishes; a failed session's row is let go)
            rows = _private_logits(txn) if any(out is None for out in outs) else None
        except Exception:
            results, failed = [p.failure for p in txn.parts], True
        else:
            results = txn.failures()
            failed = txn.pass_failed
            if failed:
                results = [p.failure for p in txn.parts]
        agreed = agreement_each(model)
        if agreed is not None:
            results, failed = agreed(results, failed)
        if failed:
            return results
        try:
            with deferred_signals():        # a signal lands after every session has published
                for j, failure in enumerate(results):
                    results[j] = failure or _publish(txn, j, outs[j])
                    if results[j] is None:  # published, no `out`: its row of the new tensor
                        results[j] = rows[j]
        except BaseException as exc:
            _attach(exc, results)
            raise
        return results
    finally:
        txn.abort()


def run_alone(model, session, chunk: torch.Tensor, out):
    """One session's chunk as a transaction of its own (the caller holds its lock, in inference
    mode) -> its last logits (`out` or a new tensor) or the `ChunkAborted` that aborted it."""
    try:
        run_chunk(model, session.image, session.budget, chunk, out, session.reserve)
    except ChunkAborted as exc:
        return exc
    return out if out is not None else session.image.read(OUTPUT).clone()


def _publish(txn: Transaction, j: int, out):
    """Publish session j -> its `ChunkAborted`, or `out` (None: its logits are read afterwards)."""
    try:
        txn.publish(out, j)
    except ChunkAborted as exc:
        return exc
    return out


def _private_logits(txn: Transaction) -> list[torch.Tensor]:
    """Every session's logits in its private bank, which its flip publishes, gathered from the
    pool in one copy (through index tensors on the device: no host sync): a row each of one new
    tensor."""
    public, slots = txn.banks()
    return list(txn.pool.banks[txn.output][1 - public, slots].unbind(0))


def _attach(exc: BaseException, results: list) -> None:
    try:
        exc.results = results
    except AttributeError:                      # an exception type that takes no attributes
        pass
