"""The torch ops one pass of several sessions' prompts dispatches, by name: what the host pays
for op by op, apart from what each op computes (on a GPU each is a launch or more).

    python benchmarks/diag/pass_ops.py MODEL [--sessions 64] [--tokens 8] [--top 40]

MODEL: a checkpoint folder or preset (on the CPU, e.g. a tiny Qwen3.5 made by tests/foreign.py's
`build`; on a GPU, a bench shape's random checkpoint). The ops of the CPU's delta rule twin (a loop
over each session's chunks, which fla's kernels replace on a GPU) are counted apart."""
from __future__ import annotations

import argparse
import collections
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import hebrus


class Counted(TorchDispatchMode):
    """Each dispatched op by name, and whether the CPU's delta rule twin (`ops/gdn.py`) asked."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.rule = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        frames = [f.filename for f in traceback.extract_stack(limit=30)]
        if any(name.endswith("hebrus/ops/gdn.py") for name in frames):
            self.rule += 1
        else:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=8, help="each session's prompt tokens (default %(default)s)")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.sessions < 1 or args.tokens < 1:
        parser.error("--sessions and --tokens take 1 or more")
    cuda = torch.cuda.is_available()
    model = hebrus.load(args.model, mode="fast", **({"device": "cuda", "dtype": "bfloat16"} if cuda else {}))
    vocab = model.spec.vocab_size
    prompts = [[(7 * j + 13 * i) % (vocab - 1) + 1 for j in range(args.tokens)] for i in range(args.sessions)]
    hebrus.feed_many([model.session(decode="eager") for _ in prompts], prompts)     # compiled, cached
    sessions = [model.session(decode="eager") for _ in prompts]
    counted = Counted()
    with counted:
        hebrus.feed_many(sessions, prompts)
    total = sum(counted.ops.values())
    print(f"{args.model} on {model.device}: a pass of {args.sessions} prompts of {args.tokens} tokens dispatches "
          f"{total} ops (and {counted.rule} in the CPU's delta rule twin)")
    for name, count in counted.ops.most_common(args.top):
        print(f"{count:7d}  {name}")


if __name__ == "__main__":
    sys.exit(main())
