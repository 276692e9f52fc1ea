"""How far fast mode may be from exact mode, and the comparison that checks it.

Fast mode rounds differently from exact mode, so a discrete choice at a near-tie can flip and
everything downstream of that token differ. The comparison therefore runs fast mode with exact
mode's choices replayed (`model.replay`): its continuous values must stay within the dtype's
`Bound`, and wherever its own choice differed from exact's, exact's choice must have been a
near-tie. `hebrus verify --mode fast`, the tests and `benchmarks/fast_bound.py` use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hebrus.layers.replay import Flip, Recorder, Replayer

if TYPE_CHECKING:
    from hebrus.session import Session


@dataclass(frozen=True, slots=True)
class Bound:
    """How far fast mode may be from exact mode in one dtype, with exact's choices replayed.

    `tolerance` applies to every continuous value: each floating owner of the image and the
    logits, relative to the largest magnitude of the tensor, and the scores a chooser ranks
    (router probabilities, indexer scores, logits for greedy), relative to the largest
    magnitude at their site (`model.replay`). Scores within δ of exact's can change a choice
    only where its gap is ≤ 2δ, so every flip must be at a margin ≤ `margin` = 2·`tolerance`.
    """
    tolerance: float

    @property
    def margin(self) -> float:
        return 2 * self.tolerance

    def widened(self, floor: float) -> "Bound":
        """The bound for a model whose exact mode is itself `floor` away from exact arithmetic:
        fast may differ from exact by its own rounding plus exact's, so up to FLOOR_FACTOR
        times exact's when that is more than the dtype's tolerance."""
        return Bound(max(self.tolerance, FLOOR_FACTOR * floor))


# Fast mode counts as accurate if its distance from exact arithmetic is at most 7 times exact
# mode's own; the two then differ by at most 8 times exact's (measured: up to 4.1 times, on the
# tiny qwen3_5 test model, where fast sums the chunk in another order).
FLOOR_FACTOR = 8.0


# A multiple of the dtype's machine epsilon, about 3x the worst measured by
# benchmarks/fast_bound.py (results/fast-bound-cpu.md).
BOUNDS = {
    torch.float64: Bound(256 * torch.finfo(torch.float64).eps),      # 2^-44 ≈ 5.7e-14
    torch.float32: Bound(256 * torch.finfo(torch.float32).eps),      # 2^-15 ≈ 3.1e-5
    torch.bfloat16: Bound(8 * torch.finfo(torch.bfloat16).eps),      # 2^-4 = 0.0625
    torch.float16: Bound(16 * torch.finfo(torch.float16).eps),       # 2^-6 ≈ 0.0156
}


def run_chunks(model, tokens: list[int], sizes: list[int]):
    """A new session of `model` fed `tokens` in chunks of `sizes` -> (session, last logits)."""
    s = model.session()
    at, logits = 0, None
    for size in sizes:
        logits = s.feed(tokens[at:at + size])
        at += size
    return s, logits


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def owner_errors(fast_session, exact_session) -> dict[str, float]:
    """Per owner of the public image: the relative error, or for an integer owner 0 (equal) / inf."""
    out = {}
    for spec in exact_session.image.specs:
        a, b = (s.image.value(spec.name) for s in (fast_session, exact_session))
        if b.is_floating_point():
            out[spec.name] = relative_error(a, b)
        else:
            out[spec.name] = 0.0 if torch.equal(a, b) else float("inf")
    return out


def state_error(fast_session, exact_session) -> tuple[float, str]:
    """Largest relative error over every owner of the public image, and which owner."""
    errors = owner_errors(fast_session, exact_session)
    where = max(errors, key=errors.get)
    return (errors[where], where) if errors[where] > 0 else (0.0, "")


@dataclass(slots=True)
class Replayed:
    """Fast runs with exact's choices replayed, against the exact run."""
    error: float = 0.0            # owners and logits
    where: str = ""
    score_error: float = 0.0      # what the choosers ranked, at their sites' scale
    score_where: str = ""
    flips: list[tuple[float, Flip]] = field(default_factory=list)     # (exact's margin, flip)
    closest: float = float("inf")     # the smallest nonzero margin among exact's choices
    closest_where: str = ""
    ties: int = 0                     # exact's choices between equal scores (margin 0)
    recorder: Recorder | None = None  # exact's run: its choices

    @classmethod
    def of(cls, recorder: Recorder) -> "Replayed":
        out, scales = cls(recorder=recorder), recorder.scales()
        for (site, position), choice in recorder.log.items():
            margin = choice.gap / scales[site]
            out.ties += margin == 0
            if 0 < margin < out.closest:
                out.closest, out.closest_where = margin, f"{site} @ {position}"
        return out

    def add(self, error: float, where: str, replayer: Replayer, scales: dict[str, float]) -> None:
        if error > self.error:
            self.error, self.where = error, where
        for site, (distance, position) in replayer.distances.items():
            if distance / scales[site] > self.score_error:
                self.score_error, self.score_where = distance / scales[site], f"{site} @ {position}"
        self.flips += [(f.gap / scales[f.site], f) for f in replayer.flips]

    def problems(self, bound: Bound) -> list[str]:
        out = [f"{what} relative error {err:.2e} ({where}) > {bound.tolerance:.2g}"
               for what, err, where in (("state", self.error, self.where),
                                        ("score", self.score_error, self.score_where))
               if not err <= bound.tolerance]
        far = [(m, f) for m, f in self.flips if not m <= bound.margin]
        if far:
            m, f = max(far, key=lambda mf: mf[0])
            out.append(f"{len(far)} flip(s) not at a near-tie, e.g. {f.site} @ {f.position}: chose {f.own}, "
                       f"exact {f.recorded} at margin {m:.2e} > {bound.margin:.2g}")
        return out

    def summary(self) -> str:
        largest = f" (largest margin {max(m for m, _ in self.flips):.1e})" if self.flips else ""
        return (f"max relative error {self.error:.1e} ({self.where}), scores {self.score_error:.1e}; "
                f"{len(self.flips)} flips{largest}; closest near-tie {self.closest:.1e} ({self.closest_where})")


