"""What a stage sees of the step it runs in: the seam between the layers and the transaction.

A stage reads public state and writes private state only through these calls, so the same stage
code runs in every kind of step: one session's chunk (`state.txn.Transaction`), one token of each
of several sessions (`state.batch.BatchTransaction`), and the benchmark's in-place variants that
exist to price the transaction (`hebrus.bench`).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class StepContext(Protocol):
    row_per_session: bool   # True: row i of every chunk-local tensor is session i's one token
    start: object           # the first position: an int, a [1] device tensor (a planned step), or one per session
    local: dict[str, torch.Tensor]      # chunk-local values by name (the layers': "ids", "streams", ...)
    # True: a prefix transaction (`state.txn.Transaction(each=True)`), whose stages write banked
    # owners with `write_each(name, values after every token [T, ...])`; only it has that call
    each: bool

    def read(self, name: str) -> torch.Tensor:
        """The public value of a banked owner (with `row_per_session`, the sessions' stacked). Never write it."""

    def write(self, name: str, value: torch.Tensor) -> None:
        """The new value of a banked owner, into the private bank."""

    def rows(self, name: str):
        """The storage of an appended owner holding this step's rows (with `row_per_session`, one per session)."""

    def emit(self, key: str, value: torch.Tensor) -> None:
        """A chunk-local result for later stages."""

    def flag(self, bad: torch.Tensor, bit: int) -> None:
        """A device-side check: set `bit` if any of `bad` is true."""

    def check_range(self, values: torch.Tensor, upper: int, bit: int, lower: int | None = 0) -> None:
        """A device-side check: set `bit` unless every value lies in [lower, upper)."""

    def last_rows(self, X: torch.Tensor) -> torch.Tensor:
        """The rows of the positions whose values are published: the chunk's last (with `row_per_session`,
        every row)."""

    def hold(self, resource) -> None:
        """Keep `resource` (a page claim) until the step ends: `resource.commit()` when it
        publishes, `resource.release()` when it does not."""
