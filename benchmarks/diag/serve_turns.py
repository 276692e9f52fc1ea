"""The engine loop alone, turn by turn, under `hebrus bench --serve --workload long`'s load: decoding
requests, then a long prompt among them; each turn's seconds against the median turn before it,
the prompt tokens it fed, and the loop's pace (no HTTP, no clients: what the loop does, apart
from the jitter a server and its clients add on a small machine).

    python benchmarks/diag/serve_turns.py [--model shakespeare] [--clients 16] [--prompt 6000] [--share 1.5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import hebrus
from hebrus.sampling import Sampling
from hebrus.scheduling.scheduler import PREFILL_SHARE, Request, Scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shakespeare")
    parser.add_argument("--clients", type=int, default=16, help="requests decoding (default %(default)s)")
    parser.add_argument("--prompt", type=int, default=6000, help="the long prompt's tokens (default %(default)s)")
    parser.add_argument("--share", type=float, default=PREFILL_SHARE, help="the loop's prefill_share (default %(default)s)")
    parser.add_argument("--before", type=int, default=40, help="turns before the long prompt (default %(default)s)")
    args = parser.parse_args()
    if args.clients < 1 or args.prompt < 1 or args.share <= 0 or args.before < 12:
        parser.error("--clients and --prompt take 1 or more, --share a positive number, --before 12 or more")
    model = hebrus.load(args.model, mode="fast")
    if args.prompt + 1 > model.spec.max_context:
        parser.error(f"--prompt passes the model's max_context {model.spec.max_context}")
    loop = Scheduler(model, max_sessions=args.clients + 1, prefill_share=args.share, cache_bytes=0, spare_sessions=0)
    gen = torch.Generator().manual_seed(6)

    def request(length: int, new: int, seed: int) -> Request:
        return Request(key="k", prompt=torch.randint(0, model.spec.vocab_size, (length,), generator=gen).tolist(),
                       max_tokens=new, sampling=Sampling(), seed=seed, stop_ids=frozenset(), emit=lambda kind, value: None)

    def turn() -> tuple[float, int]:
        loop._take_waiting()
        fed = sum(r.fed for r in loop.running)
        began = time.perf_counter()
        loop._turn()
        return time.perf_counter() - began, sum(r.fed for r in loop.running) - fed

    loop.waiting.extend(request(16, 10_000, i) for i in range(args.clients))
    before = [turn()[0] for _ in range(args.before)][10:]          # the first turns feed the decoders' prompts
    long = request(args.prompt, 1, 99)
    loop.waiting.append(long)
    during = []
    while not long.produced and len(during) < 100_000:
        during.append(turn() + (loop.pace.alone_s, loop.pace.step_s, loop.pace.token_s))
    median = statistics.median(before)
    print(f"{args.model}, {args.clients} decoding, a {args.prompt}-token prompt, share {args.share}: a turn before "
          f"{median * 1e3:.1f} ms (median of {len(before)}); {len(during)} turns while it is fed, "
          f"{min(d for d, *_ in during) / median:.2f}-{max(d for d, *_ in during) / median:.2f}x of it")
    for i, (seconds, fed, alone, step, token) in enumerate(during):
        print(f"  turn {i:4}: {seconds * 1e3:6.1f} ms ({seconds / median:.2f}x), fed {fed:4}; pace: alone "
              f"{(alone or 0) * 1e3:.1f} ms, a step beside chunks {(step or 0) * 1e3:.1f} ms, a token {(token or 0) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
