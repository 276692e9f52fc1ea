"""A constraint on the tokens a session takes: one more owner of the session, held on the host
in its published record (`Published.constraint`) and published by the same flip as every other.

The seam knows nothing of what a constraint means (a grammar, a JSON schema: `hebrus.text.grammar`
makes them); it asks only this of one. A value is never changed: a chunk's transaction takes
`after(its tokens)`, a new value, into the record its flip publishes, so an aborted chunk leaves
the public value as it was and nothing is undone.
"""
from __future__ import annotations

import threading
from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class Constraint(Protocol):
    def allows(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, from the first, may come next (all of them: len(tokens))."""

    def after(self, tokens: Sequence[int]) -> "Constraint":
        """The value once `tokens` (which `allows` all of) have come; this one unchanged."""

    def mask(self) -> torch.Tensor:
        """The tokens that may come next, as bits: an int32 tensor on the CPU, token i allowed
        where bit i % 32 of word i // 32 is set (words past the vocabulary ignored)."""

    @property
    def finished(self) -> bool:
        """Whether nothing may come next: the constrained text is complete."""


def masks(values: list[Constraint]) -> list[torch.Tensor]:
    """Each value's `mask()`; values of one type that offers `masks` (a static method over a
    list of them) compute theirs together."""
    kinds = {type(v) for v in values}
    if len(kinds) == 1 and hasattr(next(iter(kinds)), "masks"):
        return next(iter(kinds)).masks(values)
    return [v.mask() for v in values]


def ahead(pairs: list[tuple[Constraint, int]]) -> threading.Thread | None:
    """Start making, on a thread of its own, each value after its token and its mask: what the
    step that feeds those tokens will publish and the next choice will need, computed while the
    step runs (the masks' library works without the interpreter's lock). Join the thread before
    the next choice; a failure there only leaves the work to be done then."""
    if not pairs:
        return None

    def work() -> None:
        try:
            masks([value.after([token]) for value, token in pairs])
        except Exception:                       # noqa: BLE001 - done again, where it is needed
            pass
    thread = threading.Thread(target=work, name="hebrus-masks", daemon=True)
    thread.start()
    return thread


def checked(value) -> Constraint | None:
    """`value` if it is a constraint (or None); else TypeError naming what one needs."""
    if value is None or isinstance(value, Constraint):
        return value
    raise TypeError(f"a constraint needs allows, after, mask and finished; got {type(value).__name__}")
