"""Two choosers for comparing runs: a `Recorder` logs every discrete choice of one session and
how far it was from a tie; a `Replayer` makes its own choice, notes where that differs from the
log (a `Flip`) and how far its scores are from the logged ones, and returns the logged choice,
so its run follows the recorded discrete path.

Scores are compared at the scale of their site: the largest score magnitude the recorded run
saw there (`Recorder.scales`), as owners are compared at the largest magnitude of the tensor.
A choice's margin is its gap (`ops.choose.gaps`) over that scale.

Both synchronise with the host at every choice: they are for verification, not for serving.
Choices are keyed by (site, absolute position); one log describes one session.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hebrus.layers.kernels import Chooser, top_k_chooser
from hebrus.ops.choose import gaps


@dataclass(frozen=True, slots=True)
class Choice:
    indices: tuple[int, ...]      # the real choices, best first (fewer than k when fewer candidates)
    ordered: bool                 # whether rank order matters, or only the set
    gap: float                    # distance from a tie, in score units (inf: nothing to choose)
    scores: torch.Tensor          # the row's scores [N] float64 on the CPU (-inf: not a candidate)

    def same(self, other: "Choice") -> bool:
        if self.ordered:
            return self.indices == other.indices
        return sorted(self.indices) == sorted(other.indices)


@dataclass(frozen=True, slots=True)
class Flip:
    site: str
    position: int
    recorded: tuple[int, ...]
    own: tuple[int, ...]
    gap: float                    # the recorded choice's gap: how near a tie it was


def choices(scores: torch.Tensor, chosen: torch.Tensor, k: int, ordered: bool) -> list[Choice]:
    """One `Choice` per row of `scores` [T, N], given the indices chosen [T, k]."""
    rows = scores.detach().double().cpu()
    real = rows.isfinite().sum(-1).clamp(max=k).tolist()
    gap = gaps(rows, k, ordered).tolist()
    picked = chosen.cpu().tolist()
    return [Choice(tuple(picked[t][:real[t]]), ordered, gap[t], rows[t]) for t in range(len(real))]


def score_distance(own: Choice, recorded: Choice) -> float:
    """Largest absolute difference over the recorded row's candidates."""
    live = recorded.scores.isfinite()
    if not bool(live.any()):
        return 0.0
    return float((own.scores[:live.shape[0]][live] - recorded.scores[live]).abs().max())


class Recorder:
    """Chooses with `inner` and logs every choice: `log[(site, position)] -> Choice`."""

    def __init__(self, inner: Chooser = top_k_chooser):
        self.inner = inner
        self.log: dict[tuple[str, int], Choice] = {}

    def __call__(self, site: str, start: int, scores: torch.Tensor, k: int, ordered: bool = True):
        chosen = self.inner(site, start, scores, k, ordered)
        for row, choice in enumerate(choices(scores, chosen, k, ordered)):
            self.log[(site, start + row)] = choice
        return chosen

    def scales(self) -> dict[str, float]:
        """Per site, the largest score magnitude among its candidates (at least the smallest normal)."""
        out: dict[str, float] = {}
        for (site, _), choice in self.log.items():
            live = choice.scores[choice.scores.isfinite()]
            top = float(live.abs().max()) if live.numel() else 0.0
            out[site] = max(out.get(site, torch.finfo(torch.float64).tiny), top)
        return out


class Replayer:
    """Chooses with `inner`, records each `Flip` from the log and, per site, the largest distance
    of its scores from the recorded ones (rows with something to choose), and returns the
    recorded choice."""

    def __init__(self, log: dict[tuple[str, int], Choice], inner: Chooser = top_k_chooser):
        self.log, self.inner = log, inner
        self.flips: list[Flip] = []
        self.distances: dict[str, tuple[float, int]] = {}      # site -> (largest distance, position)

    def __call__(self, site: str, start: int, scores: torch.Tensor, k: int, ordered: bool = True):
        chosen = self.inner(site, start, scores, k, ordered).clone()
        for row, own in enumerate(choices(scores, chosen, k, ordered)):
            recorded = self._recorded(site, start + row)
            self._compare(site, start + row, own, recorded)
            replayed = torch.tensor(recorded.indices, dtype=chosen.dtype, device=chosen.device)
            chosen[row, :len(recorded.indices)] = replayed
        return chosen

    def _recorded(self, site: str, position: int) -> Choice:
        try:
            return self.log[(site, position)]
        except KeyError:
            raise KeyError(f"no recorded choice for {site} at position {position}") from None

    def _compare(self, site: str, position: int, own: Choice, recorded: Choice) -> None:
        if not own.same(recorded):
            self.flips.append(Flip(site, position, recorded.indices, own.indices, recorded.gap))
        if recorded.gap == float("inf"):
            return                                  # nothing to choose: the scores cannot matter
        distance = score_distance(own, recorded)
        if distance > self.distances.get(site, (0.0, 0))[0]:
            self.distances[site] = (distance, position)
