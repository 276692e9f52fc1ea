"""Where does a pass wait for the device? Every operation that makes the host wait for the CUDA
stream (a copy from pageable host memory, `.item()`, `.tolist()`, a `repeat_interleave` that
must know its size...) ends the host's lead over the device: from there, until the host has
launched enough work again, the device idles. This counts them with torch's sync debug mode,
each with the line of hebrus (or of a library) that asked, for:

    a new session; a lone prompt of P tokens; 4 and N prompts of P tokens in one pass (the
    serving engine's first turn at N clients); N sessions stepping one token each, eagerly

and the seconds each took (the device synchronised before and after); the pass of N prompts
with attention token by token (`layers.attention.LANES_READ`) and session by session; then each pass of
prompts again under torch.profiler, its operations by host time and by device time (at
7c74ec4 on an H100 a turn of 4 prompts of 128 tokens took about 290 ms, a lone one 42 ms).

    python benchmarks/diag/syncs.py [--model qwen3.5-1.7b] [--sessions 64] [--prompt 128]   (CUDA only)"""
from __future__ import annotations

import argparse
import collections
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hebrus  # noqa: E402
from hebrus import bench  # noqa: E402
from hebrus.batching import feed_many  # noqa: E402


def where(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of hebrus (or of a library it called, after it) that asked."""
    ours = [i for i, f in enumerate(stack) if "/hebrus/" in f.filename and "/benchmarks/" not in f.filename]
    if not ours:
        return "(outside hebrus)"
    inner = stack[ours[-1]]
    line = f"{Path(inner.filename).name}:{inner.lineno} {inner.name}"
    below = [f for f in stack[ours[-1] + 1:] if "warnings" not in f.filename]
    if below:
        line += f"  -> {Path(below[-1].filename).parent.name}/{Path(below[-1].filename).name}:{below[-1].lineno}"
    return line


def counted(what: str, do) -> None:
    """Run `do()` with every synchronising operation counted by where it was asked."""
    seen: collections.Counter[str] = collections.Counter()

    def heard(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            seen[where(traceback.extract_stack()[:-1])] += 1

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = heard
        torch.cuda.set_sync_debug_mode("warn")
        t = time.perf_counter()
        try:
            do()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t
    print(f"\n{what}: {sum(seen.values())} synchronisations, {seconds * 1e3:.2f} ms (counting them included)")
    for place, n in seen.most_common():
        print(f"  {n:5}  {place}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3.5-1.7b")
    parser.add_argument("--cache", default="/tmp/shapes")
    parser.add_argument("--sessions", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("syncs.py counts waits for a CUDA device; there is none here")
    name = args.model
    if name in bench.SHAPES:
        name = str(bench.random_checkpoint(name, Path(args.cache) / name))
    model = hebrus.load(name, device="cuda", dtype="bfloat16", mode="fast")
    vocab, n, p = model.spec.vocab_size, args.sessions, args.prompt
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (p,), generator=g).tolist() for _ in range(n)]

    def sessions():
        return [model.session(decode="eager") for _ in range(n)]

    def lone():
        model.session(decode="eager").feed(prompts[0])

    def together(batch):
        return lambda: feed_many(batch, prompts)

    def stepped(batch):
        return lambda: feed_many(batch, [ids[-1] for ids in prompts])

    for _ in range(2):                          # compiles and first allocations: not counted
        lone()
        feed_many([model.session(decode="eager") for _ in range(4)], prompts[:4])
        warm = sessions()
        feed_many(warm, prompts)
        feed_many(warm, [ids[-1] for ids in prompts])
    del warm
    print(f"{args.model} on {torch.cuda.get_device_name()}: {n} sessions, prompts of {p} tokens")
    counted("a new session", lambda: model.session(decode="eager"))
    counted(f"a lone prompt of {p} tokens", lone)
    four = [model.session(decode="eager") for _ in range(4)]
    counted(f"4 prompts of {p} tokens in one pass", lambda: feed_many(four, prompts[:4]))
    batch = sessions()
    counted(f"{n} prompts of {p} tokens in one pass", together(batch))
    counted(f"{n} sessions one token each, eager", stepped(batch))
    from hebrus.layers import attention
    default, times = getattr(attention, "LANES_READ", None), {}
    for round_ in range(3 if default is not None else 0):   # attention token by token, or session by session
        for bound in (default, 0):
            attention.LANES_READ = bound
            batch = sessions()
            torch.cuda.synchronize()
            t = time.perf_counter()
            feed_many(batch, prompts)
            torch.cuda.synchronize()
            times.setdefault(bound, []).append(time.perf_counter() - t)
    if default is not None:
        attention.LANES_READ = default
        print(f"\n{n} prompts of {p} tokens in one pass, ms (3 rounds taking turns): attention token by token "
              f"{sorted(round(x * 1e3, 2) for x in times[default])}, session by session "
              f"{sorted(round(x * 1e3, 2) for x in times[0])}")
    from torch.profiler import ProfilerActivity, profile
    for count in (4, n):
        batch = [model.session(decode="eager") for _ in range(count)]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as traced:
            feed_many(batch, prompts[:count])
            torch.cuda.synchronize()
        averages = traced.key_averages()
        print(f"\n{count} prompts of {p} tokens in one pass, under torch.profiler:")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60))
        print(averages.table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
