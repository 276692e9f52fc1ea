"""What restoring a saved session costs at long context: `Model.restore` of a session of the
`small` preset (its context limit raised, fast mode) fed `--context` tokens, median of
`--rounds`, with the file's size and the bytes per token. The restored session owns its state:
the time is a whole read of the file, checked.
    python benchmarks/restore_cost.py [--context 32768] [--rounds 9] [--out FILE]"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import hebrus
from hebrus.config import preset
from hebrus.weights.init import init_parameters

parser = argparse.ArgumentParser()
parser.add_argument("--context", type=int, default=32768)
parser.add_argument("--rounds", type=int, default=9)
parser.add_argument("--out", default=None)
args = parser.parse_args()
config = preset("small").replace(max_context=args.context + 64)
model = hebrus.Model(config, init_parameters(config), mode="fast")
s = model.session()
ids = torch.randint(0, 256, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
started = time.perf_counter()
for begin in range(0, args.context, 2048):
    s.feed(ids[begin:begin + 2048])
fed = time.perf_counter() - started
with tempfile.TemporaryDirectory() as folder:
    path = Path(folder) / "session.hs"
    s.save(path)
    size = path.stat().st_size
    times = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        back = model.restore(path)
        times.append(time.perf_counter() - t)
        assert back.frontier == args.context
        del back
result = {"context": args.context, "file_bytes": size, "bytes_per_token": round(size / args.context),
          "restore_ms_median": round(statistics.median(times) * 1e3, 1),
          "restore_ms_min": round(min(times) * 1e3, 1), "rounds": args.rounds,
          "feed_seconds": round(fed, 1), "threads": torch.get_num_threads()}
print(json.dumps(result))
if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
