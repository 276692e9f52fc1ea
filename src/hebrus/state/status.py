"""Device-side checks, read back once per chunk.

`StatusWord` keeps one int32 word per stage on the device; ops OR bits into their stage's word
without synchronising. `Completion` records each stage's submitted work so validation can tell
whether it all finished.
"""
from __future__ import annotations

import enum

import torch


class Status(enum.IntFlag):
    TOKEN_RANGE = 1 << 0      # a token id outside the vocabulary reached the device
    HASH_RANGE = 1 << 1       # an n-gram bucket index outside its table
    INDEX_RANGE = 1 << 2      # attention selected a row the query may not see
    ROUTE_RANGE = 1 << 3      # a route names an expert that does not exist
    INJECTED = 1 << 30        # set by fault injection, through the same `check` op

    @classmethod
    def describe(cls, word: int) -> str:
        names = [flag.name.lower() for flag in cls if word & flag]
        return ", ".join(names) or f"0x{word:x}"


class StatusWord:
    def __init__(self, slots: int, device: torch.device):
        self.words = torch.zeros(slots, dtype=torch.int32, device=device)

    def reset(self) -> None:
        self.words.zero_()

    def check(self, slot: int, bad: torch.Tensor, bit: Status) -> None:
        """OR `bit` into the slot's word when any element of `bad` is true (no host sync)."""
        word = self.words[slot:slot + 1]
        word.bitwise_or_(bad.any().to(torch.int32) * int(bit))


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
