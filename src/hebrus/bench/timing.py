"""The timed runs: both variants taking turns at one context and batch size, and transformers on
the same checkpoint."""
from __future__ import annotations

import gc
import inspect
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hebrus.bench.inplace import InPlaceBatch, InPlaceSession, copies
from hebrus.bench.limits import sync
from hebrus.engine.graphs import decode_route
from hebrus.errors import InvalidInput

@dataclass
class Point:
    context: int
    prefill_s_per_token: dict[str, float] | None     # None for a batch: prefill is not batched yet
    decode_s_per_step: dict[str, float]
    captures: int = 0                                # graphs the transactional variant captured at this point
    join_leave_captures: int | None = None           # ... when a session left its batch and one joined
    ops: int | None = None                           # what one transactional decode step launches (`ops_per_step`)


# untimed decode steps before the timed ones: the first runs each step's plan uncaptured, the
# second captures it, and row storage may grow on any of them
WARM_STEPS = 6


def _point(model, prompt: list[int], steps: int, rounds: int, chunk: int, how: str, batch: int = 1) -> Point:
    """Median seconds per prefill token and per decode step for both variants. Round 0 is not
    timed: it warms both variants at this very context (allocations, kernel choices, graph
    captures), so no variant pays first-use costs inside a timed round; the variants alternate
    who goes first. With `batch` > 1, each variant decodes that many sessions together (copies
    of one prefilled session; `hebrus.feed_many` against `InPlaceBatch`), and prefill is not
    reported: it is not batched yet."""
    if batch > 1:
        return _batch_point(model, prompt, steps, rounds, chunk, batch, how)
    graphs = model.session(decode=how).decode == "graph"
    captured = _captures(model)
    variants = {"transactional": lambda: model.session(decode=how),
                "in-place": lambda: InPlaceSession(model, graphs=graphs)}
    prefill = {name: [] for name in variants}
    decode = {name: [] for name in variants}
    for r in range(rounds + 1):
        names = list(variants)[::-1] if r % 2 else list(variants)
        sessions, logits = {name: variants[name]() for name in names}, {}
        spent = {name: 0.0 for name in names}
        for name in names:
            sync(model.device)
            t = time.perf_counter()
            for begin in range(0, len(prompt), chunk):
                logits[name] = sessions[name].feed(prompt[begin:begin + chunk])
            sync(model.device)
            spent[name] = time.perf_counter() - t
        if r:                                      # round 0 only warms up
            for name in names:
                prefill[name].append(spent[name] / len(prompt))
        def advance(name, token):
            logits[name] = sessions[name].feed([token])

        spent = _timed_steps(model, names, steps, lambda name: int(torch.argmax(logits[name])), advance)
        if r:
            for name in names:
                decode[name].append(spent[name] / max(steps, 1))
    captures = _captures(model) - captured
    return Point(len(prompt), {n: statistics.median(v) for n, v in prefill.items()},
                 {n: statistics.median(v) for n, v in decode.items()}, captures,
                 ops=ops_per_step(model, [sessions["transactional"]], how))


def _captures(model) -> int:
    """Graphs the model's runners have captured so far."""
    return sum(runner.captures for runner in model._steps.values())


def _timed_steps(model, names, steps: int, choose, advance) -> dict[str, float]:
    """Seconds each variant spends in `steps` decode steps, after WARM_STEPS untimed ones (the
    first steps grow storage and capture graphs); the variants take turns, their order swapping
    every step. `choose(name)` picks the next input (untimed), `advance(name, input)` steps."""
    spent = {name: 0.0 for name in names}
    for step in range(-WARM_STEPS, steps):
        for name in (names if step % 2 == 0 else names[::-1]):
            chosen = choose(name)
            t = time.perf_counter()
            advance(name, chosen)
            sync(model.device)
            if step >= 0:
                spent[name] += time.perf_counter() - t
    return spent


