"""Tensor parallelism: one model over `world` processes, a rank each.

    with hebrus.load("Org/Name", tensor_parallel=2) as model:   # this process is rank 0
        s = model.session()
        s.feed(ids)                                          # every rank runs it; all publish or none

Each rank holds its part of every weight and of every owner (`layers.shard`: heads and inner
widths split, the vocabulary split by rows) and runs each chunk in its own transaction; the
stages add their parts up across ranks, and before any rank flips, the ranks agree
(`engine.ranks`): all publish, or every rank raises the same `ChunkAborted`.

`hebrus.load(..., tensor_parallel=N)` starts N - 1 worker processes on this host (fresh
interpreters in sessions of their own, so a terminal's Ctrl-C reaches this process alone; on
the CPU gloo, every rank, this one too until `close`, computing with 1/N of the threads this
process had; on CUDA NCCL, rank r on device r) and gives a `ParallelModel` (`model.py`). Every
call on it or on its sessions (`mirror.py`) runs on every rank (`calls.py`): this process writes
the call, pickled and numbered, to the rendezvous store, each worker reads and runs it
(`worker.py`), this process runs it too, with signals held until every rank has answered, and
then reads how each worker's call ended, which must be how its own did.

Several hosts: the same code over a TCP rendezvous. On the host whose address is HOST,
`hebrus.load(..., tensor_parallel=N, rendezvous="HOST:PORT")` serves the store on PORT and waits
for every rank; on each other host `hebrus worker --rendezvous HOST:PORT --rank R` joins, learns
the model and its options from the store, and loads its part.

A rank's loss: a collective that fails (the peer's connection closed) or runs past
`rank_timeout` seconds aborts the chunk on every surviving rank (`engine.ranks.RankLost`, the
`command` kind), nothing published; the model is then broken and refuses every call. Load it
again and restore its sessions from their snapshots (`ParallelSession.save`: a file a rank,
all from one save, which `ParallelModel.restore` checks).
"""
from hebrus.parallel.calls import rank_file
from hebrus.parallel.mirror import ParallelHostCopy, ParallelIterator, ParallelSession
from hebrus.parallel.model import ParallelModel, RanksDisagree, launch, lose
from hebrus.parallel.worker import init_group, serve_worker, work

__all__ = ["ParallelHostCopy", "ParallelIterator", "ParallelModel", "ParallelSession", "RanksDisagree", "init_group", "launch", "lose",
           "rank_file", "serve_worker", "work"]
