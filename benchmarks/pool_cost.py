"""What the state layout costs on the CPU: `shakespeare` in fast mode, prefill of a `--prompt`
token prompt in chunks of 64 (tokens/s), one-token decode steps after it (ms a step), and
`feed_many` of 8 sessions one token each (ms a step), medians of `--rounds`. `--against SRC`:
the same by another checkout's code (its `src` folder), the two timed in turns, each round in a
process of its own, so the ratios are side by side.
    python benchmarks/pool_cost.py [--prompt 512] [--steps 64] [--rounds 5] [--against SRC] [--out FILE]"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

TIMER = """
import json, sys, time
import torch
import hebrus
prompt_length, steps = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
model = hebrus.load("shakespeare", mode="fast")
vocab = model.spec.vocab_size
prompt = torch.randint(0, vocab, (prompt_length,)).tolist()
tokens = torch.randint(0, vocab, (steps, 8)).tolist()
warm = model.session(decode="eager")
warm.prefill(prompt[:128])
for t in tokens[:8]:
    warm.feed([t[0]])
hebrus.feed_many([model.session(decode="eager") for _ in range(8)], tokens[0])

s = model.session(decode="eager")
started = time.perf_counter()
s.prefill(prompt, chunk_size=64)
prefill = time.perf_counter() - started
started = time.perf_counter()
for t in tokens:
    s.feed([t[0]])
decode = (time.perf_counter() - started) / steps
sessions = [model.session(decode="eager") for _ in range(8)]
for i, one in enumerate(sessions):
    one.prefill(prompt[:64 + 8 * i])
started = time.perf_counter()
for t in tokens:
    hebrus.feed_many(sessions, t)
many = (time.perf_counter() - started) / steps
print(json.dumps({"prefill_tok_s": prompt_length / prefill, "decode_ms": decode * 1e3, "feed_many_8_ms": many * 1e3}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", default=None, help="another checkout's src folder, timed in turns")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parents[1] / "src")
    trees = {"this": here, **({"against": str(Path(args.against).resolve())} if args.against else {})}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    for r in range(args.rounds):
        for name in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
            runs[name].append(_timed(trees[name], args.prompt, args.steps))
    result = {"prompt": args.prompt, "steps": args.steps, "rounds": args.rounds}
    for name, got in runs.items():
        for key in got[0]:
            result[f"{key}_{name}"] = round(statistics.median(g[key] for g in got), 2)
    if args.against:
        for key in runs["this"][0]:
            result[f"{key}_this_over_against"] = round(result[f"{key}_this"] / result[f"{key}_against"], 3)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def _timed(src: str, prompt: int, steps: int) -> dict:
    done = subprocess.run([sys.executable, "-c", TIMER, str(prompt), str(steps)], capture_output=True, text=True,
                          env={"PYTHONPATH": src, "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
