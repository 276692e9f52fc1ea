"""The conformance suite behind `hebrus verify`.

Fault matrix: every stage × every fault kind. A cell is `held` when the injected failure raised
the right error at the right stage, the public digest, frontier and the caller's sentinel
buffer did not change, and the next chunk then gave bit-for-bit the result of a session that
never failed. Batch cells: the same matrix in a ragged step of three sessions (two feeding a
chunk, one decoding), the fault aimed at one of them (in turn a chunk's and the decoder's): it
alone aborts with the right error at the right stage and keeps its state, the others publish
what the same step publishes with no fault (after a pass kind, structural or command, what each
publishes alone, as each innocent session is then run alone): in exact mode bit for bit, in
fast mode logits within the dtype's tolerance (fast mode groups a step's tokens per expert, so
another session's routes change how a product is blocked, not what it is), and its next chunk
alone gives what a session that never failed gives. Equivalence: chunkings and interleavings give bit-identical state in exact mode.
Fast mode is run with exact mode's discrete choices replayed (`model.replay`): its continuous
values stay within the dtype's tolerance of exact mode, and wherever its own choice differed
from exact's (a flip), exact's choice was a near-tie (see `Bound`).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from hebrus.batching import feed_many
from hebrus.errors import FAULT_KINDS, ChunkAborted
from hebrus.faults import PASS_KINDS
from hebrus.faults import inject, page_read_failure
from hebrus.bound import (BOUNDS, FLOOR_FACTOR, Replayed, compare_replayed, greedy, relative_error,
                          rounding_floor, run_chunks)
from hebrus.layers.replay import Recorder, Replayer

WARM = 7                  # tokens committed before the chunk under test
CHUNK = 9                 # the chunk under test (longer than the tiny model's QSA top_k)


@dataclass(slots=True)
class Verdict:
    passed: bool
    verdict: str          # "held", "leaked", "missed", "ok", "FAILED"
    detail: str = ""


@dataclass(slots=True)
class Check:
    group: str            # "fault", "batch" or "equivalence"
    name: str
    run: Callable[[], Verdict]


@dataclass(slots=True)
class Result:
    group: str
    name: str
    passed: bool
    verdict: str
    detail: str = ""


def checks(model, seed: int = 0) -> list[Check]:
    """The suite for `model`. A tensor-parallel model (`hebrus.parallel`) runs the fault matrix
    on each rank (every rank must raise the injected failure and keep its part: a session's
    digest is every part's), its equivalence checks, and one of its own: its ranks against the
    model on one rank; it does not step several sessions in one pass, so no batch cells."""
    rng = random.Random(seed)
    vocab = model.spec.vocab_size
    warm = [rng.randrange(vocab) for _ in range(WARM)]
    chunk = [rng.randrange(vocab) for _ in range(CHUNK)]
    reference = _Reference(model, warm, chunk)
    world = getattr(model, "world", None)
    out = [Check("fault", cell(stage, kind, rank), _fault_check(model, stage, kind, warm, chunk, reference, rank))
           for rank in (range(world) if world else [None]) for stage in model.stage_names for kind in FAULT_KINDS]
    if world:
        out += list(_equivalence_checks(model, rng, whole=False))
        out.append(Check("equivalence", f"{world} ranks = one rank within {BOUNDS[model.dtype].tolerance:.2g}",
                         lambda: _ranks_like_one(model, [rng.randrange(vocab) for _ in range(40)])))
        return out
    batch = _Batch(model, random.Random(seed + 1))     # its own draws: the other checks' inputs unchanged
    out += [Check("batch", f"{stage} × {kind}", _batch_check(batch, n % 2, stage, kind))
            for n, stage in enumerate(model.stage_names) for kind in FAULT_KINDS]
    if model.paged:                 # the command kind's own cause for paged tables: a page not read
        out.append(Check("fault", "ple × command (a page read fails)", _page_check(model, warm, chunk, reference)))
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


def cell(stage: str, kind: str, rank: int | None = None) -> str:
    """A fault cell's name (on a rank of a tensor-parallel model: prefixed with it)."""
    return f"{stage} × {kind}" if rank is None else f"rank {rank}: {stage} × {kind}"


def _ranks_like_one(model, tokens) -> Verdict:
    """A tensor-parallel model's logits after `tokens` against the same model on one rank, within
    the dtype's tolerance (the ranks add their parts in another order)."""
    from hebrus.runtime import load
    one = load(model.plan.source, **model.plan.options)
    expected = one.session().feed(tokens)
    got = model.session().feed(tokens)
    error = relative_error(got, expected)
    bound = BOUNDS[model.dtype].tolerance
    return Verdict(error <= bound, "ok" if error <= bound else "FAILED", f"relative error {error:.2g}")


def _fault_check(model, stage, kind, warm, chunk, reference, rank: int | None = None) -> Callable[[], Verdict]:
    def run() -> Verdict:
        s = model.session()
        s.feed(warm)
        before, frontier = s.digest(), s.frontier
        sentinel = torch.full((model.spec.vocab_size,), 12345.0, dtype=model.dtype, device=model.device)
        try:
            with inject(stage=stage, kind=kind, **({} if rank is None else {"rank": rank})):
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


class _Batch:
    """Three sessions and their chunks for a ragged step, and (computed once, lazily) what each
    publishes in that step with no fault and fed its chunk alone: (logits, digest) each. The
    sessions decode eagerly: a session retried alone after its pass failed runs its chunk
    eagerly (an armed fault keeps graphs out), so `alone` computes what the retry computes;
    from a graph, a one-token chunk would round differently."""

    def __init__(self, model, rng: random.Random):
        vocab = model.spec.vocab_size
        self.model = model
        self.warm = [[rng.randrange(vocab) for _ in range(n)] for n in (WARM, 2 * WARM, 3)]
        self.chunks = [[rng.randrange(vocab) for _ in range(n)] for n in (CHUNK, 1, 4)]
        self._bases = None
        self._together = self._alone = None

    def sessions(self) -> list:
        if self._bases is None:
            self._bases = []
            for warm in self.warm:
                s = self.model.session(decode="eager")
                s.feed(warm)
                self._bases.append(s)
        return [s.fork() for s in self._bases]

    def together(self) -> list:
        if self._together is None:
            sessions = self.sessions()
            got = feed_many(sessions, self.chunks)
            self._together = [(g, s.digest()) for g, s in zip(got, sessions)]
        return self._together

    def alone(self) -> list:
        if self._alone is None:
            self._alone = []
            for s, chunk in zip(self.sessions(), self.chunks):
                self._alone.append((s.feed(chunk), s.digest()))
        return self._alone


def _batch_check(batch: _Batch, target: int, stage: str, kind: str) -> Callable[[], Verdict]:
    def run() -> Verdict:
        model = batch.model
        sessions = batch.sessions()
        before, frontier = sessions[target].digest(), sessions[target].frontier
        outs = [torch.full((model.spec.vocab_size,), 12345.0, dtype=model.dtype, device=model.device)
                for _ in sessions]
        with inject(stage=stage, kind=kind, session=sessions[target]):
            got = feed_many(sessions, batch.chunks, outs=outs)
        error = got[target]
        if not isinstance(error, ChunkAborted):
            return Verdict(False, "missed", f"session {target}: no error raised")
        if (error.kind, error.stage) != (kind, stage):
            return Verdict(False, "missed", f"session {target}: raised {error.kind} at {error.stage}")
        leaks = []
        if sessions[target].digest() != before or sessions[target].frontier != frontier:
            leaks.append("the failed session's state changed")
        if not bool((outs[target] == 12345.0).all()):
            leaks.append("the failed session's out buffer written")
        reference = batch.alone() if kind in PASS_KINDS else batch.together()
        exact = not model.kernels.whole_chunk
        for i, (logits, digest) in enumerate(reference):
            if i == target:
                continue
            published = isinstance(got[i], torch.Tensor)
            same = published and (torch.equal(got[i], logits) and sessions[i].digest() == digest if exact else
                                  relative_error(got[i], logits) <= BOUNDS[model.dtype].tolerance)
            if not same:
                leaks.append(f"session {i} did not publish what it publishes without the fault"
                             + ("" if published else f" ({got[i]})"))
        logits, digest = batch.alone()[target]
        again = sessions[target].feed(batch.chunks[target])
        if sessions[target].digest() != digest or not torch.equal(again, logits):
            leaks.append("the failed session's next chunk differs from a session that never failed")
        return Verdict(not leaks, "leaked" if leaks else "held", "; ".join(leaks))

    return run


def _page_check(model, warm, chunk, reference) -> Callable[[], Verdict]:
    """A page of a paged PLE table cannot be read inside the chunk (through a model that reads
    every lookup from the tables' source, so the chunk does read): a command abort at ple, with
    the state, the caller's buffer and the cache as they were, and the next chunk unaffected."""
    def run() -> Verdict:
        reading = model.with_paging(0)
        s = reading.session()
        s.feed(warm)
        before, frontier = s.digest(), s.frontier
        cached = {name: (dict(t.mapping), sorted(t.free)) for name, t in reading.paged.items()}
        sentinel = torch.full((model.spec.vocab_size,), 12345.0, dtype=model.dtype, device=model.device)
        try:
            with page_read_failure(reading):
                s.feed(chunk, out=sentinel)
        except ChunkAborted as exc:
            if (exc.kind, exc.stage) != ("command", "ple"):
                return Verdict(False, "missed", f"raised {exc.kind} at {exc.stage}")
        else:
            return Verdict(False, "missed", "no error raised")
        leaks = []
        if s.digest() != before or s.frontier != frontier:
            leaks.append("state changed")
        if not bool((sentinel == 12345.0).all()):
            leaks.append("out buffer written")
        if {name: (dict(t.mapping), sorted(t.free)) for name, t in reading.paged.items()} != cached:
            leaks.append("page cache changed")
        digest, logits = reference.get()
        again = s.feed(chunk)
        if s.digest() != digest or not torch.equal(again, logits):
            leaks.append("next chunk differs from a session that never failed")
        return Verdict(not leaks, "leaked" if leaks else "held", "; ".join(leaks))

    return run


def _equivalence_checks(model, rng: random.Random, whole: bool = True) -> Iterator[Check]:
    """Exact mode: chunkings and interleavings, bit for bit; fast mode (with `whole`: a model on
    one rank, which can rerun itself in exact mode) against exact mode."""
    vocab = model.spec.vocab_size
    tokens = [rng.randrange(vocab) for _ in range(40)]
    splits = [_random_split(len(tokens), rng) for _ in range(3)]
    if model.mode == "exact":
        yield Check("equivalence", "single token = whole chunk (bit-identical)",
                    lambda: _same_bits(model, tokens, [[1] * len(tokens), [len(tokens)]]))
        yield Check("equivalence", "random chunkings (bit-identical)",
                    lambda: _same_bits(model, tokens, [[len(tokens)]] + splits))
        yield Check("equivalence", "interleaved sessions (bit-identical)",
                    lambda: _interleaved(model, tokens, rng))
    elif whole:
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


def _same_bits(model, tokens, chunkings) -> Verdict:
    ref, ref_logits = run_chunks(model, tokens, chunkings[0])
    for sizes in chunkings[1:]:
        s, logits = run_chunks(model, tokens, sizes)
        if s.digest() != ref.digest() or not torch.equal(logits, ref_logits):
            return Verdict(False, "FAILED", f"chunking {sizes} differs")
    return Verdict(True, "ok")


def _interleaved(model, tokens, rng) -> Verdict:
    others = [[rng.randrange(model.spec.vocab_size) for _ in tokens] for _ in range(2)]
    streams = [tokens] + others
    refs = [run_chunks(model, t, [len(t)]) for t in streams]
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


def fast_close_to_exact(fast, tokens, chunkings) -> Verdict:
    result = compare_replayed(fast, tokens, chunkings)

    def repeat(model):
        s, logits = run_chunks(model, tokens, [len(tokens)])
        return s, [logits]

    return _verdict(result, fast, lambda: rounding_floor(fast, result.recorder, repeat))


def _verdict(result: Replayed, model, floor_of, prefix: str = "") -> Verdict:
    """Within the dtype's bound; or, where not, within FLOOR_FACTOR times exact mode's own
    distance from float64 on the same run (`floor_of()`): a model whose rounding is amplified (a
    delta-rule head with a tiny output normalised back to unit scale) is held to what its own
    exact mode achieves, and the verdict says so."""
    bound, floor = BOUNDS[model.dtype], ""
    problems = result.problems(bound)
    if problems and model.dtype != torch.float64:
        try:
            error, where = floor_of()
        except MemoryError as exc:
            return Verdict(False, "FAILED", f"exact's own error not measured ({exc}); " + "; ".join(problems))
        bound = bound.widened(error)
        floor = (f"bound {bound.tolerance:.2g} = max(dtype's, {FLOOR_FACTOR:g} × exact's own error {error:.1e} "
                 f"({where}) against float64); ")
        problems = result.problems(bound)
    if problems:
        return Verdict(False, "FAILED", floor + "; ".join(problems))
    return Verdict(True, "ok", prefix + floor + result.summary())


def fast_greedy_like_exact(fast, prompt, steps) -> Verdict:
    recorder = Recorder()
    _, want_logits = greedy(fast.with_mode("exact", recorder), prompt, steps)
    replayer = Replayer(recorder.log, inner=fast.kernels.choose)
    _, got_logits = greedy(fast.with_mode("fast", replayer), prompt, steps)
    error = max(relative_error(a, b) for a, b in zip(got_logits, want_logits))
    result = Replayed.of(recorder)
    result.add(error, "logits", replayer, recorder.scales())
    ties = sum(f.site == "greedy" for _, f in result.flips)        # fast's own pick differed
    tokens = f"{steps} tokens, {ties} differ (at near-ties); " if ties else f"{steps} tokens, all equal; "

    def repeat(model):
        return None, greedy(model, prompt, steps)[1]

    return _verdict(result, fast, lambda: rounding_floor(fast, recorder, repeat), tokens)


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
