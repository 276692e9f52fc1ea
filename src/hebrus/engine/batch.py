"""Several sessions stepped together: one token each, one pass through the stages, one
transaction per session (`state.batch`). The stages run once for all of them, so the weights
are read once for B tokens; each session is then validated (all their checks come back in one
transfer) and published on its own, so a NaN or a failed check in one session's rows aborts
that session only. An exception in the shared pass (a memory-budget refusal among them)
cannot be pinned on one session and aborts them all.
"""
from __future__ import annotations

import torch

from hebrus.engine.eager import abort_error
from hebrus.errors import AllocationError, ChunkAborted, CommandError
from hebrus.state.budget import out_of_memory
from hebrus.state.batch import BatchTransaction
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
    batch = BatchTransaction(parts, model.device)
    results: list = [None] * len(parts)
    try:
        try:
            batch.local["ids"] = ids.to(model.device)
            for slot, stage in enumerate(model.stages):
                batch.enter(slot)
                stage.run(batch)
                batch.seal()
        except ChunkAborted as exc:
            return [exc] * len(parts)
        except Exception as exc:
            return [abort_error(batch.stage, exc)] * len(parts)
        try:
            values = _read_together(parts)
        except Exception as exc:                # the one transfer failed: no session can be validated
            error = (AllocationError if out_of_memory(exc) else CommandError)(
                "validate", f"device work failed: {type(exc).__name__}: {exc}")
            return [error] * len(parts)
        for i, (part, session) in enumerate(zip(parts, sessions)):
            try:
                try:
                    part.validate(values[i])
                except ChunkAborted:
                    raise
                except Exception as exc:
                    raise abort_error(part.stage, exc) from exc
                part.publish(outs[i])
            except ChunkAborted as exc:
                results[i] = exc
                continue
            results[i] = outs[i] if outs[i] is not None else session.image.read("logits").clone()
        return results
    finally:
        for part in parts:
            part.abort()
