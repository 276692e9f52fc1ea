"""What the GPU profiling scripts share: their common options, the model and prompt they
profile (a random-weight shape written under --cache the first time, in bfloat16, fast mode),
and decode steps fed back to back."""
from __future__ import annotations

import argparse
import time
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


def fed_steps(model, prompt: list[int], steps: int, decode: str = "graph"):
    """A session of `model` (its `decode` route) after `prompt` and 8 untimed steps, and the ms
    a step of `steps` more took, fed back to back (one synchronization at the end)."""
    s = model.session(decode=decode)
    s.prefill(prompt, chunk_size=2048)
    for t in range(8):
        s.feed([t])
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for t in range(steps):
        s.feed([t])
    torch.cuda.synchronize()
    return s, (time.perf_counter() - t0) / steps * 1e3
