"""What restoring a saved session costs at long context: `Model.restore` of a session of the
`small` preset (its context limit raised, fast mode) fed `--context` tokens, median of
`--rounds`, with the file's size. The restored session owns its state: the time is a whole read
of the file, checked. `--against SRC`: the same restores by another checkout's code (its `src`
folder; the snapshot format is the same), the two timed in turns, each in a process of its own.
    python benchmarks/restore_cost.py [--context 32768] [--rounds 9] [--against SRC] [--out FILE]"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TIMER = """
import json, sys, time
import hebrus
from hebrus.models.hebrus import preset
context, path = int(sys.argv[1]), sys.argv[2]
config = preset("small").replace(max_context=context + 64)
model = hebrus.Model(config, config.init_parameters(), mode="fast")
model.restore(path)                                 # warm: the file in the page cache, the code loaded
started = time.perf_counter()
back = model.restore(path)
seconds = time.perf_counter() - started
assert back.frontier == context
print(json.dumps(seconds))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--against", default=None, help="another checkout's src folder, timed in turns")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parents[1] / "src")
    trees = {"this": here, **({"against": str(Path(args.against).resolve())} if args.against else {})}
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "session.hs"
        fed = _save(args.context, path)
        times = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, src in trees.items():
                times[name].append(_timed(src, args.context, path))
        size = path.stat().st_size
    result = {"context": args.context, "file_bytes": size, "rounds": args.rounds, "feed_seconds": round(fed, 1),
              **{f"restore_ms_{name}": round(statistics.median(t) * 1e3, 1) for name, t in times.items()}}
    if args.against:
        result["this_over_against"] = round(statistics.median(times["this"]) / statistics.median(times["against"]), 3)
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def _save(context: int, path: Path) -> float:
    import torch
    import hebrus
    from hebrus.models.hebrus import preset
    config = preset("small").replace(max_context=context + 64)
    model = hebrus.Model(config, config.init_parameters(), mode="fast")
    s = model.session()
    ids = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(0)).tolist()
    started = time.perf_counter()
    for begin in range(0, context, 2048):
        s.feed(ids[begin:begin + 2048])
    fed = time.perf_counter() - started
    s.save(path)
    return fed


def _timed(src: str, context: int, path: Path) -> float:
    env = {**os.environ, "PYTHONPATH": src}
    done = subprocess.run([sys.executable, "-c", TIMER, str(context), str(path)], capture_output=True, text=True,
                          env=env, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
