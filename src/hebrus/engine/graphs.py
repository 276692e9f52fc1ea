"""Steps from a static plan, captured as CUDA graphs: one per bank parity. One-token decode
steps, and prefix transactions of a fixed length (a speculative round's verifying chunk).

A decode step does the same work at every position, so it can be recorded once and replayed.
What changes from step to step is kept on the device where the graph finds it:

- the position is the public bank's `frontier` owner, read on the device (`state.step`);
- the token id is copied into one device buffer before each replay;
- the banks alternate, so one graph reads bank 0 and writes bank 1, the other the reverse;
- no block is taken inside a graph: a step runs from the plan only when the session's block
  table already holds its row, in a block of its own. Attention reads every row the table holds
  (masked past the position; one view of the storage when the blocks are consecutive), so when
  an eager chunk changes the table the graphs are dropped at once, and each parity runs
  uncaptured once with the new table
  before it is captured again.

A replay is still one transaction. Its checks (status words, finite checks) are folded into one
tensor inside the graph and read back once; one event recorded after the replay is its
completion record; the memory budget hears the largest request the stages made at capture;
publication is the same flip. An error on the replay path is reported at the step's first
stage: a graph cannot say which of its stages failed. Nothing is captured until each parity has
run once from the plan uncaptured (this warms up kernels that tune or compile themselves on
first use, which must not happen during a capture). Captures are serialised across the process
and confined to their thread, so other sessions keep running meanwhile. When faults are armed
the eager runner takes the step, since injection points are host code.

The graphs' private memory pools (a few intermediates of one token per layer) are not counted
by the session's memory budget.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from hebrus import faults
from hebrus.engine.eager import finish, run_stages, transaction
from hebrus.errors import ChunkAborted, InvalidInput
from hebrus.layers.kernels import top_k_chooser
from hebrus.layers.owners import FRONTIER
from hebrus.state.budget import Refused, out_of_memory
from hebrus.state.step import StepBatch
from hebrus.state.txn import Transaction

_CAPTURING = threading.Lock()             # one capture at a time in the process
DECODE = ("auto", "eager", "planned", "graph")


def decode_route(model, decode: str) -> str:
    """The route `model`'s one-token steps take, as `decode` asks: "eager" (stage by stage, like
    any chunk), "planned" (from the static step plan, uncaptured), "graph" (the plan captured as
    CUDA graphs), or "auto" (graph for a fast-mode model on CUDA, eager otherwise). A route the
    model cannot take is InvalidInput."""
    if not isinstance(decode, str) or decode not in DECODE:
        raise InvalidInput(f"decode must be one of {', '.join(DECODE)}; got {decode!r}")
    plannable = model.kernels.whole_chunk and model.kernels.choose is top_k_chooser and not model.paged
    if decode == "auto":
        return "graph" if plannable and model.device.type == "cuda" else "eager"
    if decode in ("planned", "graph") and not plannable:
        why = (f"runs {model.mode} mode" if not model.kernels.whole_chunk
               else "makes its choices with another chooser" if model.kernels.choose is not top_k_chooser
               else "streams its PLE tables in pages")
        raise InvalidInput(f"decode={decode!r} runs fast mode with the spec's top-k; this model {why} "
                           f"(use decode='eager')")
    if decode == "graph" and model.device.type != "cuda":
        raise InvalidInput(f"decode='graph' captures CUDA graphs; this model is on {model.device} "
                           f"(use 'planned' or 'eager')")
    return decode


def capture(plan):
    """Capture `plan()` as a CUDA graph, one capture at a time in the process and confined to
    this thread -> (graph, what plan returned, None), or (None, None, why) when it cannot be
    captured at all (the steps then stay uncaptured), or (None, None, None) when it was short of
    memory or budget this time (uncaptured this time only)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with _CAPTURING, torch.cuda.graph(graph, capture_error_mode="thread_local"):
            made = plan()
    except Exception as exc:
        if out_of_memory(exc) or isinstance(exc, (Refused, ChunkAborted)):
            return None, None, None
        return None, None, f"{type(exc).__name__}: {exc}"
    return graph, made, None


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    txn: Transaction                 # the captured plan: its checks and events live in the graph


