"""Where a constrained step's time goes beyond a free one's: the loop of `hebrus bench
--constrained` (`hebrus.bench.constrained`) taken apart, on any machine.

Each step of the constrained loop is cut into its parts, each timed on the host where it is made:
`masks` (the values' masks, made ahead by the step before), `apply` (the masks moved to the
logits' device and applied; with --sync, until the device has applied them), `argmax` (the
tokens to the host: on a GPU, the wait for the apply and the step's logits), `ahead` (handing the
values after the tokens to the worker thread), `feed` (the step itself) and `join` (waiting for
the worker after the step). The free loop's `argmax` and `feed` are timed the same way beside it,
rounds taking turns; with --later a third loop takes turns with them, with no worker: the values
after a step's tokens and their masks made after the step in the loop's own thread (`after`),
which tells whether the worker's overlap with the step costs the step more than its work. Then
the worker's work alone (the values after a step's tokens and their masks, nothing else running), and, on CUDA, one constrained step's kernels under the profiler
beside a free one's. Means over the timed steps of every round, in µs a step:

    python benchmarks/constrained_parts.py [--model qwen3.5-1.7b] [--cache DIR] [--batch 1,64] \
        [--steps 32] [--rounds 3] [--sync] [--later] [--out DIR]
"""
from __future__ import annotations

import argparse
from contextlib import nullcontext
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

import hebrus
from hebrus import bench
from hebrus.batching import Batch
from hebrus.bench.constrained import workload
from hebrus.bench.limits import sync
from hebrus.sampling import constrained
from hebrus.state.constraint import ahead, masks

