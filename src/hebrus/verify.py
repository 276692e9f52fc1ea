"""The conformance suite behind `hebrus verify`.

Fault matrix: every stage × every fault kind. A cell is `held` when the injected failure raised
the right error at the right stage, the public digest, frontier and the caller's sentinel
buffer did not change, and the next chunk then gave bit-for-bit the result of a session that
never failed. Equivalence: chunkings and interleavings give bit-identical state in exact mode.
Fast mode is run with exact mode's discrete choices replayed (`model.replay`): its continuous
values stay within the dtype's tolerance of exact mode, and wherever its own choice differed
from exact's (a flip), exact's choice was a near-tie (see `Bound`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from hebrus.errors import FAULT_KINDS, ChunkAborted
from hebrus.faults import inject
from hebrus.model.replay import Flip, Recorder, Replayer

if TYPE_CHECKING:
    from hebrus.session import Session

WARM = 7                  # tokens committed before the chunk under test
CHUNK = 9                 # the chunk under test (longer than the tiny model's QSA top_k)


@dataclass(slots=True)
class Verdict:
    passed: bool
    verdict: str          # "held", "leaked", "missed", "ok", "FAILED"
    detail: str = ""


@dataclass(slots=True)
class Check:
    group: str            # "fault" or "equivalence"
    name: str
    run: Callable[[], Verdict]


@dataclass(slots=True)
class Result:
    group: str
    name: str
    passed: bool
    verdict: str
    detail: str = ""


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


# A multiple of the dtype's machine epsilon, about 3x the worst measured by
# benchmarks/fast_bound.py (results/fast-bound-cpu.md).
BOUNDS = {
    torch.float64: Bound(256 * torch.finfo(torch.float64).eps),      # 2^-44 ≈ 5.7e-14
    torch.float32: Bound(256 * torch.finfo(torch.float32).eps),      # 2^-15 ≈ 3.1e-5
    torch.bfloat16: Bound(8 * torch.finfo(torch.bfloat16).eps),      # 2^-4 = 0.0625
    torch.float16: Bound(16 * torch.finfo(torch.float16).eps),       # 2^-6 ≈ 0.0156
}


def checks(model, seed: int = 0) -> list[Check]:
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    warm = [rng.randrange(vocab) for _ in range(WARM)]
    chunk = [rng.randrange(vocab) for _ in range(CHUNK)]
    reference = _Reference(model, warm, chunk)
    out = [Check("fault", f"{stage} × {kind}", _fault_check(model, stage, kind, warm, chunk, reference))
           for stage in model.stage_names for kind in FAULT_KINDS]
    out += list(_equivalence_checks(model, rng))
    return out


class _Reference:
    """The state a session reaches when nothing fails (computed once, lazily)."""

    def __init__(self, model, warm, chunk):
        self.model, self.warm, self.chunk = model, warm, chunk
        self._value = None

    def get(self):
        if self._value is None:
            s = self.model.session()
            s.feed(self.warm)
            logits = s.feed(self.chunk)
            self._value = (s.digest(), logits)
        return self._value


def _fault_check(model, stage, kind, warm, chunk, reference) -> Callable[[], Verdict]:
    def run() -> Verdict:
        s = model.session()
        s.feed(warm)
        before, frontier = s.digest(), s.frontier
        sentinel = torch.full((model.config.vocab_size,), 12345.0, dtype=model.dtype, device=model.device)
        try:
            with inject(stage=stage, kind=kind):
                s.feed(chunk, out=sentinel)
        except ChunkAborted as exc:
            if (exc.kind, exc.stage) != (kind, stage):
                return Verdict(False, "missed", f"raised {exc.kind} at {exc.stage}")
        else:
            return Verdict(False, "missed", "no error raised")
        leaks = []
        if s.digest() != before:
            leaks.append("digest changed")
        if s.frontier != frontier:
            leaks.append("frontier moved")
        if not bool((sentinel == 12345.0).all()):
            leaks.append("out buffer written")
        digest, logits = reference.get()
        again = s.feed(chunk)
        if s.digest() != digest or not torch.equal(again, logits):
            leaks.append("next chunk differs from a session that never failed")
        if leaks:
            return Verdict(False, "leaked", "; ".join(leaks))
        return Verdict(True, "held")

    return run


def _equivalence_checks(model, rng: random.Random) -> Iterator[Check]:
    vocab = model.config.vocab_size
    tokens = [rng.randrange(vocab) for _ in range(40)]
    splits = [_random_split(len(tokens), rng) for _ in range(3)]
    if model.mode == "exact":
        yield Check("equivalence", "single token = whole chunk (bit-identical)",
                    lambda: _same_bits(model, tokens, [[1] * len(tokens), [len(tokens)]]))
        yield Check("equivalence", "random chunkings (bit-identical)",
                    lambda: _same_bits(model, tokens, [[len(tokens)]] + splits))
        yield Check("equivalence", "interleaved sessions (bit-identical)",
                    lambda: _interleaved(model, tokens, rng))
    else:
        bound = BOUNDS[model.dtype]
        yield Check("equivalence", f"fast = exact within {bound.tolerance:.2g}, choices replayed",
                    lambda: fast_close_to_exact(model, tokens, [[len(tokens)], [1] * len(tokens)] + splits))
        yield Check("equivalence", "fast greedy tokens = exact's, except at near-ties",
                    lambda: fast_greedy_like_exact(model, tokens[:12], 24))


def _random_split(n: int, rng: random.Random) -> list[int]:
    sizes = []
    while n:
        sizes.append(min(n, rng.choice([1, 2, 3, 5, 8, 13])))
        n -= sizes[-1]
    return sizes


def _run(model, tokens, sizes):
    s = model.session()
    at, logits = 0, None
    for size in sizes:
        logits = s.feed(tokens[at:at + size])
        at += size
    return s, logits


def _same_bits(model, tokens, chunkings) -> Verdict:
    ref, ref_logits = _run(model, tokens, chunkings[0])
    for sizes in chunkings[1:]:
        s, logits = _run(model, tokens, sizes)
        if s.digest() != ref.digest() or not torch.equal(logits, ref_logits):
            return Verdict(False, "FAILED", f"chunking {sizes} differs")
    return Verdict(True, "ok")


def _interleaved(model, tokens, rng) -> Verdict:
    others = [[rng.randrange(model.config.vocab_size) for _ in tokens] for _ in range(2)]
    streams = [tokens] + others
    refs = [_run(model, t, [len(t)]) for t in streams]
    sessions = [model.session() for _ in streams]
    positions = [0] * len(streams)
    last = [None] * len(streams)
    while any(p < len(t) for p, t in zip(positions, streams)):
        i = rng.randrange(len(streams))
        if positions[i] < len(streams[i]):
            size = rng.choice([1, 2, 4, 7])
            last[i] = sessions[i].feed(streams[i][positions[i]:positions[i] + size])
            positions[i] = min(len(streams[i]), positions[i] + size)
    for s, logits, (ref, ref_logits) in zip(sessions, last, refs):
        if s.digest() != ref.digest() or not torch.equal(logits, ref_logits):
            return Verdict(False, "FAILED", "an interleaved session differs")
    return Verdict(True, "ok")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def owner_errors(fast_session, exact_session) -> dict[str, float]:
    """Per owner of the public image: the relative error, or for an integer owner 0 (equal) / inf."""
    out = {}
    for spec in exact_session.image.specs:
        a, b = (_public(s, spec) for s in (fast_session, exact_session))
        if b.is_floating_point():
            out[spec.name] = relative_error(a, b)
        else:
            out[spec.name] = 0.0 if torch.equal(a, b) else float("inf")
    return out


def _public(session, spec) -> torch.Tensor:
    return session.image.read(spec.name) if spec.kind == "banked" else session.image.rows(spec.name)


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

    @classmethod
    def of(cls, recorder: Recorder) -> "Replayed":
        out, scales = cls(), recorder.scales()
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
    s, logits = _run(model.with_mode("exact", recorder), tokens, [len(tokens)])
    return s, logits, recorder


def replay(model, recorder: Recorder, tokens: list[int], sizes: list[int]):
    """A fast run of `model` in chunks of `sizes`, following the recorded choices."""
    replayer = Replayer(recorder.log, inner=model.kernels.choose)
    s, logits = _run(model.with_mode("fast", replayer), tokens, sizes)
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


def fast_close_to_exact(fast, tokens, chunkings) -> Verdict:
    return _verdict(compare_replayed(fast, tokens, chunkings), fast.dtype)


def _verdict(result: Replayed, dtype: torch.dtype, extra: list[str] = (), prefix: str = "") -> Verdict:
    problems = result.problems(BOUNDS[dtype]) + list(extra)
    if problems:
        return Verdict(False, "FAILED", "; ".join(problems))
    return Verdict(True, "ok", prefix + result.summary())


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


def fast_greedy_like_exact(fast, prompt, steps) -> Verdict:
    recorder = Recorder()
    want, want_logits = greedy(fast.with_mode("exact", recorder), prompt, steps)
    replayer = Replayer(recorder.log, inner=fast.kernels.choose)
    got, got_logits = greedy(fast.with_mode("fast", replayer), prompt, steps)
    error = max(relative_error(a, b) for a, b in zip(got_logits, want_logits))
    result = Replayed.of(recorder)
    result.add(error, "logits", replayer, recorder.scales())
    ties = sum(f.site == "greedy" for _, f in result.flips)
    differ = [] if got == want else ["replayed tokens differ"]
    tokens = f"{steps} tokens, {ties} differ (at near-ties); " if ties else f"{steps} tokens, all equal; "
    return _verdict(result, fast.dtype, differ, tokens)


def run(model, progress: Callable[[int, int, str], None] | None = None) -> list[Result]:
    todo = checks(model)
    results = []
    for i, check in enumerate(todo):
        if progress:
            progress(i, len(todo), check.name)
        try:
            verdict = check.run()
        except Exception as exc:                                 # a check crashing is a failure
            verdict = Verdict(False, "FAILED", f"{type(exc).__name__}: {exc}")
        results.append(Result(check.group, check.name, verdict.passed, verdict.verdict, verdict.detail))
    if progress:
        progress(len(todo), len(todo), "done")
    return results
