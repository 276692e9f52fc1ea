"""One pass of many sessions' prompt chunks (`hebrus.feed_many`), timed on the host: what a
server's turn of new prompts costs. 64 sessions of 8 to 12 tokens each, fast mode, median of
15 passes after one untimed:

    python benchmarks/diag/ragged_pass.py [--model .gpu/qwen-tiny] [--sessions 64]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import hebrus


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="a preset or checkpoint folder (default: %(default)s)")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--passes", type=int, default=15)
    args = parser.parse_args()
    model = hebrus.load(args.model, mode="fast")
    gen = torch.Generator().manual_seed(0)

    def once() -> float:
        sessions = [model.session() for _ in range(args.sessions)]
        chunks = [torch.randint(0, model.spec.vocab_size, (8 + i % 5,), generator=gen).tolist()
                  for i in range(args.sessions)]
        began = time.perf_counter()
        hebrus.feed_many(sessions, chunks)
        return time.perf_counter() - began

    once()
    times = [once() for _ in range(args.passes)]
    print(f"{args.sessions} prompts in one pass: median {statistics.median(times) * 1e3:.1f} ms, "
          f"least {min(times) * 1e3:.1f} ms ({args.model}, {model.device})")


if __name__ == "__main__":
    main()