PARTS = ("masks", "apply", "argmax", "ahead", "feed", "join", "after")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3.5-1.7b", help="a preset or checkpoint (default: %(default)s)")
    parser.add_argument("--cache", default="/tmp/shapes",
                        help="the folder a random shape's weights are written to once (default: %(default)s)")
    parser.add_argument("--device", default=None, help="default: cuda where there is one, else cpu")
    parser.add_argument("--batch", default="1,64", help="comma-separated session counts (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sync", action="store_true", help="wait for the device after applying the masks")
    parser.add_argument("--later", action="store_true",
                        help="a third loop taking turns with the two: no worker, the values after a step's tokens "
                             "and their masks made after the step in this thread (part `after`)")
    parser.add_argument("--out", default=None, help="also write the report here (constrained-parts.txt)")
    args = parser.parse_args()
    if args.steps < 2 or args.rounds < 1:
        parser.error("--steps takes 2 or more, --rounds 1 or more")
    try:
        batches = tuple(int(b) for b in args.batch.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        parser.error("--batch takes positive session counts, e.g. 1,64")
    model = _load(args.model, args.device, args.cache)
    start, prompt = workload(model)
    lines = [f"constrained step's parts: {args.model} on {model.device}, {args.steps} steps, {args.rounds} rounds"
             f"{', synced after the apply' if args.sync else ''}; µs a step, mean over the timed steps"]
    print(lines[0], flush=True)
    for width in batches:
        _run(model, prompt, width, args.steps, start, args.sync)          # warm-up: graphs, compiled ops
        _run(model, prompt, width, args.steps, None, args.sync)
        loops = [("free", None, False), ("constrained", start, False)] + [("later", start, True)] * args.later
        spent = {name: defaultdict(list) for name, _, _ in loops}
        for _ in range(args.rounds):
            for name, limit, later in loops:
                for part, seconds in _run(model, prompt, width, args.steps, limit, args.sync, later).items():
                    spent[name][part].append(seconds)
        lines.append(f"\n## {width} session{'s' if width > 1 else ''}")
        for name, parts in spent.items():
            each = {p: statistics.mean(parts[p]) * 1e6 for p in PARTS if p in parts}
            lines.append(f"{name:12} {sum(each.values()):8.0f} µs: " +
                         ", ".join(f"{p} {v:.0f}" for p, v in each.items()))
        lines.append(f"the worker's work alone: {_ahead_alone(model, prompt, width, start) * 1e6:.0f} µs a step")
        print("\n".join(lines[-3 - len(loops):]), flush=True)
        if model.device.type == "cuda":
            for name, limit in (("free", None), ("constrained", start)):
                lines.append(f"\n### one {name} step's kernels, {width} sessions\n" +
                             _kernels(model, prompt, width, limit))
                print(lines[-1], flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "constrained-parts.txt").write_text("\n".join(lines) + "\n")


def _load(name: str, device: str | None, cache: str):
    """The model in fast mode: bfloat16 on CUDA, float32 on the CPU; a random shape's weights
    written under `cache` the first time."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if name in bench.SHAPES:
        name = str(bench.random_checkpoint(name, Path(cache) / name))
    return hebrus.load(name, device=device, dtype="bfloat16" if device.startswith("cuda") else "float32", mode="fast")


def _begun(model, prompt, width, limit):
    sessions = [model.session() for _ in range(width)]
    logits = torch.stack([s.feed(prompt) for s in sessions])
    if limit is not None:
        for s in sessions:
            s.constrain(limit)
    return sessions, Batch(sessions), logits


def _run(model, prompt: list[int], width: int, steps: int, limit, synced: bool, later: bool = False) -> dict[str, float]:
    """Seconds a step spent in each part, over `steps` steps of the bench's loop (the first
    step untimed: its masks were not made ahead). `later`: no worker; the masks the next step
    needs are made after this one, here."""
    sessions, batch, logits = _begun(model, prompt, width, limit)
    spent: dict[str, float] = defaultdict(float)
    sync(model.device)
    for step in range(steps):
        clock = time.perf_counter()
        marks = []
        if limit is not None:
            for s in sessions:
                if s.constraint.finished:
                    s.constrain(limit)
            made_masks = masks([s.constraint for s in sessions])
            marks.append(("masks", time.perf_counter()))
            logits = constrained(logits, made_masks)
            if synced:
                sync(model.device)
            marks.append(("apply", time.perf_counter()))
        tokens = logits.argmax(-1).tolist()
        marks.append(("argmax", time.perf_counter()))
        made = ahead([(s.constraint, t) for s, t in zip(sessions, tokens)]) \
            if limit is not None and not later else None
        if made is not None:
            marks.append(("ahead", time.perf_counter()))
        results = batch.feed(tokens)
        marks.append(("feed", time.perf_counter()))
        if made is not None:
            made.join()
            marks.append(("join", time.perf_counter()))
        elif limit is not None:
            masks([s.constraint for s in sessions])
            marks.append(("after", time.perf_counter()))
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        logits = torch.stack(results)
        if step:
            for part, at in marks:
                spent[part] += at - clock
                clock = at
    sync(model.device)
    return {part: seconds / (steps - 1) for part, seconds in spent.items()}


def _ahead_alone(model, prompt, width, limit, steps: int = 16) -> float:
    """Seconds a step the worker's work takes with nothing else running: the values after each
    session's greedy token and their masks, handed over and joined at once."""
    sessions, batch, logits = _begun(model, prompt, width, limit)
    values = [s.constraint for s in sessions]
    total = 0.0
    for _ in range(steps):
        tokens = constrained(logits, masks(values)).argmax(-1).tolist()
        clock = time.perf_counter()
        made = ahead(list(zip(values, tokens)))
        made.join()
        total += time.perf_counter() - clock
        values = [v.after([t]) for v, t in zip(values, tokens)]
        values = [limit if v.finished else v for v in values]
    return total / steps


def _kernels(model, prompt, width, limit) -> str:
    """One step of the loop (after a warm one) under the profiler: its device kernels and copies
    by total time."""
    from torch.profiler import ProfilerActivity, profile
    sessions, batch, logits = _begun(model, prompt, width, limit)
    for timed in (False, True):
        sync(model.device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if timed else nullcontext() as prof:
            if limit is not None:
                logits = constrained(logits, masks([s.constraint for s in sessions]))
            tokens = logits.argmax(-1).tolist()
            made = ahead([(s.constraint, t) for s, t in zip(sessions, tokens)]) if limit is not None else None
            results = batch.feed(tokens)
            if made is not None:
                made.join()
            logits = torch.stack(results)
            sync(model.device)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)


if __name__ == "__main__":
    main()
