"""The eager runner: every stage of a chunk in order, then one validation and the flip.

    begin -> for each stage: run, injection point, seal -> validate -> before the flip -> publish

Any exception before the flip becomes the `ChunkAborted` of its kind and publishes nothing.
"""
from __future__ import annotations

from typing import Callable

import torch

from hebrus import faults
from hebrus.errors import ChunkAborted
from hebrus.state.budget import MemoryBudget
from hebrus.state.image import Image
from hebrus.state.txn import Transaction, abort_error


def run_chunk(model, image: Image, budget: MemoryBudget, ids: torch.Tensor, out: torch.Tensor | None,
              reserve: int = 0) -> None:
    """One chunk as one transaction (the caller holds the session lock, in inference mode).
    Row storage that must grow grows to `reserve` rows if that is granted."""
    txn = Transaction(image, len(ids), model.stage_names, budget, max_rows=model.spec.max_context,
                      reserve=reserve, reserve_only_growing=True)

    def work(txn: Transaction) -> None:
        txn.local["ids"] = ids.to(model.device)
        run_stages(model, txn)
        txn.extend_reserved()

    finish(txn, work, out)


def run_stages(model, txn: Transaction) -> None:
    for slot, stage in enumerate(model.stages):
        txn.enter(slot)
        stage.run(txn)
        faults.after(stage.name, txn)
        txn.seal()


def finish(txn: Transaction, work: Callable[[Transaction], None], out: torch.Tensor | None) -> None:
    """Do `work`, validate, publish; any exception on the way is the abort of its kind."""
    try:
        try:
            work(txn)
            txn.validate()
            if txn.image.before_flip is not None:
                txn.image.before_flip(txn)
        except ChunkAborted:
            raise
        except Exception as exc:
            raise abort_error(txn.stage, exc) from exc
        txn.publish(out)                # what is raised after the flip is not an abort
    finally:
        txn.abort()