class DecodeSteps:
    """The planned steps of one session: chunks of `length` tokens (one: decode steps), plain
    or (`each`) prefix transactions. `capture=False` runs the plan without a graph (any
    device): the same work, launched op by op."""

    def __init__(self, model, image, budget, capture: bool, length: int = 1, each: bool = False):
        self.model, self.image, self.budget, self.capture = model, image, budget, capture
        self.length, self.each = length, each
        self.ids = torch.zeros(length, dtype=torch.int64, device=model.device)
        # the tokens go to the device from pinned memory without stopping the host (each step
        # reads its checks back before the next one reuses this buffer)
        self.staged = torch.zeros(length, dtype=torch.int64, pin_memory=model.device.type == "cuda")
        self.graphs: dict[int, _Graph] = {}
        self.warm: set[int] = set()              # parities run from the plan at least once
        self.captures = 0                        # graphs captured so far (for tests and bench)
        self.replays = 0                         # steps run from a captured graph
        self.uncaptured = 0                      # steps run from the plan op by op
        self.refused: str | None = None          # why capture failed, if it did: plan runs uncaptured
        self._table = image.public.table         # the block table that `warm` and `graphs` belong to

    def accepts(self, ids: torch.Tensor) -> bool:
        """Whether this chunk can run from the plan: `length` tokens, no fault armed, and the
        session's table already holding their rows, in blocks of its own (not shared with a fork)."""
        if len(ids) != self.length or faults.armed():
            return False
        return self.image.room(self.length)

    def retire_stale(self) -> None:
        """Drop graphs captured for another block table (after an eager chunk took blocks or
        copied a shared one: attention in a graph reads the rows of the table it was captured
        with, as one view of the storage when its blocks are consecutive), and warm each parity
        again with the new one."""
        table = self.image.public.table
        if table != self._table:
            self.graphs.clear()
            self.warm.clear()
        self._table = table

    def step(self, ids: torch.Tensor, out: torch.Tensor | None, keep=None) -> int:
        """Run the chunk (a prefix transaction's `keep` as in `engine.eager.finish`); returns
        the number of tokens published."""
        self.retire_stale()
        record = self.image.public
        held = self.graphs.get(record.bank)
        if held is None and self.capture and self.refused is None and record.bank in self.warm:
            held = self._capture(ids)
        if held is None:
            published = self._uncaptured(ids, out, keep)
            self.warm.add(record.bank)
            return published

        def replay(txn: Transaction) -> None:
            txn.restart()
            self._stage(ids)
            held.graph.replay()
            txn.completion.record_replay()
            self.replays += 1

        return finish(held.txn, replay, out, keep)

    def _stage(self, ids: torch.Tensor) -> None:
        """The step's inputs where the plan reads them; rows past the frontier zeroed if an
        aborted chunk may have left anything there."""
        self.image.clean_tails()
        self.image.device_table()
        self.staged.copy_(ids)
        self.ids.copy_(self.staged, non_blocking=True)

    def _uncaptured(self, ids: torch.Tensor, out: torch.Tensor | None, keep) -> int:
        txn = self._transaction()

        def work(txn: Transaction) -> None:
            self._stage(ids)
            run_stages(self.model, txn, self._step(txn))
            self.uncaptured += 1

        return finish(txn, work, out, keep)

    def _capture(self, ids: torch.Tensor) -> _Graph | None:
        def plan() -> Transaction:
            txn = self._transaction()
            run_stages(self.model, txn, self._step(txn))
            txn.checks.fold()
            return txn

        self.image.device_table()               # current before the capture: no copy inside it
        graph, txn, self.refused = capture(plan)
        if graph is None:
            return None
        self.captures += 1
        held = _Graph(graph, txn)
        self.graphs[txn.record.bank] = held
        return held

    def _step(self, txn: Transaction) -> StepBatch:
        """The step as the plan has it: the token ids in their buffer, the position the public
        bank's frontier owner on the device."""
        return StepBatch.planned(self.ids, txn.public[FRONTIER].view(1), self.each)

    def _transaction(self) -> Transaction:
        return transaction(self.model, [self.image], [self.budget], [self.length], planned=True, each=self.each)