def record(model, tokens: list[int]) -> tuple["Session", torch.Tensor, Recorder]:
    """An exact run of `tokens` (one chunk: exact mode is chunking-invariant) logging its choices."""
    recorder = Recorder()
    s, logits = run_chunks(model.with_mode("exact", recorder), tokens, [len(tokens)])
    return s, logits, recorder


def replay(model, recorder: Recorder, tokens: list[int], sizes: list[int]):
    """A fast run of `model` in chunks of `sizes`, following the recorded choices."""
    replayer = Replayer(recorder.log, inner=model.kernels.choose)
    s, logits = run_chunks(model.with_mode("fast", replayer), tokens, sizes)
    return s, logits, replayer


def compare_replayed(model, tokens: list[int], chunkings: list[list[int]]) -> Replayed:
    """`model` (any mode; its chooser judged) in fast mode in each chunking, against exact."""
    ref, ref_logits, recorder = record(model, tokens)
    out, scales = Replayed.of(recorder), recorder.scales()
    for sizes in chunkings:
        s, logits, replayer = replay(model, recorder, tokens, sizes)
        err, where = state_error(s, ref)
        out.add(*max((err, where), (relative_error(logits, ref_logits), "logits")), replayer, scales)
    return out


def rounding_floor(model, recorder: Recorder, run) -> tuple[float, str]:
    """How far exact mode in the model's dtype is from exact mode in float64 on the same input,
    the float64 run following `recorder`'s choices: the model's own rounding error at its dtype.
    `run(model) -> (session or None, list of logits)` repeats the recorded run on another model.
    Raises MemoryError, without allocating, when the float64 copy of the weights would take more
    than half the memory free on the model's device."""
    need = 8 * sum(p.numel() for _, p in model.named_parameters())
    free = _free_memory(model.device)
    if need > free // 2:
        raise MemoryError(f"a float64 copy of the weights needs {need / 2**30:.1f} GiB, "
                          f"{free / 2**30:.1f} GiB are free")
    wide = model.with_dtype(torch.float64)
    replayer = Replayer(recorder.log, inner=wide.kernels.choose)
    ours, our_logits = run(model.with_mode("exact"))
    ref, ref_logits = run(wide.with_mode("exact", replayer))
    found = [(relative_error(a, b), "logits") for a, b in zip(our_logits, ref_logits)]
    if ours is not None:
        found.append(state_error(ours, ref))
    return max(found)


def _free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import os
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decoding with the model's chooser at the site "greedy" (position: the new token's).
    Returns the tokens and the logits each was chosen from."""
    s = model.session()
    logits, tokens, seen = s.feed(prompt), [], []
    for _ in range(steps):
        seen.append(logits)
        tokens.append(int(model.kernels.choose("greedy", s.frontier, logits[None], 1)[0, 0]))
        logits = s.feed(tokens[-1:])
    return tokens, seen
