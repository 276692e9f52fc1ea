"""What travels between the ranks, and how a rank runs a call: the same code on rank 0 and on
every worker, so each runs exactly what the others run."""
from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from typing import Any

from hebrus.errors import InvalidInput

KEY = "hebrus/"                 # the rendezvous store's keys
DEFAULT_TIMEOUT = 60.0          # seconds a collective, or a worker's answer, may take
START_TIMEOUT = 600.0           # seconds the workers may take to join and load their parts
SET = "_saved_set"              # a save's keyword: the id every rank's file of it carries


@dataclass(frozen=True)
class Plan:
    """What every rank loads: the model, its options, the world, the backend, the timeout, and
    how many CPU threads each rank computes with."""
    source: Any
    options: dict
    world: int
    backend: str
    timeout: float
    threads: int


@dataclass(frozen=True)
class Call:
    """One call every rank runs: `method` of the object numbered `target` (0: the model), with
    the faults armed for ranks (`(stage, kind, session number, rank)`), its result (a session or
    a generator) numbered `result` on every rank; `forget`: objects the caller let go."""
    target: int
    method: str
    args: tuple
    kwargs: dict
    result: int
    armed: tuple
    forget: tuple


@dataclass(frozen=True)
class Ref:
    """An object every rank holds under `number` (a session), passed in a call's arguments."""
    number: int


TOGETHER = -1                   # the target of calls on several sessions at once: `hebrus.batching`


def mapped(value, each, path: tuple = ()):
    """`value` with each item that is no list or tuple (itself, or inside its lists and tuples)
    replaced by `each(item, the path to it)`."""
    if type(value) in (list, tuple):
        return type(value)(mapped(item, each, (*path, i)) for i, item in enumerate(value))
    return each(value, path)


def key(number: int, path: tuple):
    """What every rank keeps an object of call `number`'s value under: the number, or (number,
    *the path to it inside the value)."""
    return (number, *path) if path else number


def keeps(value) -> bool:
    """Whether every rank keeps `value` for later calls: a session, a host copy, a generator."""
    from hebrus.session import HostCopy, Session
    return isinstance(value, (Session, HostCopy)) or hasattr(value, "__next__")


def resolved(value, lookup):
    """`value` with each `Ref` in it replaced by `lookup(number)`."""
    return mapped(value, lambda item, _: lookup(item.number) if isinstance(item, Ref) else item)


def kept(value, number: int) -> dict:
    """The objects of call `number`'s value that every rank keeps (`keeps`; the value itself, or
    inside its lists and tuples, as `feed_keeping`'s sessions are), by key."""
    found = {}
    mapped(value, lambda item, path: found.update({key(number, path): item}) if keeps(item) else None)
    return found


LOCALLY = {"digests": "digest", "saved_set": "saved_set"}    # calls whose every rank's value comes back
PER_RANK_FILE = frozenset({"save", "restore", "saved_set", "settle", "discard"})  # their first argument names rank 0's file


def rank_file(path, rank: int) -> str:
    """The file rank `rank` keeps its part of a saved session in, for rank 0's `path`."""
    return os.fspath(path) if rank == 0 else f"{os.fspath(path)}.rank{rank}"


def perform(target, call: Call, rank: int, world: int):
    """Run `call` on `target` (this rank's object) as rank `rank` of `world`: a file argument
    made this rank's (`rank_file`), a save's note kept inside a record of the save, its id,
    this rank and the world (`saved_set` reads it back)."""
    args, kwargs = call.args, dict(call.kwargs)
    if call.method in PER_RANK_FILE and args:
        args = (rank_file(args[0], rank), *args[1:])
    if call.method == "saved_set":
        return saved_set(*args)
    if call.method == "settle":                 # a save's staged file moved over the file it saves
        os.replace(args[0], rank_file(args[1], rank))
        return None
    if call.method == "discard":                # a save's staged file let go (a rank may not have one)
        if os.path.lexists(args[0]):
            os.remove(args[0])
        return None
    if call.method == "save":
        kwargs["note"] = json.dumps({"saved set": kwargs.pop(SET), "rank": rank, "world": world,
                                     "note": kwargs.get("note")})
    return getattr(target, LOCALLY.get(call.method, call.method))(*args, **kwargs)


def saved_set(path) -> str | None:
    """The save a rank's file belongs to, as "id rank/world" (None: not a save over ranks)."""
    from hebrus import snapshot
    try:
        record = json.loads(snapshot.read_note(path) or "null")
    except (ValueError, OSError):
        return None
    if not isinstance(record, dict) or "saved set" not in record:
        return None
    return f"{record['saved set']} {record['rank']}/{record['world']}"


def small(value):
    """What a rank's answer carries of its call's value: a number or a string; for a list (a
    pass's outcomes, `feed_many`), the type of each item, which every rank must share; else
    None."""
    if isinstance(value, list):
        return tuple(type(v).__name__ for v in value)
    return value if isinstance(value, (int, float, str)) else None


def ending(exc: BaseException) -> tuple:
    return ("raised", type(exc).__name__, str(exc))


def address(rendezvous: str | None) -> tuple[str, int]:
    """HOST:PORT -> (host, port); None: this host, a port the system picks."""
    if rendezvous is None:
        return "127.0.0.1", 0
    host, sep, port = str(rendezvous).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"rendezvous must be HOST:PORT (this host's address, a free port), got {rendezvous!r}")
    return host, int(port)


def seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)
