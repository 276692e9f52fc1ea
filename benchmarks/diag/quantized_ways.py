"""Does a model quantized in memory (`Model.quantized`, as `hebrus bench --quant` makes it) decode
as fast as one loaded quantized (`hebrus.load(..., quantize=)`, as `decode_profile.py
--quantize` does)? The 1.68B Qwen3.5 shape in bf16 on CUDA, graph route, steps fed back to back
after a 1K prompt: float, then quantized in memory, then loaded quantized, in one process.

    python benchmarks/diag/quantized_ways.py [--format int8] [--cache /tmp/shapes] [--steps 30]"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hebrus  # noqa: E402
from gpu_model import fed_steps  # noqa: E402
from hebrus import bench  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--format", default="int8")
    parser.add_argument("--cache", default="/tmp/shapes")
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    name = str(bench.random_checkpoint("qwen3.5-1.7b", Path(args.cache) / "qwen3.5-1.7b"))
    prompt = torch.randint(0, 1000, (1024,)).tolist()

    def steps(model, label: str) -> None:
        print(f"{label}: {fed_steps(model, prompt, args.steps)[1]:.3f} ms/step", flush=True)

    base = hebrus.load(name, device="cuda", dtype="bfloat16", mode="fast")
    steps(base, "float")
    steps(base.quantized(args.format), "quantized in memory (bench --quant)")
    del base
    torch.cuda.empty_cache()
    steps(hebrus.load(name, device="cuda", dtype="bfloat16", mode="fast", quantize=args.format), "loaded quantized")


if __name__ == "__main__":
    main()
