"""The eager runner: every stage of a chunk in order, then one validation and the flip.

    begin -> for each stage: run, injection point, seal -> validate -> before the flip -> publish

Any exception before the flip becomes the `ChunkAborted` of its kind and publishes nothing.
"""
from __future__ import annotations

from typing import Callable

import torch

from hebrus import faults
from hebrus.errors import ChunkAborted, InvalidInput
from hebrus.layers.checks import Check
from hebrus.layers.owners import FRONTIER, OUTPUT
from hebrus.state.budget import MemoryBudget
from hebrus.state.image import Image
from hebrus.state.interrupts import deferred_signals
from hebrus.state.step import StepBatch
from hebrus.engine.paced import between_stages
from hebrus.engine.ranks import PeerStopped
from hebrus.state.txn import Transaction, abort_error
from hebrus.uploads import upload

__all__ = ["FRONTIER", "OUTPUT", "agreement", "agreement_each", "begun", "by_logits", "finish", "run_chunk", "run_marked", "run_stages", "transaction"]   # the owner names re-exported for session


def transaction(model, images: list[Image], budgets: list[MemoryBudget], lengths: list[int],
                **options) -> Transaction:
    """A transaction of `lengths[i]` tokens over each `images[i]`, told what `model` calls what
    the seam handles: its stages, its frontier and output owners, the bits its checks set
    (`Check`)."""
    return Transaction(images, lengths, model.stage_names, budgets, max_rows=model.spec.max_context,
                       frontier_owner=FRONTIER, output=OUTPUT, check_bits=Check, **options)


def run_chunk(model, image: Image, budget: MemoryBudget, ids: torch.Tensor, out: torch.Tensor | None,
              reserve: int = 0, keep: Callable[[torch.Tensor], int] | None = None) -> int:
    """One chunk as one transaction (the caller holds the session lock, in inference mode).
    Row storage that must grow grows to `reserve` rows if that is granted. With `keep`, a prefix
    transaction: once the chunk has passed every check, `keep(logits at every position [T, V])`
    says how many of its tokens to publish (0: none; what it raises is raised as it is).
    Returns the number of tokens published."""
    txn = begun(model, lambda: transaction(model, [image], [budget], [len(ids)], reserve=reserve,
                                            each=keep is not None, tokens=[ids]))
    return finish(txn, _stages_of(model, ids), out, by_logits(keep), ranks=agreement(model))


def run_marked(model, image: Image, budget: MemoryBudget, ids: torch.Tensor, out: torch.Tensor | None,
               marks: tuple[int, ...], reserve: int = 0) -> dict[str, torch.Tensor]:
    """`run_chunk` of the whole chunk that also keeps, for each count of tokens in `marks`
    (increasing, the last the chunk's length), every banked value the chunk writes as it stood
    after that many tokens -> those values by owner, [len(marks), ...] each, checked with the
    chunk's writes (what a prefix cache keeps; the chunk's stateful stages run in pieces that
    end at the marks; a stage that writes a banked value without them refuses the chunk)."""
    txn = begun(model, lambda: transaction(model, [image], [budget], [len(ids)], reserve=reserve, tokens=[ids]))
    finish(txn, _stages_of(model, ids, marks), out, ranks=agreement(model))
    return txn.after_each


def begun(model, begin: Callable[[], Transaction]) -> Transaction:
    """`begin()`'s transaction. A rank of a tensor-parallel model steps only inside a call every
    rank runs, and a transaction one rank cannot begin (its pool full) stops the others at
    their first exchange."""
    ranks = model.ranks
    if ranks is None:
        return begin()
    if not ranks.open:
        raise InvalidInput("this is one rank's part of a tensor-parallel model: it steps only with the other "
                           "ranks, through the ParallelModel's sessions")
    try:
        return begin()
    except Exception as exc:
        ranks.stop(exc if isinstance(exc, ChunkAborted) else abort_error("begin", exc), _order(model))
        raise


def _stages_of(model, ids: torch.Tensor, marks: tuple[int, ...] | None = None):
    def work(txn: Transaction) -> None:
        on_device = upload(ids, torch.int64, model.device)
        run_stages(model, txn, StepBatch.chunk(on_device, txn.frontier, each=txn.each, marks=marks))
        txn.extend_reserved()
        if marks is not None:
            txn.check_each("marks")
    return work


