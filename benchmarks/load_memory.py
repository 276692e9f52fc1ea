"""Peak memory of `hebrus.load` against the size of the loaded model.

Builds Qwen3.5-MoE-shaped checkpoints of about 0.85 and 1.7 GB (float32, hidden 1024 and 2048)
with transformers (once each, in a child process), then loads them in fresh processes and reads
the kernel's peak resident set (VmHWM): peak minus the resident set just before the load, over
the bytes of the model's parameters. "cold" measures from a process that has only imported
hebrus; "warm" first runs a preset once and converts between the dtypes, so torch's thread
pools, first allocations and the code pages of its conversion kernels (shared-library pages count
in the resident set) are not counted as the load's. The target is <= 1.2.
Run: python benchmarks/load_memory.py [--out FILE]
"""
from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import tempfile
from pathlib import Path


BUILD = r"""
import sys, torch, transformers
sys.path.insert(0, "tests")
from foreign import randomise
c = transformers.Qwen3_5MoeTextConfig(vocab_size=32000, hidden_size=int(sys.argv[3]), num_hidden_layers=8,
    num_attention_heads=8, num_key_value_heads=2, head_dim=128, linear_num_key_heads=8,
    linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=16,
    num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=512,
    max_position_embeddings=4096)
m = transformers.Qwen3_5MoeForCausalLM(c)
randomise(m, 0)
m.to(getattr(torch, sys.argv[2])).save_pretrained(sys.argv[1])
"""

MEASURE = r"""
import sys, torch, hebrus
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024
if sys.argv[3] == "warm":       # torch's thread pools, first allocations and the code pages of the
    hebrus.load("tiny", dtype=sys.argv[2]).session().feed([1, 2, 3])      # conversion kernels
    for a in (torch.float32, torch.bfloat16):
        for b in (torch.float32, torch.bfloat16):
            torch.isfinite(torch.ones(2**16, dtype=a).to(b)).all()
before = rss("VmRSS:")
m = hebrus.load(sys.argv[1], dtype=sys.argv[2])
size = sum(p.numel() * p.element_size() for _, p in m.named_parameters())
print(size, rss("VmHWM:") - before)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    # glibc raises its mmap threshold as large blocks are freed, then keeps freed memory in the
    # heap: the same load is measured with that default and with a fixed threshold.
    envs = {"default": None, "MALLOC_MMAP_THRESHOLD_=1048576": dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")}
    lines = ["| hidden | allocator | process | on disk | loaded as | model bytes | peak growth | ratio |",
             "|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        for hidden, stored in itertools.product((1024, 2048), ("float32", "bfloat16")):
            folder = Path(tmp) / f"{hidden}-{stored}"
            subprocess.run([sys.executable, "-c", BUILD, str(folder), stored, str(hidden)], check=True,
                           capture_output=True)
            for (allocator, env), start, dtype in itertools.product(envs.items(), ("cold", "warm"),
                                                                    ("float32", "bfloat16")):
                if hidden > 1024 and allocator != "default":
                    continue
                out = subprocess.run([sys.executable, "-c", MEASURE, str(folder), dtype, start], check=True,
                                     env=env, capture_output=True, text=True).stdout.split()
                size, peak = int(out[0]), int(out[1])
                lines.append(f"| {hidden} | {allocator} | {start} | {stored} | {dtype} | {size / 2**20:.0f} MiB | "
                             f"{peak / 2**20:.0f} MiB | {peak / size:.2f} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
