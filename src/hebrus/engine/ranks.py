"""A tensor-parallel model's ranks, as one of them sees them: the collectives its stages add
their parts up with, and the distributed commit.

Every rank runs the same chunk over its shards (`layers.shard`), in its own transaction. The
stages meet at collectives (`reduce`: a split sublayer's partial outputs added up; `gather`: the
logits' vocabulary parts joined), and before each of them, and after each stage, the ranks
exchange one status word: 0 to go on, 1 from a rank whose stage raised. A rank that raises sends
its 1 at its next exchange and stops; the others, which are at the same exchange (everything
before it was the same on every rank), stop there too, so no rank is left waiting in a
collective the others never reach. Then, stopped or not, every rank puts its own failure (none,
or its kind, stage and detail) on the table (`agree`): the earliest failing stage's, the lowest
rank's among equals, is every rank's, and each raises that same `ChunkAborted`, or all publish.

A rank that stops answering (its process killed, a hung device) makes a collective fail or run
past the group's timeout: the survivor's chunk aborts as `RankLost` (the `command` kind) with
nothing published, and the group is broken for good: every later chunk is refused at once.
"""
from __future__ import annotations

from typing import Callable

import torch

from hebrus.errors import (AllocationError, ChunkAborted, CommandError, DeviceStatusError, NonFiniteError,
                           StructuralError)

BY_KIND = {cls.kind: cls for cls in (StructuralError, NonFiniteError, AllocationError, CommandError,
                                     DeviceStatusError)}


class PeerStopped(StructuralError):
    """Another rank's stage raised: this rank stopped at the same exchange (never reported: the
    failing rank's own failure is, `Ranks.agree`)."""


class RankLost(CommandError):
    """A collective failed or timed out: a rank stopped answering. Nothing was published; the
    model's ranks cannot step together again (load it again; sessions come back from their
    snapshots)."""


class Ranks:
    """Rank `rank` of `world` over `group` (a `torch.distributed` process group)."""

    def __init__(self, rank: int, world: int, group, device: torch.device):
        self.rank, self.world, self.group, self.device = rank, world, group, device
        self.lost: str | None = None            # why the group is broken, once it is

    # ---- the stages' collectives ----------------------------------------------------------
    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of every rank's `x` (a new tensor)."""
        from torch import distributed
        self.go()
        y = x.contiguous().clone()
        self._collective(lambda: distributed.all_reduce(y, group=self.group), "adding up a layer's parts")
        return y

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` [..., n], rank after rank along the last dimension [..., world·n]."""
        from torch import distributed
        self.go()
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        self._collective(lambda: distributed.all_gather(parts, x, group=self.group), "joining the logits")
        return torch.cat(parts, dim=-1)

    # ---- the status exchanges ---------------------------------------------------------------
    def go(self) -> None:
        """The exchange before a collective and after a stage: PeerStopped if a rank stopped."""
        if self._exchange(0):
            raise PeerStopped("ranks", "another rank's stage failed")

    def stop(self) -> None:
        """This rank's stage raised: tell the others at the exchange they are at (once a chunk)."""
        if self.lost is None:
            try:
                self._exchange(1)
            except RankLost:
                pass

    def agree(self, failure: ChunkAborted | None, order: Callable[[str], int]) -> ChunkAborted | None:
        """Every rank's failure put together: the earliest failing stage's (`order` ranks a stage
        name), the lowest rank's among equals, as a new `ChunkAborted` equal on every rank; None
        when no rank failed, and every rank publishes."""
        from torch import distributed
        if isinstance(failure, RankLost):
            return failure
        mine = None if failure is None or isinstance(failure, PeerStopped) else \
            (order(failure.stage), failure.kind, failure.stage, failure.detail)
        everyone: list = [None] * self.world
        self._collective(lambda: distributed.all_gather_object(everyone, mine, group=self.group),
                         "agreeing on the chunk")
        failed = [(f[0], rank, f) for rank, f in enumerate(everyone) if f is not None]
        if not failed:
            if failure is not None:                 # stopped, yet no rank says why: cannot happen
                return StructuralError("ranks", "a rank stopped without a failure of its own")
            return None
        _, rank, (_, kind, stage, detail) = min(failed)
        return BY_KIND[kind](stage, f"{detail} (rank {rank} of {self.world})")

    # ---- internals ------------------------------------------------------------------------------
    def _exchange(self, value: int) -> int:
        from torch import distributed
        flag = torch.full((1,), value, dtype=torch.int32, device=self.device)
        self._collective(lambda: distributed.all_reduce(flag, group=self.group), "exchanging the ranks' status")
        return int(flag.item())

    def _collective(self, work: Callable[[], object], what: str) -> None:
        if self.lost is not None:
            raise RankLost("ranks", f"this model's ranks are broken ({self.lost}); load it again")
        try:
            work()
        except Exception as exc:              # a peer gone (connection closed) or the group's timeout
            self.lost = f"{what} failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            raise RankLost("ranks", f"rank {self.rank} of {self.world}: {self.lost}: a rank stopped "
                                    f"answering") from exc
