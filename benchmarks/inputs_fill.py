"""The host's cost of filling a planned step's inputs (ids, positions, parities, slots and each
lane's block table) for 64 lanes, on any machine: what `Inputs.fill` costs a decode step of
sessions whose tables hold about `width` blocks.

    python benchmarks/inputs_fill.py [--lanes 64] [--width 64,128] [--fills 200]
"""
from __future__ import annotations

import argparse
import time

import hebrus
from hebrus.engine.graphs import Inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lanes", type=int, default=64, help="lanes of the step (default 64)")
    parser.add_argument("--width", default="64,128", help="comma-separated table widths in blocks (default 64,128)")
    parser.add_argument("--fills", type=int, default=200, help="fills timed (default 200)")
    args = parser.parse_args()
    pool = hebrus.load("tiny", device="cpu").with_mode("fast").pool
    for width in (int(w) for w in args.width.split(",")):
        inputs = Inputs(pool, args.lanes, 1, width, False)
        lanes = [(1000 + i, i % 2, i, tuple(range(i * width, i * width + width - 5))) for i in range(args.lanes)]
        ids = list(range(args.lanes))
        for _ in range(3):
            inputs.fill(lanes, ids)
        start = time.perf_counter()
        for _ in range(args.fills):
            inputs.fill(lanes, ids)
        print(f"{args.lanes} lanes, tables of {width - 5} blocks in a width of {width}: "
              f"{(time.perf_counter() - start) / args.fills * 1e6:.1f} us a fill")


if __name__ == "__main__":
    main()
