"""A tensor-parallel model's ranks, as one of them sees them: the collectives its stages add
their parts up with, and the distributed commit.

Every rank runs the same chunk over its shards (`layers.shard`), in its own transaction. The
stages meet at collectives (`reduce`: a split sublayer's partial outputs added up; `gather`: the
logits' vocabulary parts joined), and before each of them the ranks exchange a record of fixed
size (`RECORD` bytes): empty to go on, or a failure (its kind, stage and detail). A rank whose
stage raises sends its failure at its next exchange and stops; the others are at that same
exchange (everything before it was the same on every rank), read it, and stop too, so no rank
is left waiting in a collective the others never reach. After validation a last exchange
carries each rank's outcome, unless the ranks stopped already (`agree`). Every rank then holds
the same records and picks the same failure, the earliest failing stage's, the lowest rank's
among equals: each raises that same `ChunkAborted`, or all publish.

A rank that stops answering (its process killed, a hung device) makes a collective fail or run
past the group's timeout: the survivor's chunk aborts as `RankLost` (the `command` kind) with
nothing published, and the group is broken for good: every later chunk is refused at once.
"""
from __future__ import annotations

from typing import Callable

import torch

from hebrus.errors import (AllocationError, ChunkAborted, CommandError, DeviceStatusError, NonFiniteError,
                           PoolExhausted, StructuralError)

BY_KIND = {cls.kind: cls for cls in (StructuralError, NonFiniteError, AllocationError, CommandError,
                                     DeviceStatusError)}


class PeerStopped(StructuralError):
    """Another rank's stage raised: this rank stopped at the same exchange (never reported: the
    failing rank's own failure is, `Ranks.agree`)."""


class RankLost(CommandError):
    """A collective failed or timed out: a rank stopped answering. Nothing was published; the
    model's ranks cannot step together again (load it again; sessions come back from their
    snapshots)."""


BY_NAME = {cls.__name__: cls for cls in (*BY_KIND.values(), PoolExhausted)}   # what a failure is raised as
NAMES = tuple(BY_NAME)
RECORD = 512             # bytes of an exchanged record: a failure's class, stage order and detail


