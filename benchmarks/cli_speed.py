"""The command line's generation speed against the bench's decode step, on the same machine in
one run: `hebrus generate "ROMEO." --max-new-tokens 256` (its closing line's tokens/s) and
`hebrus bench --model shakespeare --contexts 256` (decode tokens/s), idle and with one core kept
busy by a spinning process (started a minute before, so that the load average shows it), with
the default threads, one thread for all (OMP_NUM_THREADS=1), and, for `generate`, its own
choice (`auto`: no thread setting at all). `--against SRC` runs another checkout's command line
too (its `src` folder). Medians of `--rounds`, the runs taking turns.
    python benchmarks/cli_speed.py [--rounds 3] [--against SRC] [--out FILE]"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = str(Path(__file__).resolve().parents[1] / "src")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--against", default=None, help="another checkout's src folder")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    trees = {"this": HERE, **({"against": str(Path(args.against).resolve())} if args.against else {})}
    results: dict[str, list[float]] = {}
    for busy in (False, True):
        spinner = _spin() if busy else None
        if busy:
            time.sleep(60)
        try:
            for _ in range(args.rounds):
                load = "busy" if busy else "idle"
                for threads in ("default", "1", "auto"):
                    for name, src in trees.items():
                        key = f"generate {name}, {load}, threads {threads}"
                        results.setdefault(key, []).append(_generate(src, threads))
                    if threads != "auto":
                        key = f"bench decode step, {load}, threads {threads}"
                        results.setdefault(key, []).append(_bench(HERE, threads))
        finally:
            if spinner is not None:
                spinner.kill()
                spinner.wait()
    out = {key: round(statistics.median(values), 1) for key, values in results.items()}
    out["cores"] = len(os.sched_getaffinity(0))
    print(json.dumps(out, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


def _spin() -> subprocess.Popen:
    """A process that keeps one core busy."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _env(src: str, threads: str) -> dict:
    """`threads`: "1" (OMP_NUM_THREADS=1), "default" (torch's: HEBRUS_THREADS set to it, so this
    command line does not lower it), "auto" (nothing set)."""
    env = {**os.environ, "PYTHONPATH": src}
    env.pop("HEBRUS_THREADS", None)
    env.pop("OMP_NUM_THREADS", None)
    if threads == "1":
        env["OMP_NUM_THREADS"] = "1"
    elif threads == "default":
        env["HEBRUS_THREADS"] = str(len(os.sched_getaffinity(0)))
    return env


def _generate(src: str, threads: str) -> float:
    argv = [sys.executable, "-m", "hebrus", "generate", "ROMEO.", "--max-new-tokens", "256", "--seed", "0"]
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(src, threads), check=True)
    return float(re.search(r"generation: 256 tokens, ([\d.]+) tokens/s", done.stderr).group(1))


def _bench(src: str, threads: str) -> float:
    with tempfile.TemporaryDirectory() as folder:
        report = Path(folder) / "bench.json"
        argv = [sys.executable, "-m", "hebrus", "bench", "--model", "shakespeare", "--contexts", "256",
                "--decode-steps", "64", "--json", str(report)]
        subprocess.run(argv, capture_output=True, text=True, env=_env(src, threads), check=True)
        return json.loads(report.read_text())["points"][0]["decode_tokens_per_s"]


if __name__ == "__main__":
    main()
