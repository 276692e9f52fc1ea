"""Kill a journaling session at random points, some with the disk filling up, and check that
recovery loses no committed chunk and never brings back one that failed.

    python tests/crash_harness.py TRIALS SEED FOLDER    -> one JSON line: counts

Each trial forks a child that journals a session of the tiny model (fast mode) into FOLDER,
feeds it a seeded mix of prefill chunks, single tokens and prefix transactions keeping part of
their chunk (`Session.feed_prefix`), saves a snapshot after its third chunk, and after each feed
writes to a pipe whether the chunk published or aborted. In half the trials the disk fills up
(a file size limit) at a random chunk, a random number of bytes past the journal's end, and
frees again some chunks later: records that cannot be written abort their chunks at `journal`
(and a snapshot that cannot be written is not written). In half the trials the child gives up
at the first chunk that aborts; the space comes back and it closes its journal and ends, as it
does after its last chunk. The parent waits for a random number of
the child's answers, so that kills land across the whole run whatever the machine's speed, then
kills it with SIGKILL after a short random delay, recovers from the journal (and the snapshot,
when there is one), and checks that the recovered session is a fresh session fed exactly the
chunks that published, or those and the one in flight, with the same digest.
"""
from __future__ import annotations

import json
import os
import random
import resource
import signal
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

torch.set_num_threads(1)                # forked children: no thread pool to inherit

import hebrus  # noqa: E402

CHUNKS = 40


class Full(NamedTuple):
    """The disk fills before chunk `at` with `room` bytes left past the journal's end, and
    frees again before chunk `at + span`."""
    at: int
    room: int
    span: int


def chunks(seed: int) -> list[tuple[list[int], int | None]]:
    """(ids, None) for a plain chunk, (ids, k) for a prefix transaction keeping k of them."""
    rng = random.Random(seed)
    out = []
    for _ in range(CHUNKS):
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


def child(model, folder: Path, work, pipe: int, full: Full | None, gives_up: bool) -> None:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a write past the limit fails (EFBIG) instead
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    s, status = model.session(journal=folder / "journal"), None
    for i, (ids, keep) in enumerate(work):
        if gives_up and status == "aborted":            # a program that ends on its first failure
            break
        if full is not None and i == full.at:
            resource.setrlimit(resource.RLIMIT_FSIZE, ((folder / "journal").stat().st_size + full.room, hard))
        if full is not None and i == full.at + full.span:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        try:
            feed(s, ids, keep)
            status = "published"
        except hebrus.CommandError:
            status = "aborted"
        if i == 2:
            try:
                s.save(folder / "snapshot")
            except Exception:                           # the disk is full: no snapshot this time
                pass
        os.write(pipe, f"{status}\n".encode())
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))         # the space is back by the end
    s.journal.close()
    os._exit(0)


def trial(model, folder: Path, seed: int, rng: random.Random) -> dict:
    for name in os.listdir(folder):
        os.unlink(folder / name)
    work = chunks(seed)
    full = Full(rng.randrange(CHUNKS), rng.randrange(120), rng.randrange(1, 12)) if rng.random() < 0.5 else None
    wait_for, delay, gives_up = rng.randrange(CHUNKS + 1), rng.uniform(0, 0.02), rng.random() < 0.5
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        child(model, folder, work, write, full, gives_up)
    os.close(write)
    answers = _answers(read, wait_for)
    time.sleep(delay)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    answers += _answers(read, None)
    os.close(read)
    published = [i for i, status in enumerate(answers) if status == "published"]
    acknowledged = sum(kept(*work[i]) for i in published)
    ended = len(answers) == len(work) or gives_up and answers[-1:] == ["aborted"]
    in_flight = [] if ended else [len(answers)]
    if not (folder / "journal").exists():
        return _result(acknowledged, 0, full, answers, acknowledged == 0)
    snapshot = folder / "snapshot" if (folder / "snapshot").exists() else None
    s = model.recover(folder / "journal", snapshot=snapshot)
    s.journal.close()
    ok = any(_reached(model, work, published + extra, s) for extra in ([], in_flight))
    return _result(acknowledged, s.frontier, full, answers, ok)


def _answers(pipe: int, count: int | None) -> list[str]:
    """The child's answers, `count` of them (or until it ends), None: all that are left."""
    data = b""
    while count is None or data.count(b"\n") < count:
        more = os.read(pipe, 1 << 16)
        if not more:
            break
        data += more
    return data.decode().split()


def _reached(model, work, fed: list[int], recovered) -> bool:
    """Whether `recovered` is a fresh session fed the chunks `fed`, in order."""
    reference = model.session()
    for i in fed:
        feed(reference, *work[i])
    return reference.frontier == recovered.frontier and reference.digest() == recovered.digest()


def _result(acknowledged: int, recovered: int, full: Full | None, answers: list[str], ok: bool) -> dict:
    return {"acknowledged": acknowledged, "recovered": recovered, "lost": max(0, acknowledged - recovered),
            "full": full is not None, "aborted": answers.count("aborted"), "answers": len(answers), "ok": ok}


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
        "trials_with_a_full_disk": sum(r["full"] for r in results),
        "chunks_aborted_by_a_full_disk": sum(r["aborted"] for r in results),
        "trials_with_an_aborted_chunk": sum(r["aborted"] > 0 for r in results),
        "recovered_beyond_acknowledged": sum(r["recovered"] > r["acknowledged"] for r in results),
        "killed_before_any_answer": sum(r["answers"] == 0 for r in results),
        "killed_after_all": sum(r["answers"] == CHUNKS for r in results),
        "bad": [r for r in results if not r["ok"]][:5],
    }))


if __name__ == "__main__":
    main()