class Ranks:
    """Rank `rank` of `world` over `group` (a `torch.distributed` process group; None: the
    default one)."""

    def __init__(self, rank: int, world: int, group, device: torch.device):
        self.rank, self.world, self.group, self.device = rank, world, group, device
        self.lost: str | None = None            # why the group is broken, once it is
        self.open = False                       # inside a call every rank runs (`hebrus.parallel`)
        self._records: list | None = None       # the records of the exchange that stopped this chunk

    # ---- the stages' collectives ----------------------------------------------------------
    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of every rank's `x` (a new tensor). On the CPU every part is
        gathered and added up in rank order on each rank (gloo's all-reduce of a small tensor
        takes about five times its all-gather on a 2-core machine); NCCL adds them up itself."""
        from torch import distributed
        self.go()
        if self.device.type == "cpu":
            parts = self._parts(x, "adding up a layer's parts")
            total = parts[0]
            for part in parts[1:]:
                total = total + part
            return total
        y = x.contiguous().clone()
        self._collective(lambda: distributed.all_reduce(y, group=self.group), "adding up a layer's parts")
        return y

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [..., n], rank after rank along the last dimension [..., world·n]."""
        self.go()
        return torch.cat(self._parts(x, "joining the logits"), dim=-1)

    # ---- the exchanges ------------------------------------------------------------------------
    def go(self) -> None:
        """The exchange before a collective: PeerStopped when a rank sent a failure."""
        if self.world > 1 and self._exchange(None):
            raise PeerStopped("ranks", "another rank's stage failed")

    def stop(self, failure: ChunkAborted, order: Callable[[str], int]) -> None:
        """This rank's stage raised `failure`: tell the others at the exchange they are at."""
        if self.world > 1 and self.lost is None and self._records is None:
            try:
                self._exchange((order(failure.stage), failure))
            except RankLost:
                pass

    def agree(self, failure: ChunkAborted | None, order: Callable[[str], int]) -> ChunkAborted | None:
        """The chunk's outcome on every rank: this rank's `failure` (or None) and every other's,
        the earliest failing stage's (`order` ranks a stage name), the lowest rank's among
        equals, as a new `ChunkAborted` equal on every rank; None when no rank failed, and every
        rank publishes."""
        records, self._records = self._records, None
        if isinstance(failure, RankLost):
            return failure
        if self.world == 1:
            return failure
        if records is None:                     # no rank stopped: the last exchange, each rank's outcome
            mine = None if failure is None else (order(failure.stage), failure)
            try:
                if not self._exchange(mine):
                    return None
            except RankLost as lost:
                return lost
            records, self._records = self._records, None
        agreed = self._earliest(records)
        if agreed is None and failure is not None:
            return StructuralError("ranks", "a rank stopped without a failure of its own")
        return agreed

    def agree_each(self, failures: list, whole: bool, order: Callable[[str], int]) -> tuple[list, bool]:
        """A pass of several sessions, each its own transaction (`engine.batch`): every rank's
        outcome of each session (its `ChunkAborted`, or None) and whether the pass itself failed
        -> each session's outcome on every rank alike (the earliest failing stage's, the lowest
        rank's among equals, as `agree` picks), and whether the pass failed on any rank."""
        if self.world == 1:
            return failures, whole
        from torch import distributed
        if self._records is None:               # a rank whose stage failed after the last exchange sent one
            self._exchange(None)                # (`stop`): every rank that sent none meets it here
        self._records = None                    # the exchange's records are read: this one decides
        mine = (whole, [None if f is None else (order(f.stage), _named(f), f.stage, f.detail) for f in failures])
        theirs: list = [None] * self.world
        self._collective(lambda: distributed.all_gather_object(theirs, mine, group=self.group),
                         "agreeing on the sessions' outcomes")
        agreed = [self._earliest([records[j] for _, records in theirs]) for j in range(len(failures))]
        return agreed, any(w for w, _ in theirs)

    def kept_everywhere(self, kept: list) -> list:
        """Sessions each rank made alike (the prefixes `Session.feed_keeping` keeps): one is kept
        only where every rank made its part (a pool with no slot, or a device with no memory,
        may refuse it on one rank), else let go on every rank (None)."""
        if self.world == 1:
            return kept
        from torch import distributed
        made: list = [None] * self.world
        mine = [s is not None for s in kept]
        self._collective(lambda: distributed.all_gather_object(made, mine, group=self.group),
                         "agreeing on the sessions kept")
        return [s if all(theirs[j] for theirs in made) else None for j, s in enumerate(kept)]

    # ---- internals ------------------------------------------------------------------------------
    def _earliest(self, records: list) -> ChunkAborted | None:
        """Every rank's record of one transaction, rank by rank ((stage order, class name, stage,
        detail), or None) -> the failure every rank raises: the earliest failing stage's, the
        lowest rank's among equals; None when no rank failed."""
        failed = [(at, rank, name, stage, detail) for rank, record in enumerate(records) if record is not None
                  for at, name, stage, detail in [record]]
        if not failed:
            return None
        _, rank, name, stage, detail = min(failed)
        return BY_NAME[name](stage, f"{detail} (rank {rank} of {self.world})")

    def _exchange(self, mine: tuple[int, ChunkAborted] | None) -> bool:
        """Every rank's record of this exchange (kept when one is a failure) -> whether one is."""
        from torch import distributed
        record = torch.zeros(RECORD, dtype=torch.uint8)
        if mine is not None:
            at, failure = mine
            detail = f"{failure.stage}\0{failure.detail}".encode()[:RECORD - 4]
            record[:4] = torch.tensor([1, NAMES.index(_named(failure)), at // 256, at % 256], dtype=torch.uint8)
            record[4:4 + len(detail)] = torch.frombuffer(bytearray(detail), dtype=torch.uint8)
        record = record.to(self.device)
        parts = [torch.empty_like(record) for _ in range(self.world)]
        self._collective(lambda: distributed.all_gather(parts, record, group=self.group), "exchanging the ranks' status")
        records = [_read(part.cpu()) for part in parts]
        if any(r is not None for r in records):
            self._records = records
            return True
        return False

    def _parts(self, x: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every rank's `x`, rank by rank."""
        from torch import distributed
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._collective(lambda: distributed.all_gather(parts, x, group=self.group), what)
        return parts

    def _collective(self, work: Callable[[], object], what: str) -> None:
        if self.lost is not None:
            raise RankLost("ranks", f"this model's ranks are broken ({self.lost}); load it again")
        try:
            work()
        except Exception as exc:              # a peer gone (connection closed) or the group's timeout
            self.lost = f"{what} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise RankLost("ranks", f"rank {self.rank} of {self.world}: {self.lost}: a rank stopped "
                                    f"answering") from exc


def _read(record: torch.Tensor) -> tuple[int, str, str, str] | None:
    """An exchanged record -> (stage order, the failure's class name, stage, detail), or None: no
    failure."""
    if not int(record[0]):
        return None
    text = bytes(record[4:].tolist()).rstrip(b"\0").decode(errors="replace")
    stage, _, detail = text.partition("\0")
    return int(record[2]) * 256 + int(record[3]), NAMES[int(record[1])], stage, detail


def _named(failure: ChunkAborted) -> str:
    """The class a failure is raised as on every rank: its own where every rank knows it (a
    refused pool block stays `PoolExhausted`, which a server preempts for), else its kind's."""
    name = type(failure).__name__
    return name if name in BY_NAME else BY_KIND[failure.kind].__name__
