"""Where a decode step's time goes on a GPU: per-step wall time of each decode route, the graph
runner's counters, and a profile of a few steps (top kernels and host ops), then the host's
Python for the graph route's steps (cProfile, by own time and by cumulative time). For the graph
route, the steps also timed as `hebrus bench` times them, a step at a time: alone, after an
argmax read on the host, and with another session's step between (bench alternates two
variants), which tells a step's own time from the loop's.
    python benchmarks/decode_profile.py [--model small] [--context 1024] [--routes graph,planned,eager]
        [--quantize int8|int4|int4-zp|fp8] [--out DIR]"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import torch
from gpu_model import fed_steps, model_and_prompt, options


def one_at_a_time(s, steps: int, read: bool = False, other=None) -> float:
    """The median ms a step of `s.feed`, each step timed alone between two syncs (as `hebrus
    bench` times them; the median passes over a step that captures a new graph); `read`: its
    token read from the last logits first (argmax, on the host), untimed; `other`: a session that
    steps between (untimed)."""
    logits, spent = s.feed([1]), []
    for t in range(steps):
        token = int(torch.argmax(logits)) if read else t
        if other is not None:
            other.feed([t])
        torch.cuda.synchronize()
        start = time.perf_counter()
        logits = s.feed([token])
        torch.cuda.synchronize()
        spent.append(time.perf_counter() - start)
    return statistics.median(spent) * 1e3


def kernel_sequence(prof, steps: int) -> str:
    """The GPU's work over `steps` profiled steps: kernels a step, GPU-busy time against the
    span from the first kernel's start to the last one's end (what lies between is the host's
    time and the gaps), then the last step's kernels in order with their microseconds."""
    kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    if not kernels:
        return "no kernels recorded\n"
    busy = sum(e.time_range.elapsed_us() for e in kernels)
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    per = len(kernels) // steps
    head = (f"{len(kernels)} kernels over {steps} steps ({len(kernels) / steps:.1f} a step); GPU busy "
            f"{busy / steps:.1f} us a step of a {span / steps:.1f} us span ({busy / span:.1%})\n"
            f"the last step's {per} kernels in order (us, name):\n")
    return head + "".join(f"{e.time_range.elapsed_us():8.2f}  {e.name[:110]}\n" for e in kernels[-per:])


args = options("small", 40, routes=(str, "graph,planned,eager"))
name = args.model + (f"-{args.quantize}" if args.quantize else "")      # the files' names
model, prompt = model_and_prompt(args)
lines = []
for decode in args.routes.split(","):
    s, ms = fed_steps(model, prompt, args.steps, decode)
    steps = s._steps
    extra = "" if steps is None else (f" captures={steps.captures} replays={steps.replays} "
                                      f"uncaptured={steps.uncaptured} refused={steps.refused}")
    lines.append(f"{decode}: {ms:.3f} ms/step{extra}")
    print(lines[-1], flush=True)
    if decode == "graph":
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for t in range(5):
                s.feed([t])
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
        host = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        Path(args.out, f"profile-{name}.txt").write_text("\n".join(lines) + "\n\n" + table + "\n\n" + host)
        Path(args.out, f"kernels-{name}.txt").write_text(kernel_sequence(prof, 5))
        python = cProfile.Profile()
        python.enable()
        for t in range(args.steps):
            s.feed([t])
        torch.cuda.synchronize()
        python.disable()
        text = io.StringIO()
        for order in ("tottime", "cumulative"):
            pstats.Stats(python, stream=text).sort_stats(order).print_stats(30)
        Path(args.out, f"host-python-{name}.txt").write_text(
            f"cProfile of {args.steps} graph-route steps of {args.model}\n" + text.getvalue())
        # last: these steps may cross a table width (a new graph), which the profile above must not see
        other = model.session(decode=decode)
        other.prefill(prompt, chunk_size=2048)
        for t in range(8):
            other.feed([t])
        alone, read, between = (one_at_a_time(s, args.steps, *how) for how in ((), (True,), (True, other)))
        lines.append(f"graph, a step timed at a time: {alone:.3f} ms alone, {read:.3f} after an argmax read, "
                     f"{between:.3f} with another session's step between")
        print(lines[-1], flush=True)
Path(args.out, f"decode-{name}.txt").write_text("\n".join(lines) + "\n")
