"""What a stage sees of the step it runs in: the seam between the layers and the transaction.

A stage reads public state and writes private state only through these calls, so the same stage
code runs in every kind of step: one session's chunk or several sessions' chunks together (one
`state.txn.Transaction` either way), training's sequence, and the benchmark's in-place variants
that exist to price the transaction (`hebrus.bench`). What the step is (its
tokens, positions, sessions) and what stages hand each other is the `state.step.StepBatch`
passed beside it.
"""
from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch


class InPlace(NamedTuple):
    """A banked owner as a kernel reads and writes it where it lies: lane i reads
    bank[source[i], slots[i]] and writes bank[target[i], slots[i]] (a transaction's source is
    the public bank, its target the private one). Each lane's two differ, or `source is target`
    (one tensor: every lane reads and writes one bank, as the in-place measurement does): a
    kernel may read one lane's values in one program while another writes them."""
    bank: torch.Tensor          # [2, slots, ...]
    source: torch.Tensor        # [N] parities
    target: torch.Tensor        # [N]
    slots: torch.Tensor         # [N]


@runtime_checkable
class StepContext(Protocol):
    # a step that keeps values (`StepBatch.keeps`) also has `write_each(name, values after every token or mark)`;
    # a transaction may offer `in_place(name)` and `wrote(name, check)`: a banked owner a kernel
    # reads and writes where it lies (`state.txn.Transaction.in_place`)

    def read(self, name: str) -> torch.Tensor:
        """The public value of a banked owner (several sessions': [N, ...]). Never write it."""

    def write(self, name: str, value: torch.Tensor) -> None:
        """The new value of a banked owner, into the private bank."""

    def rows(self, name: str):
        """An appended owner's rows, one `state.pool.Log` per session of the step, each through
        its session's block table, holding this step's rows."""

    def flag(self, bad: torch.Tensor, bit: int) -> None:
        """A device-side check: set `bit` if any of `bad` is true (per session: `bad` [T, ...] by
        token or [N, ...] by session; a scalar concerns every session)."""

    def check_range(self, values: torch.Tensor, upper: int, bit: int, lower: int | None = 0) -> None:
        """A device-side check: set `bit` unless every value lies in [lower, upper) (per session,
        as `flag` attributes them)."""

    def hold(self, resource) -> None:
        """Keep `resource` (a page claim) until the step ends: `resource.commit()` when it
        publishes, `resource.release()` when it does not."""
