"""Device-side checks, read back once per chunk, and per-stage completion records."""
from __future__ import annotations

import enum
import math

import torch


class Status(enum.IntFlag):
    TOKEN_RANGE = 1 << 0      # a token id outside the vocabulary reached the device
    HASH_RANGE = 1 << 1       # an n-gram bucket index outside its table
    INDEX_RANGE = 1 << 2      # attention selected a row the query may not see
    ROUTE_RANGE = 1 << 3      # a route names an expert that does not exist
    INJECTED = 1 << 30        # set by fault injection, through the same `flag` op

    @classmethod
    def describe(cls, word: int) -> str:
        names = [flag.name.lower() for flag in cls if word & flag]
        return ", ".join(names) or f"0x{word:x}"


class DeviceChecks:
    """Values computed on the device while a transaction runs, read back once by `validate`.

    Nothing here synchronises until `read`. A status check records one device reduction: `flag`
    the any() of a boolean tensor, `check_range` the min and max of an index tensor (the bounds
    are compared on the host once the values are back). A finite check records the sum of a
    written tensor: any NaN or Inf makes the sum non-finite. `read` brings everything back in one
    transfer and folds it into a status word per stage and the set of stages with a non-finite
    write.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._status: list[torch.Tensor] = []
        self._tests: list[tuple[int, int, object]] = []      # (slot, bit, bound test)
        self._sums: list[torch.Tensor] = []
        self._sum_slots: list[int] = []

    def flag(self, slot: int, bad: torch.Tensor, bit: Status) -> None:
        self._status.append(bad.any())
        self._tests.append((slot, int(bit), None))

    def check_range(self, slot: int, values: torch.Tensor, upper: int, bit: Status, lower: int | None = 0) -> None:
        """Set `bit` unless every value lies in [lower, upper) (lower=None: no lower bound)."""
        if not values.numel():
            return
        if lower is None:
            self._status.append(values.amax())
        else:
            low, high = torch.aminmax(values)
            self._status.append(low)
            self._tests.append((slot, int(bit), ("below", lower)))
            self._status.append(high)
        self._tests.append((slot, int(bit), ("at_least", upper)))

    def finite(self, slot: int, tensor: torch.Tensor) -> None:
        self._sums.append(tensor.sum())
        self._sum_slots.append(slot)

    def read(self) -> tuple[dict[int, int], set[int]]:
        """One device-to-host transfer -> ({slot: status word}, {slots with a non-finite write})."""
        parts = [torch.stack(group).to(torch.float64) for group in (self._status, self._sums) if group]
        values = torch.cat(parts).tolist() if parts else []
        words: dict[int, int] = {}
        for (slot, bit, test), value in zip(self._tests, values):
            if _fails(test, value):
                words[slot] = words.get(slot, 0) | bit
        sums = values[len(self._status):]
        return words, {slot for slot, v in zip(self._sum_slots, sums) if not math.isfinite(v)}


def _fails(test, value: float) -> bool:
    if test is None:
        return bool(value)
    kind, bound = test
    return value < bound if kind == "below" else value >= bound


class Completion:
    """Per-stage completion records. On CUDA each is an event; on the CPU work is synchronous,
    so a record is complete unless something marked it otherwise."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.records: list[tuple[int, object]] = []
        self.failed: set[int] = set()

    def record(self, slot: int) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self.records.append((slot, event))

    def mark_incomplete(self, slot: int) -> None:
        self.failed.add(slot)

    def first_incomplete(self) -> int | None:
        """Slot of the first record whose work did not complete; call after the device sync."""
        for slot, event in self.records:
            if slot in self.failed:
                return slot
            if event is not None:
                try:
                    if not event.query():
                        return slot
                except RuntimeError:
                    return slot
        return None
