"""Tensor parallelism: one model over `world` processes, a rank each.

    model = hebrus.load("Org/Name", tensor_parallel=2)      # this process is rank 0
    s = model.session()
    s.feed(ids)                                              # every rank runs it; all publish or none

Each rank holds its part of every weight and of every owner (`layers.shard`: heads and inner
widths split, the vocabulary split by rows) and runs each chunk in its own transaction; the
stages add their parts up across ranks, and before any rank flips, the ranks agree
(`engine.ranks`): all publish, or every rank raises the same `ChunkAborted`.

`hebrus.load(..., tensor_parallel=N)` starts N - 1 worker processes on this host (fresh
interpreters, `work`; CPU: gloo, every rank, this process too until `close`, computing with
1/N of the threads this process had;
CUDA: NCCL, rank r on device r) and gives a `ParallelModel`. Every call on it or on its sessions
runs on every rank: this process writes the call (pickled, numbered) to the rendezvous store,
which each worker reads and runs, runs it itself, then reads how each worker's call ended, which
must be how its own did. Sessions and generators are mirrored by number on every rank.

Several hosts: the same code over a TCP rendezvous. On the host whose address is HOST,
`hebrus.load(..., tensor_parallel=N, rendezvous="HOST:PORT")` serves the store on PORT and waits
for every rank; on each other host `hebrus worker --rendezvous HOST:PORT --rank R` joins, learns
the model and its options from the store, and loads its part.

What a rank's loss does: a collective that fails (the peer's connection closed) or runs past
`rank_timeout` seconds aborts the chunk on every surviving rank (`engine.ranks.RankLost`, the
`command` kind), nothing published; the model is then broken and refuses every call, and is
loaded again (sessions come back from their snapshots: `Session.save` is not yet taken under
tensor parallelism, so today that means from their prompts).
"""
from __future__ import annotations

import atexit
import datetime
import hashlib
import os
import pickle
import secrets
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from hebrus import faults
from hebrus.errors import ChunkAborted, InvalidInput, StructuralError

KEY = "hebrus/"
DEFAULT_TIMEOUT = 60.0          # seconds a collective, or a worker's answer, may take
START_TIMEOUT = 600.0           # seconds the workers may take to load their parts

_live: "ParallelModel | None" = None      # one tensor-parallel model a process (one default group)
_lock = threading.Lock()


@dataclass(frozen=True)
class Plan:
    """What every rank loads: the model, its options, the world, the backend, the timeout, and
    how many CPU threads each rank computes with (rank 0's)."""
    source: Any
    options: dict
    world: int
    backend: str
    timeout: float
    threads: int


class Call:
    """One call every rank runs: `method` of the object numbered `target` (0: the model), with
    faults armed for ranks, the result (a session or a generator) numbered `result` on every rank,
    the objects a rank may forget."""

    def __init__(self, target: int, method: str, args: tuple, kwargs: dict, result: int,
                 armed: list, forget: list):
        self.target, self.method, self.args, self.kwargs = target, method, args, kwargs
        self.result, self.armed, self.forget = result, armed, forget


