"""The caller's side: starting the ranks (`launch`) and the model over them (`ParallelModel`),
rank 0 in this process, whose `call` runs a call on every rank."""
from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import subprocess
import sys
import threading
import time

import torch

from hebrus import faults
from hebrus.engine.ranks import RankLost
from hebrus.errors import InvalidInput
from hebrus.parallel.calls import (DEFAULT_TIMEOUT, KEY, LOCALLY, PER_RANK_FILE, START_TIMEOUT, TOGETHER, Call, Plan,
                                   Ref, address, ending, keeps, key, mapped, perform, seconds, small)
from hebrus.parallel.mirror import Mirror, ParallelHostCopy, ParallelIterator, ParallelSession
from hebrus.parallel.worker import end_group
from hebrus.state.interrupts import deferred_signals

_live: "ParallelModel | None" = None      # one tensor-parallel model a process (one default group)
_lock = threading.Lock()


class RanksDisagree(RuntimeError):
    """The ranks ended a call differently: their states may differ, so the model is broken."""


def launch(source, options: dict, world: int, build, rendezvous: str | None = None,
           timeout: float = DEFAULT_TIMEOUT) -> "ParallelModel":
    """Start the ranks of `source` loaded with `options` over `world` processes (this one rank 0);
    `build(plan, rank, store)` makes a rank's part of the model (`runtime.rank_model`)."""
    global _live
    from torch import distributed
    device = options.get("device", "cpu")
    cuda = str(device).startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    threads = torch.get_num_threads() if cuda else max(1, torch.get_num_threads() // world)   # the CPU's ranks share it
    plan = Plan(source, options, world, "nccl" if cuda else "gloo", timeout, threads)
    host, port = address(rendezvous)
    with _lock:
        if _live is not None and not _live.closed:
            raise InvalidInput("one tensor-parallel model a process: close the one loaded "
                               "(model.close()) before loading another")
        try:
            store = distributed.TCPStore(host, port, is_master=True, timeout=seconds(START_TIMEOUT),
                                         wait_for_workers=False)
        except RuntimeError as exc:
            raise InvalidInput(f"cannot serve the rendezvous on {host}:{port}: {str(exc).splitlines()[0]}") from None
        store.set(KEY + "plan", pickle.dumps(plan))
        processes = [] if rendezvous is not None else [_start(store.port, rank) for rank in range(1, world)]
        if rendezvous is not None and world > 1:            # the wait may be long: say what it waits for
            print(f"hebrus: waiting up to {START_TIMEOUT:g} s for ranks 1..{world - 1} at {host}:{port} "
                  f"(on each other host: hebrus worker --rendezvous {host}:{port} --rank R)", file=sys.stderr)
        before = torch.get_num_threads()
        torch.set_num_threads(plan.threads)
        try:
            _await(store, [f"{KEY}ready/{rank}" for rank in range(1, world)], processes, START_TIMEOUT,
                   "joining")
            local = build(plan, 0, store)
            _await(store, [f"{KEY}joined/{rank}" for rank in range(1, world)], processes, START_TIMEOUT,
                   "loading their parts")
        except BaseException:
            for p in processes:
                p.kill()
            end_group()
            torch.set_num_threads(before)
            raise
        store.set_timeout(seconds(timeout))
        _live = ParallelModel(local, plan, store, processes, before)
        return _live


class ParallelModel:
    """A model over ranks, as rank 0 (this process) holds it. Its data (`spec`, `config`,
    `tokenizer`, `stages`, `device`, ...) are rank 0's; `session()` makes a session on every
    rank (`ParallelSession`); `restore(path)` one saved over ranks; `close()` ends the workers."""

    def __init__(self, local, plan: Plan, store, processes: list, threads: int):
        self.local, self.plan, self.store, self.processes = local, plan, store, processes
        self.host_threads = threads             # this process's CPU threads before the ranks shared them
        self.world, self.closed, self.broken = plan.world, False, None
        self._calls, self._numbers, self._forget = 0, 1, []
        self._lock, self._forgetting = threading.RLock(), threading.Lock()
        atexit.register(self.close)

    def session(self, **options) -> ParallelSession:
        """A session on every rank (`Model.session`'s options; a journal is not taken yet)."""
        if options.get("journal") is not None:
            raise InvalidInput("a tensor-parallel model's sessions do not keep journals yet")
        return self.call(0, "session", (), options)

    def restore(self, path, **options) -> ParallelSession:
        """A session on every rank as `ParallelSession.save` wrote it: rank 0's from `path`, rank
        r's from `path.rank{r}`, each checked as `Model.restore` checks a file, and all from one
        save of this many ranks."""
        sets = self.call(0, "saved_set", (path,), {})
        ids = {None if s is None else s.split()[0] for s in sets}
        wanted = [f"{rank}/{self.world}" for rank in range(self.world)]
        if None in ids or len(ids) != 1 or [s.split()[1] for s in sets] != wanted:
            raise InvalidInput(f"{path} and its ranks' files are not one save of a session over {self.world} ranks "
                               f"(each rank's file, rank by rank: {sets})")
        return self.call(0, "restore", (path,), options)

    def close(self) -> None:
        """End the workers and leave the group (the model can no longer run)."""
        global _live
        with self._lock:
            if self.closed:
                return
            self.closed = True
            atexit.unregister(self.close)
            try:
                self.store.set(f"{KEY}call/{self._calls}", pickle.dumps(None))
            except RuntimeError:
                pass
            for p in self.processes:            # a broken model's workers may be stopped or stuck: no wait
                try:
                    p.wait(5 if self.broken is None else 0)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            end_group()
            torch.set_num_threads(self.host_threads)
            self.local = self.store = None
            if _live is self:
                _live = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getattr__(self, name: str):
        if name in ("local", "plan", "store", "processes"):     # not yet set: being built
            raise AttributeError(name)
        if self.local is None:
            raise InvalidInput("this tensor-parallel model is closed")
        value = getattr(self.local, name)
        if callable(value) and not isinstance(value, torch.Tensor) and name != "named_parameters":
            raise InvalidInput(f"model.{name}() is not available on a tensor-parallel model yet "
                               f"(these are: session, restore, from_host, feed_many, feed_keeping_many, close)")
        return value

    def __repr__(self) -> str:
        return f"ParallelModel(world={self.world}, rank 0: {self.local!r})"

    # ---- calls ------------------------------------------------------------------------------
    def call(self, target: int, method: str, args: tuple, kwargs: dict, obj=None):
        """`method` of object `target` (`obj` here) with these arguments on every rank, signals
        held until every rank has answered -> what it gives back here (a session or a generator
        mirrored on every rank; for `LOCALLY`'s calls, every rank's value)."""
        with self._lock, deferred_signals():
            self._usable()
            call, armed = self._posted(target, method, self._swapped(args, lambda m: Ref(m._number)), kwargs)
            self.local.ranks.open = True
            try:
                mine = dataclasses.replace(call, args=self._swapped(args, lambda m: m._local))
                result = perform(obj if obj is not None else self.local, mine, 0, self.world)
                mine = ("ok", small(result))
            except BaseException as exc:
                result, mine = exc, ending(exc)
            finally:
                self.local.ranks.open = False
            if isinstance(result, RankLost):
                self.broken = str(result)           # the others cannot answer: nothing to hear
                raise result
            try:
                theirs = self._hear(call, mine, armed)
            except InvalidInput:
                self.dropped(call.result)           # what some ranks made of the call goes
                raise
            if isinstance(result, BaseException):
                raise result
            if method in LOCALLY:
                return [result, *theirs]
            return self._mirror(result, call.result)

    def from_host(self, copy, **options) -> ParallelSession:
        """A session on every rank from `copy` (`ParallelSession.host_copy`), each rank's from
        its part (`Model.from_host`'s options)."""
        if not isinstance(copy, ParallelHostCopy):
            raise InvalidInput("copy must be a host copy of a session of this model (session.host_copy())")
        return self.call(0, "from_host", (copy,), options)

    def feed_keeping_many(self, sessions, tokens, marks) -> list:
        """`hebrus.batching.feed_keeping_many` of this model's sessions, on every rank (each
        session's outcome agreed by every rank); the sessions kept are sessions on every rank."""
        from hebrus import batching
        tokens = tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens
        return self.call(TOGETHER, "feed_keeping_many", (list(sessions), tokens, marks), {}, batching)

    def feed_many(self, sessions, tokens, outs=None) -> list:
        """`hebrus.feed_many` of this model's sessions: one pass on every rank, each session its
        own transaction there, each session's outcome agreed by every rank
        (`engine.ranks.Ranks.agree_each`)."""
        from hebrus import batching
        tokens = tokens.cpu() if isinstance(tokens, torch.Tensor) else tokens   # unpickled on each rank's CPU
        if outs is not None:
            raise InvalidInput("outs is not taken under tensor parallelism (a tensor here cannot be written on the "
                               "other ranks); the logits come back as new tensors")
        return self.call(TOGETHER, "feed_many", (list(sessions), tokens), {}, batching)

    def _swapped(self, value, swap):
        """`value` with each object mirrored on the ranks (a session; itself, or in a list or
        tuple) replaced by `swap(it)`; one of another model is refused."""
        def each(item, _):
            if not isinstance(item, Mirror):
                return item
            if item._owner is not self:
                raise InvalidInput("a session of another tensor-parallel model (or one closed) cannot be passed here")
            return swap(item)
        return mapped(value, each)

    def dropped(self, number: int) -> None:
        """Object `number` is let go here: the workers let it go with the next call."""
        with self._forgetting:
            self._forget.append(number)

    def _usable(self) -> None:
        if self.closed:
            raise InvalidInput("this tensor-parallel model is closed")
        if self.broken is not None:
            raise InvalidInput(f"this tensor-parallel model's ranks are broken ({self.broken}); load it again")

    def _posted(self, target: int, method: str, args: tuple, kwargs: dict) -> tuple[Call, list]:
        """The call written to the store for the workers -> (it, the faults armed for them)."""
        armed = [f for f in faults.armed() if f.rank != 0]
        for f in armed:
            if not 0 < f.rank < self.world:
                raise InvalidInput(f"rank {f.rank} does not exist: this model has ranks 0..{self.world - 1}")
        with self._forgetting:
            forget, self._forget = tuple(self._forget), []
        call = Call(target, method, args, kwargs, self._numbers, tuple(_armed(f) for f in armed), forget)
        try:
            message = pickle.dumps(call)
        except Exception as exc:
            with self._forgetting:
                self._forget.extend(forget)
            raise InvalidInput(f"{method}: its arguments cannot be sent to the other ranks ({type(exc).__name__}: "
                               f"{exc}); a tensor-parallel session takes token ids, numbers and strings") from None
        self._numbers += 1
        if self.world > 1:                      # a world of one has no worker to read it
            self.store.set(f"{KEY}call/{self._calls}", message)
        self._calls += 1
        return call, armed

    def _hear(self, call: Call, mine: tuple, armed: list) -> list:
        """How each worker's call ended, which must be how this one's did: the same exception's
        type, or the same value but for `LOCALLY`'s calls -> what each gave back, where that is
        a number or a string. A call on each rank's own file (no collective, no state shared) may
        end otherwise on a rank: InvalidInput saying how; otherwise RanksDisagree."""
        number, values, otherwise = self._calls - 1, [], None
        for rank in range(1, self.world):
            key = f"{KEY}reply/{number}/{rank}"
            try:
                _await(self.store, [key], self.processes, self.plan.timeout, "answering")
            except InvalidInput as exc:
                self.broken = str(exc)
                raise RanksDisagree(f"rank {rank} did not answer: {exc}; the model is broken") from None
            said, fired = pickle.loads(self.store.get(key))
            self.store.delete_key(key)
            for index in fired:
                armed[index].fired = True
            same_end = said[0] == mine[0]
            same_value = said[1] == mine[1] or (said[0] == "ok" and call.method in LOCALLY)
            if not (same_end and same_value):
                if call.method not in PER_RANK_FILE:
                    self.broken = f"rank {rank} ended a call otherwise: {said}, rank 0: {mine}"
                    raise RanksDisagree(f"{self.broken}; the model is broken")
                otherwise = otherwise or (rank, said)
            values.append(said[1])
        if self.world > 1:
            self.store.delete_key(f"{KEY}call/{number}")  # every worker has read it
        if otherwise is not None:
            rank, said = otherwise
            raise InvalidInput(f"rank {rank}'s file ended otherwise than rank 0's: rank {rank}: {_said(said)}; "
                               f"rank 0: {_said(mine)}")
        return values

    def _mirror(self, value, number: int):
        """`value` with what every rank keeps of it (`calls.kept`) in mirrors, under the same keys."""
        from hebrus.session import HostCopy, Session

        def each(item, path):
            if not keeps(item):
                return item
            kind = (ParallelSession if isinstance(item, Session) else ParallelHostCopy if isinstance(item, HostCopy)
                    else ParallelIterator)
            return kind(self, key(number, path), item)
        return mapped(value, each)


def lose(stage: str, rank: int, how: str = "killed"):
    """For testing a rank's loss: rank `rank` (a worker's) is `how` ("killed": SIGKILL, "hung":
    stopped) as it reaches `stage` in the next call."""
    if how not in ("killed", "hung"):
        raise InvalidInput(f"how must be 'killed' or 'hung', got {how!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidInput(f"rank must be a worker's rank (1 or more), got {rank!r}")
    return faults.arm(faults.Fault(stage, how, None, rank=rank))


def _armed(fault) -> tuple:
    return (fault.stage, fault.kind, getattr(fault.session, "_number", None), fault.rank)


def _said(said: tuple) -> str:
    return f"{said[1]}: {said[2]}" if said[0] == "raised" else "it went through"


def _start(port: int, rank: int) -> subprocess.Popen:
    """A worker process on this host for `rank`: a fresh interpreter (nothing of the caller's
    script runs again) in a session of its own (a terminal's Ctrl-C reaches the caller alone),
    importing this hebrus."""
    package = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (package, os.environ.get("PYTHONPATH"))))}
    code = f"from hebrus import parallel, runtime; parallel.work('127.0.0.1', {port}, {rank}, runtime.rank_model)"
    return subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL, start_new_session=True)


def _await(store, keys: list[str], processes: list, timeout: float, doing: str) -> None:
    """Wait until the store holds `keys`; InvalidInput when a local worker has stopped (with
    what it said) or `timeout` seconds pass."""
    deadline, pause = time.monotonic() + timeout, 1e-4
    while not store.check(keys):
        for rank, p in enumerate(processes, start=1):
            if p.poll() is not None:
                failed = f"{KEY}failed/{rank}"
                why = store.get(failed).decode() if store.check([failed]) else f"exit code {p.returncode}"
                raise InvalidInput(f"rank {rank}'s process stopped while {doing}: {why}")
        if time.monotonic() > deadline:
            raise InvalidInput(f"the ranks did not finish {doing} within {timeout:g} s")
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
