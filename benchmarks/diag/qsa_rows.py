"""What a planned decode step of the long bench's QSA model costs as its context grows, and what
it copies: the `wide` shape (or `small`) at a context limit just past the prompt, a prompt of
CONTEXT random tokens in chunks of 2,048, then decode steps on the planned route (the route a
CUDA graph captures), timed one by one; beside the times, the rows the step's row logs gathered
whole (`Log.all`: index keys, K and V of each QSA layer, where a session's blocks are not
consecutive, as a planned step's lanes never are).

Until f39a5f4 a planned QSA step gathered every K and V row of each QSA layer to read the 64 its
indexer picked: on an H100, the wide shape's transactional step grew 1.0 ms from 1K to 128K
where the in-place baseline (one consecutive run of rows, a view) grew 0.3 ms
(`results/cuda-h100/0fd6d1c/bench-long-wide.md`). K and V are now read where they lie
(`state.pool.TabledRows`), only the index keys whole. On the CPU, one core, float32, the wide
shape at 16K: 217 MiB gathered a step before, 12.8 after, the step 45.1 ms (24.3 in another run)
before and 15.3 after; at 1K 13.9-14.8 ms either way (`results/qsa-rows-cpu.txt`).

    python benchmarks/diag/qsa_rows.py [--shape wide|small] [--contexts 1024,16384] [--steps 10] [--device cpu]"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from hebrus.bench.long import SHAPES
from hebrus.bench.limits import sync
from hebrus.models.hebrus import preset
from hebrus.runtime import Model
from hebrus.state import pool


def measure(shape: str, context: int, steps: int, device: torch.device) -> str:
    config = preset("small").replace(max_context=context + 1024, **SHAPES[shape])
    model = Model(config, config.init_parameters(), device=device, dtype=torch.float32, mode="fast")
    session = model.session(decode="planned")
    ids = torch.randint(0, config.vocab_size, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    for begin in range(0, context, 2048):
        logits = session.feed(ids[begin:begin + 2048])
    gathered, whole = [], pool.Log.all

    def counted(log):
        rows = whole(log)
        if log._first is None:
            gathered.append(rows.numel() * rows.element_size())
        return rows
    times = []
    pool.Log.all = counted
    try:
        for _ in range(steps + 2):
            gathered.clear()
            sync(device)
            start = time.perf_counter()
            logits = session.feed([int(torch.argmax(logits))])
            sync(device)
            times.append(time.perf_counter() - start)
    finally:
        pool.Log.all = whole
    return (f"{shape} at {context}: planned step median {statistics.median(times[2:]) * 1e3:.2f} ms; "
            f"gathered whole a step: {len(gathered)} logs, {sum(gathered) / 2**20:.1f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="wide", choices=sorted(SHAPES))
    parser.add_argument("--contexts", default="1024,16384")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    for context in (int(c) for c in args.contexts.split(",")):
        print(measure(args.shape, context, args.steps, torch.device(args.device)), flush=True)


if __name__ == "__main__":
    main()