# ---- the caller's side ------------------------------------------------------------------------
def launch(source, options: dict, world: int, build, rendezvous: str | None = None,
           timeout: float = DEFAULT_TIMEOUT) -> "ParallelModel":
    """Start the ranks of `source` loaded with `options` over `world` processes (this one rank 0);
    `build(plan, rank, store)` makes a rank's part of the model (`runtime.rank_model`)."""
    global _live
    from torch import distributed
    device = options.get("device", "cpu")
    backend = "nccl" if str(device).startswith("cuda") or (device == "auto" and torch.cuda.is_available()) \
        else "gloo"
    threads = torch.get_num_threads()
    if backend == "gloo":                       # the ranks share this host's cores
        threads = max(1, threads // world)
    plan = Plan(source, options, world, backend, timeout, threads)
    host, port = _address(rendezvous)
    with _lock:
        if _live is not None and not _live.closed:
            raise InvalidInput("one tensor-parallel model a process: close the one loaded "
                               "(model.close()) before loading another")
        store = distributed.TCPStore(host, port, is_master=True, timeout=_seconds(START_TIMEOUT),
                                     wait_for_workers=False)
        store.set(KEY + "plan", pickle.dumps(plan))
        processes = []
        if rendezvous is None:                  # the workers are this host's: started here
            processes = [_start(store.port, rank) for rank in range(1, world)]
        before = torch.get_num_threads()
        torch.set_num_threads(plan.threads)
        try:
            _await(store, [f"{KEY}ready/{rank}" for rank in range(1, world)], processes, START_TIMEOUT,
                   "loading their parts")
            local = build(plan, 0, store)
            _await(store, [f"{KEY}joined/{rank}" for rank in range(1, world)], processes, timeout,
                   "joining the group")
        except BaseException:
            for p in processes:
                p.kill()
            _end_group()
            torch.set_num_threads(before)
            raise
        store.set_timeout(_seconds(timeout))
        _live = ParallelModel(local, plan, store, processes, before)
        return _live


class ParallelModel:
    """A model over ranks, as rank 0 (this process) holds it. Its data (`spec`, `config`,
    `tokenizer`, `stages`, `device`, ...) are rank 0's; `session()` makes a session on every
    rank (`ParallelSession`); `close()` ends the workers."""

    def __init__(self, local, plan: Plan, store, processes: list, threads: int):
        self.local, self.plan, self.store, self.processes = local, plan, store, processes
        self.host_threads = threads                 # this process's CPU threads before the ranks shared them
        self.world, self.closed, self.broken = plan.world, False, None
        self._calls, self._numbers = 0, 1
        self._forget: list[int] = []
        self._lock = threading.RLock()
        atexit.register(self.close)

    # what every rank runs
    def session(self, **options) -> "ParallelSession":
        """A session on every rank (`Model.session`'s options; a journal is not taken yet)."""
        if options.get("journal") is not None:
            raise InvalidInput("a tensor-parallel model's sessions do not keep journals yet")
        return self._call(0, "session", (), options)

    def restore(self, path, **options) -> "ParallelSession":
        """A session on every rank as `ParallelSession.save` wrote it: rank 0 from `path`, rank r
        from `path.rank{r}` (`Model.restore`'s checks on each: the file must be that rank's part
        of this model, undamaged)."""
        return self._call(0, "restore", (path,), options)

    def close(self) -> None:
        """End the workers and leave the group (the model can no longer run)."""
        global _live
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self.broken is None:
                try:
                    self.store.set(f"{KEY}call/{self._calls}", pickle.dumps(None))
                except Exception:
                    pass
            for p in self.processes:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            _end_group()
            torch.set_num_threads(self.host_threads)
            if _live is self:
                _live = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str):
        if name in ("local", "plan", "store", "processes"):     # not yet set: being built
            raise AttributeError(name)
        value = getattr(self.local, name)
        if callable(value) and not isinstance(value, torch.Tensor):
            if name in LOCAL_MODEL_CALLS:
                return value
            raise InvalidInput(f"model.{name}() is not available on a tensor-parallel model yet "
                               f"(sessions are: model.session())")
        return value

    def __repr__(self) -> str:
        return f"ParallelModel(world={self.world}, rank 0: {self.local!r})"

    # ---- calls ------------------------------------------------------------------------------
    def _call(self, target: int, method: str, args: tuple, kwargs: dict, obj=None):
        """`method` of object `target` (`obj` here) with these arguments on every rank; what it
        gives back here (a session or a generator mirrored on every rank)."""
        with self._lock:
            if self.closed:
                raise InvalidInput("this tensor-parallel model is closed")
            if self.broken is not None:
                raise InvalidInput(f"this tensor-parallel model's ranks are broken ({self.broken}); load it again")
            armed = [f for f in faults.armed() if f.rank != 0]
            for f in armed:
                if not 0 < f.rank < self.world:
                    raise InvalidInput(f"rank {f.rank} does not exist: this model has ranks 0..{self.world - 1}")
            call = Call(target, method, args, kwargs, self._numbers, [_faulted(f) for f in armed], self._forget)
            try:
                message = pickle.dumps(call)
            except Exception as exc:
                raise InvalidInput(f"{method}: its arguments cannot be sent to the other ranks "
                                   f"({type(exc).__name__}: {exc}); a tensor-parallel session takes "
                                   f"token ids, numbers and strings") from None
            self._forget = []
            number, self._calls = self._calls, self._calls + 1
            self._numbers += 1
            self.store.set(f"{KEY}call/{number}", message)
            try:
                result = getattr(obj if obj is not None else self.local, LOCALLY.get(method, method))(*args, **kwargs)
                mine = ("ok", _small(result))
            except BaseException as exc:
                result, mine = exc, _ending(exc)
            if isinstance(result, ChunkAborted) and type(result).__name__ == "RankLost":
                self.broken = str(result)           # the others cannot answer: nothing to hear
                raise result
            try:
                theirs = self._hear(number, mine, armed, alike=method not in LOCALLY, files=method in PER_RANK_FILE)
            except InvalidInput:
                self._forget.append(call.result)        # what some ranks made of the call goes
                raise
            if isinstance(result, BaseException):
                raise result
            if method in LOCALLY:                   # what every rank has, rank by rank
                return [result, *theirs]
            return self._mirror(result, call.result)

    def _hear(self, number: int, mine: tuple, armed: list, alike: bool = True, files: bool = False) -> list:
        """How each worker's call `number` ended, which must be how this one's did (the same
        exception's type, or, `alike`, the same value) -> what each gave back, where that is a
        number or a string. A call that reads or writes each rank's own file (`files`: no
        collective, no state shared) may end otherwise on a rank: InvalidInput saying how."""
        values, otherwise = [], None
        for rank in range(1, self.world):
            key = f"{KEY}reply/{number}/{rank}"
            try:
                _await(self.store, [key], self.processes, self.plan.timeout, "answering")
                ending, fired = pickle.loads(self.store.get(key))
                self.store.delete_key(key)
            except InvalidInput as exc:
                self.broken = str(exc)
                raise StructuralError("ranks", str(exc)) from None
            for index in fired:
                next(f for f in armed if _faulted(f) == index).fired = True
            if ending[0] != mine[0] or ending[1] != mine[1] and (ending[0] == "raised" or alike):
                if not files:
                    self.broken = f"rank {rank} ended a call otherwise: {ending}, rank 0: {mine}"
                    raise StructuralError("ranks", self.broken)
                otherwise = otherwise or (rank, ending)
            values.append(ending[1])
        self.store.delete_key(f"{KEY}call/{number}")      # every worker has read it
        if otherwise is not None:
            rank, ending = otherwise
            said = f"{ending[1]}: {ending[2]}" if ending[0] == "raised" else "it went through"
            raise InvalidInput(f"rank {rank}'s file ended otherwise than rank 0's ({said}); rank 0's: "
                               f"{mine[1] + ': ' + mine[2] if mine[0] == 'raised' else 'it went through'}")
        return values

    def _mirror(self, result, number: int):
        from hebrus.session import Session
        if isinstance(result, Session):
            return ParallelSession(self, number, result)
        if hasattr(result, "__next__"):
            return ParallelIterator(self, number, result)
        return result

    def _dropped(self, number: int) -> None:
        self._forget.append(number)


