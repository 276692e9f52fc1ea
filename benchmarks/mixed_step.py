"""What a ragged step costs against the same work as separate passes: `--prompts` sessions each
feeding a prompt of `--prompt` tokens beside `--decoders` sessions each decoding one token (at a
context of `--context`), as one `feed_many` step, against the prompts fed one by one and the
decoders stepped together in one `feed_many`. Eager, fast mode; medians of `--rounds`, each
round on fresh sessions forked from one prefilled session (so no round pays a prefill).
    python benchmarks/mixed_step.py [--model qwen3.5-1.7b] [--device cuda] [--prompts 8]
        [--prompt 512] [--decoders 56] [--context 1024] [--rounds 5] [--cache DIR] [--out FILE]"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import hebrus
from hebrus.bench.limits import sync
from hebrus.bench.shapes import SHAPES, random_checkpoint

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--model", default="qwen3.5-1.7b", help=f"a random-weight shape ({', '.join(SHAPES)}) or a model name")
parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
parser.add_argument("--dtype", default=None)
parser.add_argument("--prompts", type=int, default=8)
parser.add_argument("--prompt", type=int, default=512)
parser.add_argument("--decoders", type=int, default=56)
parser.add_argument("--context", type=int, default=1024)
parser.add_argument("--rounds", type=int, default=5)
parser.add_argument("--cache", default=str(Path.home() / ".cache/hebrus/shapes"))
parser.add_argument("--out", default=None)
args = parser.parse_args()

source = (random_checkpoint(args.model, Path(args.cache) / args.model) if args.model in SHAPES else args.model)
model = hebrus.load(source, device=args.device, mode="fast", **({"dtype": args.dtype} if args.dtype else {}))
device, vocab = model.device, model.spec.vocab_size
gen = torch.Generator().manual_seed(0)
ids = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()     # noqa: E731
base = model.session(decode="eager")
base.prefill(ids(args.context), chunk_size=512)
prompts = [ids(args.prompt) for _ in range(args.prompts)]


def sessions():
    fresh = [model.session(decode="eager") for _ in range(args.prompts)]
    return fresh, [base.fork() for _ in range(args.decoders)]


def timed(do) -> float:
    sync(device)
    started = time.perf_counter()
    do()
    sync(device)
    return time.perf_counter() - started


def mixed(fresh, decoders) -> None:
    got = hebrus.feed_many(fresh + decoders, prompts + [[t] for t in ids(args.decoders)])
    assert all(isinstance(g, torch.Tensor) for g in got), got


def separate(fresh, decoders) -> None:
    for s, p in zip(fresh, prompts):
        s.feed(p)
    got = hebrus.feed_many(decoders, ids(args.decoders))
    assert all(isinstance(g, torch.Tensor) for g in got), got


times = {"mixed": [], "separate": []}
for r in range(args.rounds + 1):                 # the first round warms up, untimed
    for name in (["mixed", "separate"] if r % 2 else ["separate", "mixed"]):
        made = sessions()
        spent = timed(lambda: (mixed if name == "mixed" else separate)(*made))
        made = None                              # the sessions go before the next round
        if r:
            times[name].append(spent)
result = {"model": args.model, "device": str(device), "prompts": args.prompts, "prompt": args.prompt,
          "decoders": args.decoders, "context": args.context, "rounds": args.rounds,
          "mixed_ms": round(statistics.median(times["mixed"]) * 1e3, 2),
          "separate_ms": round(statistics.median(times["separate"]) * 1e3, 2)}
result["mixed_over_separate"] = round(result["mixed_ms"] / result["separate_ms"], 3)
print(json.dumps(result, indent=1))
if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
