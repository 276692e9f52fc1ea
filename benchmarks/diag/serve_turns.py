"""The engine loop alone, turn by turn, under `hebrus bench --serve --workload long`'s load: decoding
requests, then a long prompt among them; each turn's seconds against the median turn before it,
the prompt tokens it fed, and the loop's pace (no HTTP, no clients: what the loop does, apart
from the jitter a server and its clients add on a small machine).

    python benchmarks/diag/serve_turns.py [--model shakespeare] [--clients 16] [--prompt 6000] [--share 1.5]
        [--passes auto|one|two|paced] [--chunk 256] [--cache /tmp/shapes]

On a GPU (a shape of `hebrus bench`, e.g. --model qwen3.5-1.7b, its random checkpoint made under
--cache) the model runs in bfloat16 and the loop warms up first, as `hebrus serve` does; each turn
is timed to the device's end. With --passes paced the stages each turn ran are shown, and the
seconds each place of a pass took (`Pace.stage_s`).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

import hebrus
from hebrus import bench
from hebrus.bench.limits import sync
from hebrus.sampling import Sampling
from hebrus.scheduling.scheduler import CHUNK_SIZE, PREFILL_SHARE, Request, Scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shakespeare")
    parser.add_argument("--clients", type=int, default=16, help="requests decoding (default %(default)s)")
    parser.add_argument("--prompt", type=int, default=6000, help="the long prompt's tokens (default %(default)s)")
    parser.add_argument("--share", type=float, default=PREFILL_SHARE, help="the loop's prefill_share (default %(default)s)")
    parser.add_argument("--before", type=int, default=40, help="turns before the long prompt (default %(default)s)")
    parser.add_argument("--passes", default="auto", choices=("auto", "one", "two", "paced"),
                        help="the loop's passes (default %(default)s)")
    parser.add_argument("--chunk", type=int, default=CHUNK_SIZE, help="one request's prompt tokens a turn at most "
                        "(the loop's chunk_size, `hebrus serve --prefill-chunk`; default %(default)s)")
    parser.add_argument("--cache", default="/tmp/shapes", help="where a shape's random checkpoint is made (a GPU run)")
    args = parser.parse_args()
    if args.clients < 1 or args.prompt < 1 or args.share <= 0 or args.before < 12 or args.chunk < 1:
        parser.error("--clients, --prompt and --chunk take 1 or more, --share a positive number, --before 12 or more")
    name = args.model
    if name in bench.SHAPES:
        name = str(bench.random_checkpoint(name, Path(args.cache) / name))
    cuda = torch.cuda.is_available()
    model = hebrus.load(name, mode="fast", **({"device": "cuda", "dtype": "bfloat16"} if cuda else {}))
    if args.prompt + 1 > model.spec.max_context:
        parser.error(f"--prompt passes the model's max_context {model.spec.max_context}")
    loop = Scheduler(model, max_sessions=args.clients + 1, prefill_share=args.share, cache_bytes=0, spare_sessions=0,
                     passes=args.passes, chunk_size=args.chunk)
    if cuda:
        began = time.perf_counter()
        loop.warm_up()
        print(f"warmed up in {time.perf_counter() - began:.1f} s; passes {loop.passes}, route {loop.decode}", flush=True)
    gen = torch.Generator().manual_seed(6)

    def request(length: int, new: int, seed: int) -> Request:
        return Request(key="k", prompt=torch.randint(0, model.spec.vocab_size, (length,), generator=gen).tolist(),
                       max_tokens=new, sampling=Sampling(), seed=seed, stop_ids=frozenset(), emit=lambda kind, value: None)

    def turn() -> tuple[float, int]:
        loop._take_waiting()
        fed = sum(r.fed for r in loop.running)
        began = time.perf_counter()
        loop._turn()
        sync(model.device)
        return time.perf_counter() - began, sum(r.fed for r in loop.running) - fed

    def stages() -> int:
        """The paced pass's places run so far (0 without one)."""
        return len(loop.flight.paced.seconds) if loop.flight is not None else 0

    loop.waiting.extend(request(16, 10_000, i) for i in range(args.clients))
    before = [turn()[0] for _ in range(args.before)][10:]          # the first turns feed the decoders' prompts
    long = request(args.prompt, 1, 99)
    loop.waiting.append(long)
    during = []
    while not long.produced and len(during) < 100_000:
        placed = stages()
        seconds, fed = turn()
        ran = stages() - placed if loop.flight is not None else None
        during.append((seconds, fed, ran, loop.pace.alone_s, loop.pace.step_s, loop.pace.token_s))
    median = statistics.median(before)
    ordered = sorted(d for d, *_ in during)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    print(f"{args.model} on {model.device}, {args.clients} decoding, a {args.prompt}-token prompt, share {args.share}, "
          f"passes {loop.passes}, chunks of {args.chunk}: a turn before {median * 1e3:.2f} ms (median of {len(before)}); "
          f"{len(during)} turns while it is fed, {ordered[0] / median:.2f}-{ordered[-1] / median:.2f}x of it, "
          f"p99 {p99 / median:.2f}x")
    for i, (seconds, fed, ran, alone, step, token) in enumerate(during):
        print(f"  turn {i:4}: {seconds * 1e3:6.1f} ms ({seconds / median:.2f}x), fed {fed:4}"
              + (f", {ran} stages" if ran is not None else "") + f"; pace: alone "
              f"{(alone or 0) * 1e3:.1f} ms, a step beside chunks {(step or 0) * 1e3:.1f} ms, a token {(token or 0) * 1e3:.3f} ms")
    if loop.pace.stage_s:
        print("a paced pass's places, ms: " + ", ".join(f"{place} {s * 1e3:.2f}" for place, s in sorted(loop.pace.stage_s.items())))


if __name__ == "__main__":
    main()