def _batch_point(model, prompt, steps, rounds, chunk, batch, how) -> Point:
    """As `_point`, for `batch` sessions decoding together; then (untimed) one session leaves
    the batch and another joins it, and the graphs that captured are counted apart."""
    from hebrus.batching import Batch
    decode: dict[str, list[float]] = {"transactional": [], "in-place": []}
    captured = _captures(model)
    for r in range(rounds + 1):
        together = group = steppers = last = None       # the last round's sessions give back
        gc.collect()                                    # their slots before this round's take theirs
        first, inplace = model.session(decode="eager"), InPlaceSession(model)
        for begin in range(0, len(prompt), chunk):
            logits = first.feed(prompt[begin:begin + chunk])
            inplace.feed(prompt[begin:begin + chunk])
        together = Batch(copies(first, batch), decode=how)
        group = InPlaceBatch(copies(inplace, batch), graphs=together.decode == "graph")
        steppers = {"transactional": lambda tokens: torch.stack(together.feed(tokens)),
                    "in-place": group.feed}
        names = list(steppers)[::-1] if r % 2 else list(steppers)
        last = {name: logits.expand(batch, -1) for name in names}

        def advance(name, tokens):
            last[name] = steppers[name](tokens)

        spent = _timed_steps(model, names, steps, lambda name: torch.argmax(last[name], dim=-1).tolist(), advance)
        if r:
            for name in names:
                decode[name].append(spent[name] / max(steps, 1))
    timed = _captures(model) - captured
    members, joining = together.sessions, first.fork(copy_rows=True)
    before = _captures(model)
    for group in (members[1:], members[1:] + [joining], members[2:] + [joining], members):
        Batch(group, decode=how).feed(torch.argmax(last["transactional"][:len(group)], dim=-1).tolist())
    joined = _captures(model) - before
    return Point(len(prompt), None, {n: statistics.median(v) for n, v in decode.items()}, timed, joined,
                 ops_per_step(model, members, how))


class _Ops(TorchDispatchMode):
    """Counts the operations dispatched, views aside (they launch nothing)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(model, sessions, how: str) -> int:
    """What one more decode step of these sessions launches (untimed, after the timed ones), on
    the route `how` the point timed. On CUDA: the kernels (and device copies and fills) the
    profiler sees in the step, a graph's replay included. Elsewhere: the operations it
    dispatches, views aside, from the step plan where the model has one (the plan a graph would
    capture), else eagerly. The step before it, not counted, warms the route and takes any block
    the counted step would otherwise take."""
    from hebrus.batching import Batch
    if model.device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile
        together, ids = Batch(sessions, decode=how), [0] * len(sessions)
        together.feed(ids)
        sync(model.device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            together.feed(ids)
            sync(model.device)
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    try:
        route = decode_route(model, "planned")
    except InvalidInput:
        route = "eager"
    together, ids = Batch(sessions, decode=route), [0] * len(sessions)
    together.feed(ids)
    with _Ops() as ops:
        together.feed(ids)
    return ops.count


def transformers_point(folder: Path, prompt: list[int], steps: int, rounds: int, device: torch.device,
                       dtype: torch.dtype) -> dict:
    """transformers on the same checkpoint and device: seconds per prefill token (the prompt in
    one call) and per greedy decode step with its own cache, medians of `rounds` after a warm-up
    round. Returns {"error": ...} when transformers cannot run it."""
    try:
        import transformers
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device).eval()
    except Exception as exc:                                    # not installed, or not its format
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    ids = torch.tensor([prompt], device=device)
    # the cache's keyword: `past_key_values` until transformers 5.2x renamed it `cache`
    key = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    prefill, decode = [], []
    try:
        with torch.inference_mode():
            for r in range(rounds + 1):
                sync(device)
                t = time.perf_counter()
                out = hf(ids, use_cache=True)
                sync(device)
                spent = time.perf_counter() - t
                cache, token = out[key], out.logits[:, -1:].argmax(-1)
                t = time.perf_counter()
                for _ in range(steps):
                    out = hf(token, use_cache=True, **{key: cache})
                    cache, token = out[key], out.logits[:, -1:].argmax(-1)
                    sync(device)
                if r:
                    prefill.append(spent / len(prompt))
                    decode.append((time.perf_counter() - t) / steps)
    except torch.OutOfMemoryError as exc:          # transformers' own limit at this length: said, not fatal
        return {"error": f"out of memory at {len(prompt)} tokens ({str(exc).splitlines()[0][:160]})"}
    finally:
        out = cache = hf = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"version": transformers.__version__, "prefill_s_per_token": statistics.median(prefill),
            "decode_s_per_step": statistics.median(decode)}