LOCAL_MODEL_CALLS = frozenset({"named_parameters"})
PER_RANK_FILE = frozenset({"save", "restore"})     # their first argument names rank 0's file (`rank_file`)


def rank_file(path, rank: int) -> str:
    """The file rank `rank` keeps its part of a session in, for rank 0's `path`."""
    return os.fspath(path) if rank == 0 else f"{os.fspath(path)}.rank{rank}"
LOCALLY = {"digests": "digest"}         # calls whose every rank's value comes back: what each rank runs


def _small(value):
    """What a worker's answer carries of its call's value: a number or a string, else None."""
    return value if isinstance(value, (int, float, str)) else None


class _Mirror:
    """An object every rank holds under one number; calls on it run on every rank."""

    def __init__(self, owner: ParallelModel, number: int, local):
        self._owner, self._number, self._local = owner, number, local
        weakref.finalize(self, owner._dropped, number)

    def _run(self, method: str, *args, **kwargs):
        return self._owner._call(self._number, method, args, kwargs, self._local)


class ParallelSession(_Mirror):
    """A session on every rank. `feed`, `prefill`, `generate`, `generate_text`, `fork` run on
    every rank; what it holds (`frontier`, `logits`, ...) reads rank 0's; `digests()` every
    rank's digest of its part, `digest()` one of them all. `save(path)` writes a file a rank:
    rank 0's `path`, rank r's `path.rank{r}` (each atomic, each with its part's digest and its
    part's fingerprint), which `ParallelModel.restore(path)` reads back."""

    CALLS = ("feed", "prefill", "generate", "generate_text", "fork", "constrain", "save")

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self.CALLS:
            def call(*args, **kwargs):
                if name in ("generate", "generate_text") and kwargs.get("seed", 0) is None:
                    kwargs["seed"] = secrets.randbits(62)         # one draw for every rank
                return self._run(name, *args, **kwargs)
            return call
        value = getattr(self._local, name)
        if callable(value) and name not in LOCAL_SESSION_CALLS:
            raise InvalidInput(f"session.{name}() is not available under tensor parallelism yet; "
                               f"these are: {', '.join(self.CALLS + tuple(sorted(LOCAL_SESSION_CALLS)))}")
        return value

    @property
    def local(self):
        """This process's part of the session (rank 0's `Session`): readable when the other ranks
        are lost."""
        return self._local

    def digests(self) -> list[str]:
        """Each rank's digest of the part of the session it holds, rank by rank."""
        return self._run("digests")

    def digest(self) -> str:
        """SHA-256 of every rank's digest (`digests`), in rank order: it changes when any part
        does."""
        return hashlib.sha256(" ".join(self.digests()).encode()).hexdigest()


