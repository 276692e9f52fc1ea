"""Kill a journaling session at random points and check that recovery loses no committed chunk.

    python tests/crash_harness.py TRIALS SEED FOLDER    -> one JSON line: counts

Each trial forks a child that journals a session of the tiny model (fast mode) into FOLDER,
feeds it a seeded mix of prefill chunks, single tokens and prefix transactions keeping part of
their chunk (`Session.feed_prefix`), saves a snapshot after its third
chunk, and after each feed returns writes the new frontier to a pipe. The parent kills it with
SIGKILL after a random delay, then recovers from the journal (and the snapshot, when the child
got that far) and checks that the recovered session holds every acknowledged chunk (and at most
the one chunk in flight) with the digest a fresh session reaches on the same chunks.
"""
from __future__ import annotations

import json
import os
import random
import signal
import sys
import time
from pathlib import Path

import torch

torch.set_num_threads(1)                # forked children: no thread pool to inherit

import hebrus  # noqa: E402


def chunks(seed: int) -> list[tuple[list[int], int | None]]:
    """(ids, None) for a plain chunk, (ids, k) for a prefix transaction keeping k of them."""
    rng = random.Random(seed)
    out = []
    for _ in range(40):
        n = rng.choice([1, 1, 1, 2, 5, 9])
        ids = [rng.randrange(256) for _ in range(n)]
        out.append((ids, rng.randrange(n + 1) if n > 1 and rng.random() < 0.3 else None))
    return out


def feed(session, ids: list[int], keep: int | None) -> None:
    if keep is None:
        session.feed(ids)
    else:
        session.feed_prefix(ids, lambda logits: keep)


def kept(ids: list[int], keep: int | None) -> int:
    return len(ids) if keep is None else keep


def child(model, folder: Path, work, pipe: int) -> None:
    s = model.session(journal=folder / "journal")
    for i, (ids, keep) in enumerate(work):
        feed(s, ids, keep)
        if i == 2:
            s.save(folder / "snapshot")
        os.write(pipe, f"{s.frontier}\n".encode())
    os._exit(0)


def trial(model, folder: Path, seed: int, rng: random.Random) -> dict:
    for name in os.listdir(folder):
        os.unlink(folder / name)
    work = chunks(seed)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        child(model, folder, work, write)
    os.close(write)
    time.sleep(rng.uniform(0, 0.25))
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    acked = [int(x) for x in os.read(read, 1 << 16).decode().split()]
    os.close(read)
    acknowledged = acked[-1] if acked else 0
    if not (folder / "journal").exists():
        return {"acknowledged": acknowledged, "recovered": 0, "lost": acknowledged, "ok": acknowledged == 0}
    snapshot = folder / "snapshot" if (folder / "snapshot").exists() else None
    s = model.recover(folder / "journal", snapshot=snapshot)
    s.journal.close()
    reference = model.session()
    at = 0
    for ids, keep in work:
        if at >= s.frontier:
            break
        feed(reference, ids, keep)
        at += kept(ids, keep)
    in_flight = at == s.frontier and (s.frontier == acknowledged or s.frontier == _next_end(work, acknowledged))
    same = at == s.frontier and reference.digest() == s.digest()
    return {"acknowledged": acknowledged, "recovered": s.frontier, "lost": max(0, acknowledged - s.frontier),
            "ok": same and in_flight and s.frontier >= acknowledged}


def _next_end(work, position: int) -> int:
    at = 0
    for ids, keep in work:
        at += kept(ids, keep)
        if at > position:
            return at
    return at


def main() -> None:
    trials, seed, folder = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    folder.mkdir(parents=True, exist_ok=True)
    model = hebrus.load("tiny", mode="fast")
    model.fingerprint                   # computed once, before forking
    rng = random.Random(seed)
    results = [trial(model, folder, seed * 1000 + t, rng) for t in range(trials)]
    print(json.dumps({
        "trials": trials, "kills": trials, "failed": sum(not r["ok"] for r in results),
        "tokens_lost": sum(r["lost"] for r in results),
        "acknowledged_tokens": sum(r["acknowledged"] for r in results),
        "recovered_beyond_acknowledged": sum(r["recovered"] > r["acknowledged"] for r in results),
        "killed_before_any_ack": sum(r["acknowledged"] == 0 for r in results),
        "killed_after_all": sum(r["acknowledged"] == sum(kept(*c) for c in chunks(seed * 1000 + i))
                                for i, r in enumerate(results)),
        "bad": [r for r in results if not r["ok"]][:5],
    }))


if __name__ == "__main__":
    main()
