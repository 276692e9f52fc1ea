"""Which operations of a planned decode step launch the copy and index kernels a GPU runs, and
with what shapes: one step of the planned route (uncaptured, its compiled ops warm) profiled with
stacks; each kernel is attributed to the CPU operation that launched it and to the nearest hebrus
frames above it. Printed: kernels by name, then the copy and index kernels by their site.
    python benchmarks/copy_sites.py [--model qwen3.5-1.7b] [--context 1024]"""
from __future__ import annotations

import collections

import torch
from gpu_model import model_and_prompt, options
from torch.profiler import ProfilerActivity, profile

args = options("qwen3.5-1.7b", 1)
model, prompt = model_and_prompt(args)
session = model.session(decode="planned")
session.prefill(prompt)
for t in range(4):
    session.feed([t])
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True, record_shapes=True,
             experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True)) as prof:
    session.feed([6])
    torch.cuda.synchronize()
kernels, sites = collections.Counter(), collections.Counter()
for event in prof.events():
    for kernel in getattr(event, "kernels", []):
        kernels[kernel.name[:90]] += 1
        if any(word in kernel.name for word in ("copy", "index", "Cat", "Memcpy")):
            frames, parent = [], event.cpu_parent
            while parent is not None and len(frames) < 4:
                if "hebrus" in parent.name and ".py(" in parent.name:
                    frames.append(parent.name.split("src/hebrus/")[-1])
                parent = parent.cpu_parent
            sites[(kernel.name[:60], event.name, str(event.input_shapes)[:80], " <- ".join(frames))] += 1
print(f"{sum(kernels.values())} kernels launched by CPU operations in one planned step "
      "(the Triton kernels a wrapper launches directly are not among them)")
for name, count in kernels.most_common(40):
    print(f"{count:5d} {name}")
print("copy and index kernels by site:")
for (name, op, shapes, frames), count in sites.most_common(60):
    print(f"{count:5d} {name} | {op} {shapes} | {frames}")
