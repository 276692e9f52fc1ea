"""What the GPU profiling scripts share: their common options, and the model and prompt they
profile (a random-weight shape written under --cache the first time, in bfloat16, fast mode)."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import hebrus
from hebrus import bench


def options(model: str, steps: int, context: int = 1024, **more) -> argparse.Namespace:
    """--model (default `model`), --context (default `context`), --steps (default `steps`), --out, --cache, and
    `more`: option name -> (type, default)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=model)
    parser.add_argument("--context", type=int, default=context)
    for name, (kind, default) in more.items():
        parser.add_argument(f"--{name}", type=kind, default=default)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--out", default="/tmp")
    parser.add_argument("--cache", default="/tmp/shapes")
    parser.add_argument("--quantize", default=None, help="the large projections quantized as the model loads "
                        "(a format of `hebrus bench --quant`: int8, int4, int4-zp, fp8)")
    return parser.parse_args()


def model_and_prompt(args: argparse.Namespace):
    """The model on CUDA (bfloat16, fast mode; quantized if --quantize) and a random prompt of --context
    tokens."""
    name = args.model
    if name in bench.SHAPES:
        name = str(bench.random_checkpoint(name, Path(args.cache) / name))
    model = hebrus.load(name, device="cuda", dtype="bfloat16", mode="fast",
                        quantize=getattr(args, "quantize", None))
    return model, torch.randint(0, model.spec.vocab_size, (args.context,)).tolist()
