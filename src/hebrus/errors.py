"""Errors a caller can see.

Bad input raises `InvalidInput` before a transaction begins. Everything that goes wrong inside a
transaction raises a `ChunkAborted` subclass, one per failure kind; in every case the session's
public state is exactly what it was before the call.
"""
from __future__ import annotations

FAULT_KINDS = ("structural", "nonfinite", "alloc", "command", "status")


class InvalidInput(ValueError):
    """The request itself is wrong (ids out of range, empty chunk, past the context limit, ...)."""


class CheckpointError(InvalidInput):
    """A checkpoint on disk is malformed or asks for something not allowed; the message names
    the file and the problem. Nothing was allocated for the model."""


class ChunkAborted(RuntimeError):
    """A transaction failed and published nothing.

    `stage` names where it was detected, `kind` is one of `FAULT_KINDS`, and `published` is the
    number of tokens that earlier transactions of the same call (a `prefill`) did publish.
    """

    kind = ""

    def __init__(self, stage: str, detail: str, published: int = 0):
        self.stage = stage
        self.detail = detail
        self.published = published
        super().__init__(self._message())

    def _message(self) -> str:
        text = f"{self.kind} failure at stage {self.stage!r}: {self.detail}; nothing was published"
        if self.published:
            text += f" by this chunk ({self.published} tokens of earlier chunks were)"
        return text

    def __reduce__(self):                   # pickled whole (an engine in another process sends it)
        return type(self), (self.stage, self.detail, self.published)

    def with_published(self, published: int) -> "ChunkAborted":
        self.published = published
        self.args = (self._message(),)
        return self


def note_published(exc: BaseException, count: int) -> None:
    """Tell the caller of a multi-transaction call how many of its tokens were committed
    before `exc` (a signal's exception can arrive after a chunk published)."""
    if isinstance(exc, ChunkAborted):
        exc.with_published(count)
        return
    try:
        exc.published = count
    except AttributeError:                      # an exception type that takes no attributes
        pass


class StructuralError(ChunkAborted):
    kind = "structural"


class NonFiniteError(ChunkAborted):
    kind = "nonfinite"


class AllocationError(ChunkAborted):
    kind = "alloc"


class PoolExhausted(AllocationError):
    """The state pool had no free block for the chunk's rows (not a memory budget's refusal):
    the chunk can run once blocks are given back elsewhere."""


class CommandError(ChunkAborted):
    kind = "command"


class DeviceStatusError(ChunkAborted):
    kind = "status"


ERROR_CLASSES: dict[str, type[ChunkAborted]] = {
    cls.kind: cls
    for cls in (StructuralError, NonFiniteError, AllocationError, CommandError, DeviceStatusError)
}


class PageReadError(OSError):
    """Rows of a paged table could not be read from their file (an I/O error, a truncated
    file). Inside a chunk it aborts the chunk as a `CommandError`."""