LOCAL_SESSION_CALLS: frozenset[str] = frozenset()


class ParallelIterator(_Mirror):
    """A generator every rank holds: each step runs on every rank."""

    def __iter__(self):
        return self

    def __next__(self):
        return self._run("__next__")

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._local, name)


def _faulted(fault) -> tuple:
    return (fault.stage, fault.kind, getattr(fault.session, "_number", None), fault.rank)


def _ending(exc: BaseException) -> tuple:
    return ("raised", type(exc).__name__, str(exc))


def _start(port: int, rank: int) -> subprocess.Popen:
    """A worker process on this host for `rank` (a fresh interpreter: nothing of the caller's
    script is run again), importing this hebrus."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package, os.environ.get("PYTHONPATH"))))}
    code = f"from hebrus import parallel, runtime; parallel.work('127.0.0.1', {port}, {rank}, runtime.rank_model)"
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL)


# ---- a worker's side --------------------------------------------------------------------------
def work(host: str, port: int, rank: int, build) -> None:
    """A worker: join the store at host:port as `rank`, load its part (`build`, as `launch`'s),
    then run every call."""
    from torch import distributed
    faults.RANK = rank
    store = distributed.TCPStore(host, port, is_master=False, timeout=_seconds(START_TIMEOUT))
    plan = pickle.loads(store.get(KEY + "plan"))
    torch.set_num_threads(plan.threads)
    store.set(f"{KEY}ready/{rank}", b"1")
    model = build(plan, rank, store)
    store.set(f"{KEY}joined/{rank}", b"1")
    store.set_timeout(datetime.timedelta(days=365))     # a worker waits for calls as long as the caller lives
    objects: dict[int, Any] = {0: model}
    number = 0
    while True:
        try:
            call = pickle.loads(store.get(f"{KEY}call/{number}"))
        except Exception:                       # the caller's process (and the store it served) is gone
            break
        if call is None:
            break
        for gone in call.forget:
            objects.pop(gone, None)
        ending, fired = _run_call(call, objects, rank)
        store.set(f"{KEY}reply/{number}/{rank}", pickle.dumps((ending, fired)))
        number += 1
    _end_group()


def _run_call(call: Call, objects: dict, rank: int) -> tuple[tuple, list]:
    armed = []
    for stage, kind, session, on in call.armed:
        if on == rank:
            armed.append(((stage, kind, session, on), faults.Fault(stage, kind, objects.get(session), rank=on)))
    with faults.armed_as([fault for _, fault in armed]):
        try:
            target, args = objects[call.target], call.args
            if call.method in PER_RANK_FILE and args:
                args = (rank_file(args[0], rank), *args[1:])
            result = getattr(target, LOCALLY.get(call.method, call.method))(*args, **call.kwargs)
            if hasattr(result, "__next__") or type(result).__name__ == "Session":
                objects[call.result] = result
            ending = ("ok", _small(result))
        except BaseException as exc:
            ending = _ending(exc)
    return ending, [index for index, fault in armed if fault.fired]


def init_group(plan: Plan, rank: int, store) -> torch.device | None:
    """Join the ranks' process group as `rank` (NCCL: on device rank mod the devices) -> the
    device a CUDA rank computes on, or None."""
    from torch import distributed
    device = None
    if plan.backend == "nccl":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    distributed.init_process_group(plan.backend, store=distributed.PrefixStore(KEY + "group", store), rank=rank,
                                   world_size=plan.world, timeout=_seconds(plan.timeout))
    return device


def _end_group() -> None:
    from torch import distributed
    if distributed.is_initialized():
        try:
            distributed.destroy_process_group()
        except Exception:
            pass


def _await(store, keys: list[str], processes: list, timeout: float, doing: str) -> None:
    """Wait until the store holds `keys`; InvalidInput when a local worker has died or `timeout`
    seconds pass."""
    deadline, pause = time.monotonic() + timeout, 1e-4
    while not store.check(keys):
        dead = [p for p in processes if p.poll() is not None]
        if dead:
            raise InvalidInput(f"a worker process stopped while {doing} (exit code {dead[0].returncode})")
        if time.monotonic() > deadline:
            raise InvalidInput(f"the ranks did not finish {doing} within {timeout:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)


def _address(rendezvous: str | None) -> tuple[str, int]:
    if rendezvous is None:
        return "127.0.0.1", 0
    host, sep, port = str(rendezvous).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidInput(f"rendezvous must be HOST:PORT (this host's address, a free port), got {rendezvous!r}")
    return host, int(port)


def _seconds(s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=s)


def serve_worker(rendezvous: str, rank: int, build) -> None:
    """`hebrus worker`: join a tensor-parallel model's rendezvous at HOST:PORT as `rank`."""
    host, port = _address(rendezvous)
    if rank < 1:
        raise InvalidInput(f"a worker's rank is 1 or more (rank 0 is the process that loads the model), got {rank}")
    work(host, port, rank, build)


def lose(stage: str, rank: int, how: str = "killed"):
    """For testing a rank's loss: rank `rank` is `how` ("killed": SIGKILL, "hung": stopped)
    as it reaches `stage` in the next call."""
    if how not in ("killed", "hung"):
        raise InvalidInput(f"how must be 'killed' or 'hung', got {how!r}")
    return faults.arm(faults.Fault(stage, how, None, rank=rank))


__all__ = ["ParallelIterator", "ParallelModel", "ParallelSession", "launch", "lose", "serve_worker", "work"]
