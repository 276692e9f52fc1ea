"""The host's share of a replayed step, on any machine: what the runner, the transactions and
publication cost in Python when the device work costs nothing.

A CUDA graph's replay launches the step's device work in one call; what is left on the host is
staging the inputs, beginning a transaction per session, reading the checks back, publishing each
session and reading the logits. Here the runner's graph is a no-op that stands for the replay
(the plan runs once, as a capture would run it, so the checks it folds and the records it keeps
are the real ones) and completion records are not kept. Reported: milliseconds of host work per
step and microseconds per session, through `Batch.feed` at each batch and `Session.feed` alone,
medians over rounds, at one table width (no step changes its graph's key); beside them the time
the published logits' gather took, which on a CPU is device work (a copy of a row of the
vocabulary per session) that a GPU's host only launches.

With `--parts`, the time spent in each part of a `Batch.feed` step is printed too (means over
the timed steps, µs a step; each part's calls timed where they are made):

    python benchmarks/host_cost.py [--model tiny] [--batch 1,8,64] [--prompt 4] [--steps 50] [--rounds 5] [--parts] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hebrus
from hebrus.engine import batch as batch_step, graphs
from hebrus.state import status


class _NoReplay:
    def replay(self) -> None:
        pass


def _capture_nothing(plan, pool=None):
    plan()                                  # what a capture records, run once
    return _NoReplay(), None


_gathers = [0.0]                            # seconds spent gathering published logits


def _timed_gather(gather):
    """The logits gather timed apart: on a CPU it is device work (a copy of N rows of the
    vocabulary), which a GPU's host only launches."""
    def timed(*args):
        t = time.perf_counter()
        out = gather(*args)
        _gathers[0] += time.perf_counter() - t
        return out
    return timed


# (module, attribute, name) of the parts `--parts` times: the whole of them is not the step (the
# API's own calls, the replay and the locks are the rest)
PARTS = (("hebrus.batching", "_chunks", "checking the ids"),
         ("hebrus.engine.graphs:Steps", "key", "the graph's key"),
         ("hebrus.state.txn:Transaction", "__init__", "beginning the transactions"),
         ("hebrus.engine.graphs:Steps", "_stage", "staging the inputs"),
         ("hebrus.state.status:DeviceChecks", "read", "reading the checks"),
         ("hebrus.state.txn:Transaction", "failures", "each session's failure (with reading)"),
         ("hebrus.state.txn:Transaction", "publish", "publishing (every session)"),
         ("hebrus.engine.batch", "_private_logits", "gathering the logits"),
         ("hebrus.state.txn:Transaction", "abort", "finishing the rest"))


class _Parts:
    """Timers around PARTS, counting only while `on`."""

    def __init__(self):
        import importlib
        self.on, self.spent = False, {name: 0.0 for _, _, name in PARTS}
        for where, attribute, name in PARTS:
            module, _, owner = where.partition(":")
            target = importlib.import_module(module)
            target = getattr(target, owner) if owner else target
            setattr(target, attribute, self._timed(getattr(target, attribute), name))

    def _timed(self, f, name):
        def timed(*args, **kwargs):
            if not self.on:
                return f(*args, **kwargs)
            start = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - start
        return timed


def _rounds(feed, steps: int, rounds: int) -> tuple[float, float]:
    """Medians over rounds of (seconds a step, of which the logits gather)."""
    spent, gathered = [], []
    for _ in range(rounds):
        _gathers[0] = 0.0
        t = time.perf_counter()
        for _ in range(steps):
            feed()
        spent.append((time.perf_counter() - t) / steps)
        gathered.append(_gathers[0] / steps)
    return statistics.median(spent), statistics.median(gathered)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a preset or checkpoint (fast mode; default tiny)")
    parser.add_argument("--batch", default="1,8,64", help="comma-separated batch sizes (default 1,8,64)")
    parser.add_argument("--prompt", type=int, default=4,
                        help="tokens each session holds before the steps (its table's width; default 4)")
    parser.add_argument("--steps", type=int, default=10, help="steps per round (default 10)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the median is reported (default 5)")
    parser.add_argument("--parts", action="store_true", help="also time the parts of a Batch.feed step")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    graphs.capture = _capture_nothing
    torch.cuda.graph_pool_handle = lambda: None
    status.Completion.record_replay = lambda self: None
    batch_step._private_logits = _timed_gather(batch_step._private_logits)
    model = hebrus.load(args.model, device="cpu").with_mode("fast")
    parts = _Parts() if args.parts else None
    rows, block = [], model.pool.block_rows
    first, last = args.prompt + 1, args.prompt + 5 + 2 * args.rounds * args.steps      # rows a step needs
    if graphs.width_for(-(-first // block)) != graphs.width_for(-(-last // block)):
        parser.error("the steps would cross a table width (a new graph key): fewer steps or rounds, "
                     "or another --prompt, please")
    for batch in [int(b) for b in args.batch.split(",")]:
        sessions = [model.session(decode="planned") for _ in range(batch)]
        for s in sessions:
            s.feed([1 + i % 50 for i in range(args.prompt)])
        runner = sessions[0]._steps
        runner.capture = True
        together = hebrus.Batch(sessions, decode="planned")
        ids = [5] * batch
        for _ in range(5):
            together.feed(ids)
        replays = runner.replays
        if parts:
            parts.spent, parts.on = dict.fromkeys(parts.spent, 0.0), True
        per_step, gather = _rounds(lambda: together.feed(ids), args.steps, args.rounds)
        if parts:
            parts.on = False
        assert runner.replays - replays == args.steps * args.rounds, "a step left the replayed graph"
        row = {"route": "Batch.feed", "batch": batch, "host_ms_per_step": per_step * 1e3,
               "host_us_per_session": per_step / batch * 1e6, "logits_gather_ms_per_step": gather * 1e3}
        if parts:
            row["parts_us_per_step"] = {name: spent / (args.steps * args.rounds) * 1e6
                                        for name, spent in parts.spent.items()}
        if batch == 1:
            alone = sessions[0]
            one, _ = _rounds(lambda: alone.feed([5]), args.steps, args.rounds)
            rows.append({"route": "Session.feed", "batch": 1, "host_ms_per_step": one * 1e3,
                         "host_us_per_session": one * 1e6, "logits_gather_ms_per_step": 0.0})
        rows.append(row)
        together = sessions = None               # given back before the next batch size
    print(f"host work of a replayed step: {args.model}, {torch.get_num_threads()} threads, {args.prompt}-token "
          f"sessions, medians of {args.rounds} rounds of {args.steps} steps")
    print("| route | batch | host ms / step | host µs / session | of which the logits gather, ms |\n"
          "| --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['route']} | {r['batch']} | {r['host_ms_per_step']:.3f} | {r['host_us_per_session']:.1f} | "
              f"{r['logits_gather_ms_per_step']:.3f} |")
    for r in rows:
        if "parts_us_per_step" in r:
            print(f"\nbatch {r['batch']}, µs a step (means; reading the checks is part of each session's failure):")
            for name, us in r["parts_us_per_step"].items():
                print(f"  {name:40s} {us:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rounds": args.rounds, "steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
