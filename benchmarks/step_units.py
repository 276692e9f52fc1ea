"""What a planned decode step would launch on the CUDA route, counted on any machine: one unit
for each call of a fused op (`kernels.fused`: inductor makes one kernel of it, or a few), one for
each call of a kind's own op (`kernels.ops`: the lanes' Triton kernels) and of the table's
Sinkhorn rounds (one Triton kernel), one for every other torch operation that computes something
(views, fresh empties and casts to the same dtype left out). Printed: units a step, and the largest groups with where they are called from. The GPU's
own count is `hebrus bench`'s ops column; this finds what to fuse without one.

    python benchmarks/step_units.py [--model shakespeare] [--family qwen3_5] [--top 40]

`--family` builds a tiny random checkpoint of a foreign family (tests/foreign.py) instead."""
from __future__ import annotations

import argparse
import collections
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hebrus
import hebrus.layers.kernels as kernels_table
import hebrus.layers.kind as kind

SRC = Path(hebrus.__file__).parent
UNITS: collections.Counter = collections.Counter()
_inside: list = [None]          # the unit being counted, while its own operations run
# operations that launch nothing: views, metadata, allocation
QUIET = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "expand", "t", "detach", "alias", "transpose",
         "permute", "split", "split_with_sizes", "unbind", "squeeze", "as_strided", "reshape", "unflatten", "flatten",
         "lift_fresh", "_reshape_alias", "chunk", "narrow", "empty", "empty_like", "empty_strided"}


def _unit(name: str, f):
    def counted(*args, **kwargs):
        if _inside[0] is not None:
            return f(*args, **kwargs)
        _inside[0] = name
        UNITS[name] += 1
        try:
            return f(*args, **kwargs)
        finally:
            _inside[0] = None
    return counted


class _Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.__name__.split(".")[0]
        if _inside[0] is not None or name in QUIET:
            return out
        if name in ("to", "_to_copy") and isinstance(out, torch.Tensor) and out.data_ptr() == args[0].data_ptr():
            return out
        calls = [f"{Path(f.filename).relative_to(SRC)}:{f.lineno} {f.name}"
                 for f in traceback.extract_stack() if f.filename.startswith(str(SRC))][-2:]
        UNITS[f"{name} @ {' <- '.join(reversed(calls))}"] += 1
        return out



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shakespeare", help="a preset or checkpoint (default shakespeare)")
    parser.add_argument("--family", help="a tiny random checkpoint of this family instead (qwen3_5, qwen3_5_moe, ...)")
    parser.add_argument("--top", type=int, default=40, help="groups printed (default 40)")
    args = parser.parse_args()
    kernels_table.unfused = lambda op: _unit("fused " + op.__name__, op)     # what the CUDA fast table fuses
    kernels_table.sinkhorn = _unit("op sinkhorn", kernels_table.sinkhorn)     # one Triton kernel there
    declared = kind.kind_ops
    kernels_table.kind_ops = lambda mode, device, dtype: {
        name: _unit("op " + name, op) for name, op in declared(mode, device, dtype).items()}
    source = args.model
    if args.family:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from foreign import build
        source, _ = build(args.family, tempfile.mkdtemp())
    model = hebrus.load(source, mode="fast", dtype="bfloat16")
    session = model.session(decode="planned")
    session.feed(list(range(1, 11)))
    for token in range(3):
        session.feed([token + 1])
    UNITS.clear()
    with _Count():
        session.feed([7])
    print(f"{args.family or args.model}: {sum(UNITS.values())} units a planned decode step")
    for group, count in UNITS.most_common(args.top):
        print(f"{count:5d}  {group}")


if __name__ == "__main__":
    main()
