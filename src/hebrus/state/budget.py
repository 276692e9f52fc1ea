"""The session's memory budget: every allocation a transaction makes asks it first.

Bytes are `held` (the public image's storage), `pending` (storage a running transaction grew,
private until publication) and `working` (the chunk's live intermediates). A refusal raises
`Refused`; nothing is charged for a refused request.
"""
from __future__ import annotations

import torch

_ALLOCATOR_FAILURES = ("DefaultCPUAllocator: can't allocate memory", "DefaultCPUAllocator: not enough memory",
                       "CUBLAS_STATUS_ALLOC_FAILED")


class Refused(Exception):
    pass


def out_of_memory(exc: BaseException) -> bool:
    """Did an allocation fail? Python's MemoryError, CUDA's OutOfMemoryError, and the plain
    RuntimeErrors that torch's CPU allocator and cuBLAS (its workspace) raise."""
    if isinstance(exc, (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in _ALLOCATOR_FAILURES)


class MemoryBudget:
    def __init__(self, limit: int | None = None):
        self.limit = limit
        self.held = 0
        self.pending = 0
        self.working = 0
        self._refuse_next = False

    def begin(self) -> None:
        """A transaction starts: nothing is pending or working, whatever an interrupted
        predecessor left behind."""
        self.pending = 0
        self.working = 0

    def refuse_next(self) -> None:
        """Arm a refusal of the next request (fault injection)."""
        self._refuse_next = True

    def _admit(self, nbytes: int, what: str) -> None:
        if self._refuse_next:
            self._refuse_next = False
            raise Refused(f"allocator refused {nbytes} bytes for {what}")
        total = self.held + self.pending + self.working + nbytes
        if self.limit is not None and total > self.limit:
            raise Refused(f"{what} needs {nbytes} bytes; the session budget is {self.limit} bytes "
                          f"and {total - nbytes} are in use")

    def hold(self, nbytes: int, what: str) -> None:
        """Storage for the session itself (banks at creation)."""
        self._admit(nbytes, what)
        self.held += nbytes

    def grow(self, nbytes: int, what: str) -> None:
        """Storage a transaction allocates privately; it becomes held if the transaction publishes."""
        self._admit(nbytes, what)
        self.pending += nbytes

    def cancel(self, nbytes: int) -> None:
        """Take back a granted growth whose allocation then failed."""
        self.pending -= nbytes

    def admit(self, nbytes: int, what: str) -> None:
        """Check that a stage's intermediates fit alongside everything else live."""
        self._admit(nbytes, what)

    def set_working(self, nbytes: int) -> None:
        self.working = nbytes

    def commit(self, released: int) -> None:
        """Publication: pending storage is held now, replaced storage is gone."""
        self.held += self.pending - released
        self.pending = 0
        self.working = 0

    def abort(self) -> None:
        self.pending = 0
        self.working = 0
        self._refuse_next = False
