"""The project's Triton kernels launched as a chain (programmatic dependent launch), with
HEBRUS_PDL=1 on devices of compute capability 9 or more, wherever they run (a decode step's
graph above all, a prompt's chunk too): a kernel may start while the one before it finishes,
reads what no kernel writes while the model runs first (the products' first tile of weights:
`gemv` takes a weight, never a value a kernel made), then waits for the one before it
(`after_the_last`) before it reads anything else or writes anything. Every program waits, so a
kernel ends only after the one before it has: the order of writes stays the stream's. The
kernels that take part: the one-row products and SwiGLU's middle (`gemv`), the rotary kernel,
the GDN and attention lanes, the Sinkhorn rounds, the quantized products' vector kernels
(`ops.cuda.quant`; not its matrix kernel, nor a routed launch, which reads its expert first).
Fused ops are compiled to take part too where this torch's compiler can (inductor's
`enable_pdl`): inductor makes a kernel wait where it reads what the kernel before it in its own
graph wrote, and the first kernel of each compiled op always waits. Off by
default: on an H100 (benchmarks/results/cuda-h100/2d511fb) a one-session step of the 1.68B
Qwen3.5 shape took 1.875 ms chained against 1.97 plain at 1K, 2.055 against 2.125 at 8K, but
prefill was 2-10% slower and 64 sessions' step looked slower (4.60 ms against 4.15, one sample).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

WANTED = os.environ.get("HEBRUS_PDL") == "1"


def chained(device: torch.device) -> bool:
    """Whether kernels on `device` launch as a chain (HEBRUS_PDL=1 and a device that can)."""
    return WANTED and device.type == "cuda" and _capable(
        device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def after_the_last(CHAINED: tl.constexpr):
    """In a chained launch: let the next kernel launch, then wait until the one before this has
    finished and its writes are seen. Nothing otherwise."""
    if CHAINED:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