def by_logits(keep: Callable[[torch.Tensor], int] | None) -> Callable[[Transaction], int] | None:
    """A prefix transaction's choice made from a copy of its logits at every position (a
    replayed graph writes the next replay's into the same memory)."""
    return None if keep is None else lambda txn: keep(txn.after_each[txn.output].clone())


def run_stages(model, txn, step: StepBatch, paced: bool = True) -> None:
    """Every stage over `step`, in order, each sealed by `txn`: what a stage puts in the step's
    fields (the streams, a pending output, the branches' values) is checked with its writes and
    counted as the step's working set; in a paced pass (`engine.paced`) it may wait after a
    stage for its next turn, unless not `paced` (a planned step holds its runner's lock). Under tensor parallelism a stage that raises tells the
    other ranks at their next exchange (`engine.ranks`)."""
    txn.step = step
    for index, stage in enumerate(model.stages):
        txn.enter(index)
        try:
            before = _carried(step)
            stage.run(txn, step)
            live = _carried(step)
            txn.carry([v for v in live if not any(v is b for b in before)], live)
            faults.after(stage.name, txn)
            txn.seal()
        except PeerStopped:
            raise
        except Exception as exc:
            if model.ranks is not None:
                model.ranks.stop(exc if isinstance(exc, ChunkAborted) else abort_error(txn.stage, exc),
                                 _order(model))
            raise
        if paced:
            between_stages()            # a paced pass waits here for its next turn (`engine.paced`)


def _carried(step: StepBatch) -> list[torch.Tensor]:
    return [v for v in (step.streams, step.pending, *step.terms.values()) if v is not None]


def agreement(model) -> Callable[[ChunkAborted | None], ChunkAborted | None] | None:
    """How a tensor-parallel model's ranks agree on a chunk (`engine.ranks.Ranks.agree`), or
    None for a model on one rank."""
    if model.ranks is None:
        return None
    return lambda failure: model.ranks.agree(failure, _order(model))


def agreement_each(model) -> Callable[[list, bool], tuple[list, bool]] | None:
    """How a tensor-parallel model's ranks agree on a pass of several sessions
    (`engine.ranks.Ranks.agree_each`), or None for a model on one rank."""
    if model.ranks is None:
        return None
    return lambda failures, whole: model.ranks.agree_each(failures, whole, _order(model))


def _order(model) -> Callable[[str], int]:
    """Where a failure's stage lies among the stages (after them: validation, the journal)."""
    names = model.stage_names
    return lambda stage: names.index(stage) if stage in names else len(names)


def finish(txn: Transaction, work: Callable[[Transaction], None], out: torch.Tensor | None,
           keep: Callable[[Transaction], int] | None = None,
           ranks: Callable[[ChunkAborted | None], ChunkAborted | None] | None = None) -> int:
    """Do `work`, validate, (a prefix transaction) keep the first `keep(txn)` tokens, run the
    image's `before_flip` hook and publish, with signals held from the hook to the flip (so a
    journal's record is never on the disk for a chunk a signal kept from publishing); any
    exception on the way but `keep`'s own is the abort of its kind. With `ranks` (a
    tensor-parallel model's `agreement`), every rank's outcome decides after validation: all
    publish, or every rank raises the same failure. Returns the number of tokens published."""
    try:
        failure = None
        try:
            _as_abort(txn, lambda: (work(txn), txn.validate()))
        except ChunkAborted as exc:
            if ranks is None:
                raise
            failure = exc
        agreed = None if ranks is None else ranks(failure)
        if agreed is not None:
            raise agreed from failure
        if keep is not None and not txn.keep(keep(txn)):      # the caller's choice: its errors are its own
            return 0
        if txn.image.before_flip is None:
            txn.publish(out)            # what is raised after the flip is not an abort
            return txn.length
        with deferred_signals():        # a signal during the hook's write (a journal's) lands after the flip
            _as_abort(txn, lambda: txn.image.before_flip(txn))
            txn.publish(out)
        return txn.length
    finally:
        txn.abort()


def _as_abort(txn: Transaction, do: Callable[[], object]) -> None:
    try:
        do()
    except ChunkAborted:
        raise
    except Exception as exc:
        raise abort_error(txn.stage, exc) from exc
