"""Where the host's 136 µs (one session) and 361 µs (64) of applying constraint masks go on a GPU
(`sampling.constrained`, timed as `apply` by benchmarks/constrained_parts.py on an H100 at
7608735, results/cuda-h100/7608735/constrained-parts.txt). Its parts taken one at a time on the
1.68B shape's vocabulary (151,936 tokens, 4,748 mask words a row), µs of host time a call, mean
over 2,000 calls after 200 untimed, the device synchronized before each timed loop and after
it (the loop's time includes the device's only where the host waits for it):

- `pinned`: `torch.empty` of the [B, W] words in page-locked memory
- `stack`: the rows (views of one host tensor, as llguidance's masks are) stacked into it
- `copy`: its copy to the device, non-blocking
- `kernel`: `ops.cuda.masks.masked` on device words (the Triton launch)
- `twin`: `sampling.masked` (three torch kernels) on device words
- `whole`: `sampling.constrained` as a step calls it
- `whole+sync`: the same, synchronized each call (host and device)

    python benchmarks/diag/mask_apply.py [--batch 1,64]"""
from __future__ import annotations

import argparse
import time

import torch

from hebrus import sampling
from hebrus.ops.cuda import masks as cuda_masks

VOCAB = 151_936


def timed(what, calls: int = 2000, warm: int = 200) -> float:
    for _ in range(warm):
        what()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(calls):
        what()
    torch.cuda.synchronize()
    return (time.perf_counter() - began) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", default="1,64")
    args = parser.parse_args()
    words = (VOCAB + 31) // 32
    print(f"{torch.cuda.get_device_name()}: µs of host time a call, vocabulary {VOCAB} ({words} words a row)")
    for batch in [int(b) for b in args.batch.split(",")]:
        host = torch.randint(-2**31, 2**31 - 1, (batch, words), dtype=torch.int32)
        rows = list(host)
        logits = torch.randn(batch, VOCAB, device="cuda", dtype=torch.bfloat16)
        pinned = torch.empty((batch, words), dtype=torch.int32, pin_memory=True)
        device_words = host.cuda()
        assert torch.equal(cuda_masks.masked(logits, device_words), sampling.masked(logits, device_words))

        def whole_sync():
            sampling.constrained(logits, rows)
            torch.cuda.synchronize()

        parts = {
            "pinned": lambda: torch.empty((batch, words), dtype=torch.int32, pin_memory=True),
            "stack": lambda: torch.stack(rows, out=pinned),
            "copy": lambda: pinned.to("cuda", non_blocking=True),
            "kernel": lambda: cuda_masks.masked(logits, device_words),
            "twin": lambda: sampling.masked(logits, device_words),
            "whole": lambda: sampling.constrained(logits, rows),
            "whole+sync": whole_sync,
        }
        print(f"batch {batch}: " + ", ".join(f"{name} {timed(call):.1f}" for name, call in parts.items()), flush=True)


if __name__ == "__main__":
    main()
