"""Why is a quantized decode step longer in `hebrus bench --quant` than fed back to back? On an H100
at 6621730 the bench's int8 step (each step timed alone: feed, then wait for the device) took 2.28
ms against float's 2.02, while the same step fed back to back took 1.80 ms against float's 2.09
(results/cuda-h100/6621730/). Here, for the 1.68B Qwen3.5 shape in bf16 on CUDA (graph route,
after a 1K prompt) in float and each format, one process: each step timed alone as the bench
times it, split into the host's part (until `feed` returns) and the wait for the device after it,
with the device's own time for the step between two events; then steps fed back to back; then
the bench's own procedure (`bench.timing._point`: the prompt in the model's prefill chunks, the
transactional session's steps taking turns with an in-place session's), and that procedure with
the transactional session alone. At b199010 on an H100 the first two agreed (int8 1.60 ms alone,
1.18x float) while the bench's int8 step on another H100 at 68e83c5 took 2.42 ms (0.86x): the
last two tell whether the procedure is where the difference lies.

    python benchmarks/diag/step_alone.py [--formats int8,fp8,int4] [--model qwen3.5-1.7b] [--context 1024]
        [--cache /tmp/shapes] [--steps 32]"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_model import fed_steps, model_and_prompt, options  # noqa: E402


def alone(model, prompt: list[int], steps: int) -> dict[str, float]:
    """Median ms of a step timed alone, its host part, its wait and its device time."""
    s = model.session(decode="graph")
    s.prefill(prompt, chunk_size=2048)
    logits = None
    for t in range(8):
        logits = s.feed([t])
    torch.cuda.synchronize()
    host, wait, whole, device = [], [], [], []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(steps):
        token = int(torch.argmax(logits))
        t0 = time.perf_counter()
        start.record()
        logits = s.feed([token])
        end.record()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        host.append(t1 - t0)
        wait.append(t2 - t1)
        whole.append(t2 - t0)
        device.append(start.elapsed_time(end) / 1e3)
    return {name: statistics.median(v) * 1e3 for name, v in
            (("alone", whole), ("host", host), ("wait", wait), ("device", device))}


def procedure(model, prompt: list[int], steps: int, by_itself: bool) -> float:
    """Median ms of a transactional decode step as `hebrus bench` measures it (two timed rounds
    after a warm one), beside an in-place session as the bench runs them, or (`by_itself`) alone."""
    from hebrus.bench import timing
    if not by_itself:
        return timing._point(model, prompt, steps, 2, model.prefill_chunk, "graph").decode_s_per_step[
            "transactional"] * 1e3
    spent = []
    for r in range(3):
        s = model.session(decode="graph")
        logits = None
        for begin in range(0, len(prompt), model.prefill_chunk):
            logits = s.feed(prompt[begin:begin + model.prefill_chunk])
        box = {"tx": logits}

        def advance(name, token):
            box[name] = s.feed([token])
        took = timing._timed_steps(model, ["tx"], steps, lambda name: int(torch.argmax(box[name])), advance)
        if r:
            spent.append(took["tx"] / steps)
    return statistics.median(spent) * 1e3


def main() -> None:
    args = options("qwen3.5-1.7b", 32, formats=(str, "int8,fp8,int4"))
    base, prompt = model_and_prompt(args)
    for fmt in [None, *[f for f in args.formats.split(",") if f]]:
        model = base if fmt is None else base.quantized(fmt)
        a = alone(model, prompt, args.steps)
        fed = fed_steps(model, prompt, args.steps)[1]
        print(f"{fmt or 'float'}: alone {a['alone']:.3f} ms (host {a['host']:.3f}, then waiting {a['wait']:.3f}; "
              f"device between events {a['device']:.3f}); fed back to back {fed:.3f} ms/step", flush=True)
        print(f"{fmt or 'float'}: the bench's procedure {procedure(model, prompt, args.steps, False):.3f} ms/step, "
              f"the same without the in-place session {procedure(model, prompt, args.steps, True):.3f}", flush=True)
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
