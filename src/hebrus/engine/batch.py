"""Several sessions stepped together: one token each, one pass through the stages, one
transaction per session (`state.batch`). The stages run once for all of them, so the weights
are read once for B tokens; each session is then validated (all their checks come back in one
transfer) and published on its own, so a NaN or a failed check in one session's rows aborts
that session only. Row storage is grown before the pass, so a session whose memory budget
refuses it is left out alone; so is one whose budget refuses its share of the intermediates at a
stage's seal. Any other exception in the shared pass cannot be pinned on one session and
aborts them all.
"""
from __future__ import annotations

import torch

from hebrus.engine.eager import abort_error
from hebrus.errors import AllocationError, ChunkAborted, CommandError
from hebrus.state.batch import BatchTransaction
from hebrus.state.budget import out_of_memory
from hebrus.state.interrupts import deferred_signals
from hebrus.state.txn import Transaction


def _read_together(parts: list[Transaction]) -> list[list[float]]:
    """Every session's folded checks in one device-to-host transfer, split back per session."""
    folded = [p.checks.fold() for p in parts]
    present = [f for f in folded if f is not None]
    flat = torch.cat(present).tolist() if present else []
    out, at = [], 0
    for f in folded:
        n = 0 if f is None else f.numel()
        out.append(flat[at:at + n])
        at += n
    return out


def run_tokens(model, sessions, ids: torch.Tensor, outs) -> list:
    """ids [B]: token i for session i (the caller holds every session's lock, in inference mode).
    Returns, per session, its logits (`outs[i]` or a new tensor) or the `ChunkAborted` that
    aborted it."""
    parts = [Transaction(s.image, 1, model.stage_names, s.budget, max_rows=model.spec.max_context)
             for s in sessions]
    results: list = [None] * len(parts)
    try:
        live = []
        for i, part in enumerate(parts):        # row storage grows now: a refusal drops that session alone
            try:
                for spec in part.image.appended:
                    part.rows(spec.name)
                live.append(i)
            except ChunkAborted as exc:
                results[i] = exc
        if not live:
            return results
        batch = BatchTransaction([parts[i] for i in live], model.device)
        try:
            batch.local["ids"] = ids[live].to(model.device)
            for slot, stage in enumerate(model.stages):
                batch.enter(slot)
                stage.run(batch)
                batch.seal()
        except ChunkAborted as exc:
            return [exc if r is None else r for r in results]
        except Exception as exc:
            error = abort_error(batch.stage, exc)
            return [error if r is None else r for r in results]
        try:
            values = _read_together(batch.parts)
        except Exception as exc:                # the one transfer failed: no session can be validated
            error = (AllocationError if out_of_memory(exc) else CommandError)(
                "validate", f"device work failed: {type(exc).__name__}: {exc}")
            return [error if r is None else r for r in results]
        try:
            with deferred_signals():            # a signal lands after every session has published
                for j, i in enumerate(live):
                    results[i] = batch.failed.get(j) or _publish(parts[i], sessions[i], values[j], outs[i])
        except BaseException as exc:
            _attach(exc, results)
            raise
        return results
    finally:
        for part in parts:
            part.abort()


def _publish(part: Transaction, session, values: list[float], out):
    try:
        try:
            part.validate(values)
        except ChunkAborted:
            raise
        except Exception as exc:
            raise abort_error(part.stage, exc) from exc
        part.publish(out)
    except ChunkAborted as exc:
        return exc
    return out if out is not None else session.image.read("logits").clone()


def _attach(exc: BaseException, results: list) -> None:
    try:
        exc.results = results
    except AttributeError:                      # an exception type that takes no attributes
        pass
