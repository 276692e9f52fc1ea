"""A worker: one rank's process, started here (`model._start`) or by `hebrus worker` on another
host. It joins the rendezvous store, loads its part of the model, then runs every call the
caller writes, in order, until the caller says stop or goes away."""
from __future__ import annotations

import dataclasses
import pickle
import sys
from typing import Any

import torch

from hebrus import faults
from hebrus.errors import InvalidInput
from hebrus.parallel.calls import (KEY, START_TIMEOUT, TOGETHER, Call, Plan, address, ending, kept, perform,
                                   resolved, seconds, small)

FOREVER = seconds(365 * 24 * 3600)      # a worker waits for calls as long as the caller lives


def work(host: str, port: int, rank: int, build) -> None:
    """Join the store at host:port as `rank`, load this rank's part (`build(plan, rank, store)`,
    `runtime.rank_model`), then run every call. A part that cannot load is said in the store
    (the caller raises it), not here."""
    from torch import distributed
    faults.RANK = rank
    try:
        store = distributed.TCPStore(host, port, is_master=False, timeout=seconds(START_TIMEOUT))
    except Exception:
        raise InvalidInput(f"no rendezvous answered at {host}:{port} within {START_TIMEOUT:g} s") from None
    plan: Plan = pickle.loads(store.get(KEY + "plan"))
    if not 0 < rank < plan.world:
        raise InvalidInput(f"rank {rank} does not exist: the model at {host}:{port} has ranks 0..{plan.world - 1}")
    if store.add(f"{KEY}claimed/{rank}", 1) != 1:
        raise InvalidInput(f"rank {rank} of the model at {host}:{port} has joined already")
    torch.set_num_threads(plan.threads)
    store.set(f"{KEY}ready/{rank}", b"1")
    try:
        model = build(plan, rank, store)
    except Exception as exc:
        store.set(f"{KEY}failed/{rank}", f"{type(exc).__name__}: {exc}".encode())
        sys.exit(1)
    store.set(f"{KEY}joined/{rank}", b"1")
    store.set_timeout(FOREVER)
    from hebrus import batching
    objects: dict[int, Any] = {0: model, TOGETHER: batching}
    number = 0
    while True:
        try:
            call = pickle.loads(store.get(f"{KEY}call/{number}"))
        except (RuntimeError, OSError):         # the caller's process (and the store it served) is gone
            break
        if call is None:
            break
        for gone in call.forget:
            objects.pop(gone, None)
        answer = _run(call, objects, rank, plan.world, model)
        store.set(f"{KEY}reply/{number}/{rank}", pickle.dumps(answer))
        number += 1
    end_group()


def _run(call: Call, objects: dict, rank: int, world: int, model) -> tuple[tuple, list]:
    """Run `call` on this rank's objects -> (how it ended, the indices of its armed faults that
    fired)."""
    armed = [(index, faults.Fault(stage, kind, objects.get(session), rank=on))
             for index, (stage, kind, session, on) in enumerate(call.armed) if on == rank]
    model.ranks.open = True
    try:
        call = dataclasses.replace(call, args=resolved(call.args, objects.__getitem__))
        with faults.armed_as([fault for _, fault in armed]):
            result = perform(objects[call.target], call, rank, world)
        objects.update(kept(result, call.result))
        said = ("ok", small(result))
    except BaseException as exc:
        said = ending(exc)
    finally:
        model.ranks.open = False
    return said, [index for index, fault in armed if fault.fired]


def init_group(plan: Plan, rank: int, store) -> torch.device | None:
    """Join the ranks' process group as `rank` (NCCL: on device `rank`) -> the device a CUDA
    rank computes on, or None."""
    from torch import distributed
    device = None
    if plan.backend == "nccl":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    distributed.init_process_group(plan.backend, store=distributed.PrefixStore(KEY + "group", store), rank=rank,
                                   world_size=plan.world, timeout=seconds(plan.timeout))
    return device


def end_group() -> None:
    from torch import distributed
    if distributed.is_initialized():
        try:
            distributed.destroy_process_group()
        except (RuntimeError, ValueError):
            pass


def serve_worker(rendezvous: str, rank: int, build) -> None:
    """`hebrus worker`: join a tensor-parallel model's rendezvous at HOST:PORT as `rank`."""
    host, port = address(rendezvous)
    if rank < 1:
        raise InvalidInput(f"a worker's rank is 1 or more (rank 0 is the process that loads the model), got {rank}")
    print(f"hebrus worker: joining {host}:{port} as rank {rank}", file=sys.stderr)
    work(host, port, rank, build)
