"""What a fork costs at short and long context: `Session.fork` at each context (median of many),
and the first chunk after it (which copies the one shared block it writes into) beside the
chunk after that. The previous fork is let go before each is timed. The tiny preset with its context limit raised, fast mode.
    python benchmarks/fork_cost.py [--contexts 1024,32768] [--device cpu] [--out FILE]"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import hebrus
from hebrus.bench.limits import sync
from hebrus.models.hebrus import preset

parser = argparse.ArgumentParser()
parser.add_argument("--contexts", default="1024,32768")
parser.add_argument("--device", default="cpu")
parser.add_argument("--out", default=None)
args = parser.parse_args()
contexts = [int(c) for c in args.contexts.split(",")]
device = torch.device(args.device)
config = preset("tiny").replace(max_context=max(contexts) + 64)
model = hebrus.Model(config, config.init_parameters(), device=device, mode="fast")
rows = []
for context in contexts:
    s = model.session()
    ids = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    for begin in range(0, context, 2048):
        s.feed(ids[begin:begin + 2048])
    forks, firsts, plain = [], [], []
    fork = None
    for _ in range(50):
        del fork                                # the last fork's slot and blocks go back, untimed
        sync(device)
        t = time.perf_counter()
        fork = s.fork()
        sync(device)
        forks.append(time.perf_counter() - t)
        t = time.perf_counter()
        fork.feed([1])
        sync(device)
        firsts.append(time.perf_counter() - t)
        t = time.perf_counter()
        fork.feed([2])
        sync(device)
        plain.append(time.perf_counter() - t)
    rows.append({"context": context, "fork_ms": statistics.median(forks) * 1e3,
                 "first_step_after_fork_ms": statistics.median(firsts) * 1e3,
                 "next_step_ms": statistics.median(plain) * 1e3})
    print(rows[-1], flush=True)
rows.append({"fork_ratio_longest_over_shortest": rows[-1]["fork_ms"] / rows[0]["fork_ms"],
             "device": str(device), "model": "tiny, max_context raised", "torch": torch.__version__})
if args.out:
    open(args.out, "w").write(json.dumps(rows, indent=2) + "\n")
print(rows[-1])
