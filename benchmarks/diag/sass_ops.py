"""What a Triton kernel of the project compiles to on an H100 (sm_90), on a machine without a GPU:
its instructions counted by kind from the SASS (global loads by width, shuffles, barriers, shared
memory, conversions, multiply-adds) over the whole compiled kernel, its registers and shared
memory. Found with it: the int4 products read their codes one byte at a time, and the compiled
vector kernel held 788 lane shuffles, because a row's byte count was computed in the kernel
((K + 1) // 2, whose divisibility by 16 Triton cannot know); passed as an argument, the kernel
holds 12 sixteen-byte loads and 36 shuffles (`results/sass-int4-sm90.txt`).

Needs triton (its wheel carries ptxas and cuobjdump) and torch in an environment of its own: the
CPU test environment keeps triton out.

    python benchmarks/diag/sass_ops.py hebrus.ops.cuda.quant._int4_vector HAS_ZERO=0 BLOCK_N=8 WORDS=1 \\
        BLOCK_K=2048 GROUP=128 GATED=0 ROUTED=0 CHAINED=0 [--types w_ptr=*i32] [--odd K] [--warps 4]

Every argument named NAME=VALUE is a constexpr; the others are pointers where their name ends in
`_ptr` or --types names them (default element type bf16), else 32-bit integers that Triton is told
divide by 16 (as it specialises them at a launch where they do), but those --odd names."""
from __future__ import annotations

import argparse
import collections
import importlib
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

KINDS = ("LDG", "LDGSTS", "STG", "LDS", "STS", "STSM", "LDSM", "SHFL", "BAR", "I2F", "I2FP", "F2F", "F2FP", "FFMA",
         "FADD", "FMUL", "HFMA2", "HMMA", "HGMMA", "PRMT", "LOP3")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kernel", help="module.kernel, e.g. hebrus.ops.cuda.quant._int4_vector")
    parser.add_argument("constexprs", nargs="*", help="NAME=VALUE (0/1 for a flag)")
    parser.add_argument("--types", default="", help="NAME=TYPE,... for arguments (*u8, *fp32, *fp8e4nv, i64, ...)")
    parser.add_argument("--odd", default="", help="integer arguments not known to divide by 16, comma-separated")
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--sass", help="also write the whole SASS here")
    args = parser.parse_args()
    import triton
    import triton.compiler as tc
    from triton.backends.compiler import GPUTarget
    module, name = args.kernel.rsplit(".", 1)
    fn = getattr(importlib.import_module(module), name)
    const = {}
    for item in args.constexprs:
        key, value = item.split("=", 1)
        const[key] = int(value)
    types = dict(t.split("=", 1) for t in args.types.split(",") if t)
    odd = set(filter(None, args.odd.split(",")))
    unknown = set(const) - set(fn.arg_names)
    if unknown:
        parser.error(f"{name} has no argument {', '.join(sorted(unknown))}; it takes {', '.join(fn.arg_names)}")
    signature, attrs = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in const:
            signature[arg] = "constexpr"
            continue
        kind = types.get(arg, "*bf16" if arg.endswith("_ptr") else "i32")
        signature[arg] = kind
        if kind.startswith("*") or arg not in odd:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = tc.ASTSource(fn=fn, signature=signature, attrs=attrs,
                          constexprs={(fn.arg_names.index(k),): v for k, v in const.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": args.warps})
    cubin = Path("/tmp") / f"sass-ops-{name}.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([str(tool), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    registers = re.search(r"REG:(\d+)", usage)
    if args.sass:
        Path(args.sass).write_text(sass)
    ops = collections.Counter(m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass))
    total = sum(ops.values())
    shown = {op: count for op, count in sorted(ops.items()) if op.split(".")[0] in KINDS}
    print(f"{name} {const} warps={args.warps}: {total} instructions, {registers.group(1) if registers else '?'} registers, "
          f"{compiled.metadata.shared} bytes of shared memory")
    for op, count in shown.items():
        print(f"  {count:6d}  {op}")


if __name__ == "__main__":
    main()
