"""Steps from a static plan, captured as CUDA graphs: one runner per model (`Steps`) for any
set of sessions. A step of B lanes of L tokens each (one: decode steps; more: a prefix
transaction of a fixed length, a speculative round's verifying chunk) does the same work
whichever sessions run it at whatever positions, so it is recorded once and replayed. What a
step is lives in device buffers the graph reads (`state.step.StepBatch` of a planned step):
each lane's token ids and positions, its slot and public bank parity, and its block table. Before
each run the runner writes them from the host in one copy; n sessions run in the smallest
bucket of lanes that holds them (`lanes_for`), the other lanes padding over the pool's scratch
slot and block, whose results nobody reads. So a graph is kept per (lanes, tokens per lane,
table width, prefix or not): sessions joining, leaving, flipping banks or taking blocks replay
the same graph. The table width (`width_for`, in blocks) bounds how many rows attention looks
at; past a session's table it reads the pool's zero block, past a position it masks. Where a
stage's work grows with the width (rows gathered up to it: sparse attention, a quantized cache,
the gathering twin), widths come in steps of a quarter of a power of two; where none does (the
lanes' attention kernel reads to each lane's position), in powers of two, so a session growing
through thousands of rows changes graphs a few times.

Blocks are taken on the host when the step's transaction begins, never inside a graph. A replay
is still one transaction per session: its checks are folded into one tensor inside the graph
and read back once, one event recorded after the replay is its completion record, each memory
budget hears the largest request the stages made of a lane's at capture, publication is the
same flip. An error on the replay path is reported at the step's first stage: a graph cannot
say which of its stages failed. Nothing is captured until its key has run once from the plan
uncaptured (this warms up kernels that tune or compile themselves on first use, which must not
happen during a capture). Captures are serialised across the process and confined to their
thread; one lock per runner covers a run from staging to publication (the graphs share their
buffers and one memory pool). When faults are armed the eager runner takes the step, since
injection points are host code.

The graphs' memory pool (a few intermediates per lane and layer) is not counted by any
session's memory budget.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import torch

from hebrus import faults
from hebrus.engine.eager import run_stages, transaction
from hebrus.errors import ChunkAborted, InvalidInput
from hebrus.layers.kernels import top_k_chooser
from hebrus.state.budget import Refused, out_of_memory
from hebrus.state.step import StepBatch
from hebrus.state.txn import Captured, Transaction

_CAPTURING = threading.Lock()             # one capture at a time in the process
DECODE = ("auto", "eager", "planned", "graph")


def decode_route(model, decode: str) -> str:
    """The route `model`'s one-token steps take, as `decode` asks: "eager" (stage by stage, like
    any chunk), "planned" (from the static step plan, uncaptured), "graph" (the plan captured as
    CUDA graphs), or "auto" (graph for a fast-mode model on CUDA, eager otherwise). A route the
    model cannot take is InvalidInput."""
    if not isinstance(decode, str) or decode not in DECODE:
        raise InvalidInput(f"decode must be one of {', '.join(DECODE)}; got {decode!r}")
    host = [type(stage).__name__ for stage in model.stages if getattr(stage, "host_positions", False)]
    plannable = (model.kernels.whole_chunk and model.kernels.choose is top_k_chooser and not model.paged
                 and not host and model.ranks is None)
    if decode == "auto":
        return "graph" if plannable and model.device.type == "cuda" else "eager"
    if decode in ("planned", "graph") and not plannable:
        why = (f"runs {model.mode} mode" if not model.kernels.whole_chunk
               else "makes its choices with another chooser" if model.kernels.choose is not top_k_chooser
               else "streams its PLE tables in pages" if model.paged
               else "is split over tensor-parallel ranks (eager steps only, for now)" if model.ranks is not None
               else f"has stages that read positions on the host ({', '.join(sorted(set(host)))})")
        raise InvalidInput(f"decode={decode!r} runs fast mode with the spec's top-k; this model {why} "
                           f"(use decode='eager')")
    if decode == "graph" and model.device.type != "cuda":
        raise InvalidInput(f"decode='graph' captures CUDA graphs; this model is on {model.device} "
                           f"(use 'planned' or 'eager')")
    return decode


def capture(plan, pool=None):
    """Capture `plan()` as a CUDA graph (in memory pool `pool`, if given), one capture at a time
    in the process and confined to this thread -> (graph, None), or (None, why) when it cannot
    be captured at all (the steps then stay uncaptured), or (None, None) when it was short of
    memory or budget this time (uncaptured this time only)."""
    graph = torch.cuda.CUDAGraph()
    try:
        with _CAPTURING, torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            plan()
    except Exception as exc:
        if out_of_memory(exc) or isinstance(exc, (Refused, ChunkAborted)):
            return None, None
        return None, f"{type(exc).__name__}: {exc}"
    return graph, None


def lanes_for(sessions: int) -> int:
    """The lanes a step of `sessions` sessions runs in: the next power of two up to 256, then
    the next multiple of 128."""
    return 1 << (sessions - 1).bit_length() if sessions <= 256 else -(-sessions // 128) * 128


def width_for(blocks: int, fine: bool = True) -> int:
    """The table width (in blocks) a step whose sessions need `blocks` runs with: at least 8,
    else the next multiple of a quarter of the power of two below (≤ 25% more than asked for),
    or, not `fine` (where no stage's work grows with the width), the next power of two (fewer
    graphs as sessions grow)."""
    if blocks <= 8:
        return 8
    step = 1 << max((blocks - 1).bit_length() - (3 if fine else 0), 0)
    return -(-blocks // step) * step


def fine_widths(model) -> bool:
    """Whether `model`'s planned steps take widths in quarter steps (some stage's work grows with
    the width) or in powers of two (none does)."""
    return any(getattr(stage, "reads_to_width", False) for stage in model.stages)


def step_key(pool, frontiers: list[int], length: int, each: bool, fine: bool = True) -> tuple:
    """What a planned step's graph is kept by: (lanes, tokens per lane, table width, prefix)."""
    need = max(frontiers) + length
    width = min(width_for(pool.blocks_for(need), fine), pool.blocks_for(pool.max_rows))
    return lanes_for(len(frontiers)), length, width, each


@dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    captured: Captured               # the captured step's device work: checks, completion, peak


_UNFILLED = object()         # a lane's row of tables before its first fill


class Inputs:
    """The device buffers of one key's planned step, and the pinned host buffer they are copied
    from in one transfer: ids and positions [lanes * length], parities and slots [lanes],
    tables [lanes, width], and each token's block and row in it [lanes * length] (where its rows
    go: read from the tables here, once, rather than by every owner's write on the device)."""

    def __init__(self, pool, lanes: int, length: int, width: int, each: bool):
        self.pool, self.lanes, self.length, self.width = pool, lanes, length, width
        n = lanes * length
        sizes = (n, n, lanes, lanes, lanes * width, n, n)
        cuda = pool.device.type == "cuda"
        self.host = torch.zeros(sum(sizes), dtype=torch.int64, pin_memory=cuda)
        self.device = self.host.to(pool.device) if cuda else self.host
        ids, positions, parities, slots, tables, blocks, offsets = self.device.split(sizes)
        self.step = StepBatch.lanes(ids, positions, (length,) * lanes, parities, slots,
                                    tables.view(lanes, width), blocks, offsets, each)
        self._views = [v.numpy() for v in self.host.split(sizes)]
        self._views[4] = self._views[4].reshape(lanes, width)
        self._steps = np.arange(length)
        self._lane_of = np.repeat(np.arange(lanes), length)       # each token's lane
        self._rows: list = [_UNFILLED] * lanes     # the table each lane's row of `tables` holds now

    def fill(self, lanes: list, ids) -> None:
        """Lane i from `ids` [n * length] and lanes[i]: (frontier, parity, slot, table), or
        None for padding (a session that failed already); the lanes past them are padding."""
        host_ids, positions, parities, slots, tables, blocks, offsets = self._views
        pool, width, n = self.pool, self.width, len(lanes)
        live = [lane if lane is not None else (0, 0, pool.spare_slot, None) for lane in lanes]
        host_ids[:] = 0
        host_ids[:len(ids)] = ids
        frontiers = np.zeros(self.lanes, dtype=np.int64)
        frontiers[:n] = [lane[0] for lane in live]
        positions.reshape(self.lanes, self.length)[:] = frontiers[:, None] + self._steps
        parities[:] = 0
        parities[:n] = [lane[1] for lane in live]
        slots[:] = pool.spare_slot
        slots[:n] = [lane[2] for lane in live]
        # each table's blocks, then the zero block up to the width (padding: the scratch block);
        # a lane's row is rewritten only when its table is another (tables are tuples, replaced
        # when they change, and held here, so the same object is the same blocks)
        for i in range(self.lanes):
            table = live[i][3] if i < n else None
            if self._rows[i] is table:
                continue
            if table is None:
                tables[i] = pool.scratch_block
            else:
                k = min(len(table), width)
                tables[i, :k] = table[:k]
                tables[i, k:] = pool.zero_block
            self._rows[i] = table if table is None or type(table) is tuple else _UNFILLED
        blocks[:] = tables[self._lane_of, positions // pool.block_rows]
        offsets[:] = positions % pool.block_rows
        if self.device is not self.host:
            self.device.copy_(self.host, non_blocking=True)


class Steps:
    """Planned steps of any sessions of one model: `run` takes a list of sessions' images and
    budgets, `length` token ids each (`each`: a prefix transaction, one session), and concludes
    the step's transaction as the caller says. `capture=False` runs the plan without a graph
    (any device): the same work, launched op by op."""

    def __init__(self, model, capture: bool):
        self.model, self.capture = model, capture
        self.graphs: dict[tuple, _Graph] = {}
        self.inputs: dict[tuple, Inputs] = {}
        self.warm: set[tuple] = set()            # keys run from the plan at least once
        self.captures = 0                        # graphs captured so far (for tests and bench)
        self.replays = 0                         # steps run from a captured graph
        self.uncaptured = 0                      # steps run from the plan op by op
        self.refused: str | None = None          # why capture failed, if it did: plan runs uncaptured
        self._lock = threading.Lock()
        self._memory = None                      # the graphs' one memory pool
        self.fine = fine_widths(model)

    @staticmethod
    def accepts(length: int) -> bool:
        """Whether a step of `length` tokens per session can run from the plan: no fault armed."""
        return length >= 1 and not faults.armed()

    def key(self, images, length: int, each: bool) -> tuple:
        return step_key(self.model.pool, [image.public.frontier for image in images], length, each, self.fine)

    def run(self, images, budgets, ids, length: int, each: bool, conclude):
        """One step: `conclude(txn, work)` runs `work()` (the step's device work) and finishes
        the transaction (validation, publication) -> what it returns."""
        key = self.key(images, length, each)
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        with self._lock:
            inputs = self.inputs.get(key)
            if inputs is None:
                inputs = self.inputs[key] = Inputs(self.model.pool, key[0], length, key[2], each)
            held = self.graphs.get(key)
            if held is None and self.capture and self.refused is None and key in self.warm:
                held = self._capture(key, inputs, images, budgets, ids)
            if held is None:
                txn = self._transaction(images, budgets, length, each, inputs, ids=ids)

                def work() -> None:
                    self._stage(inputs, txn, ids)
                    self._plan(txn, inputs)
                    self.uncaptured += 1

                result = conclude(txn, work)
                self.warm.add(key)
                return result
            txn = self._transaction(images, budgets, length, each, inputs, held.captured, ids=ids)

            def replay() -> None:
                self._stage(inputs, txn, ids)
                held.graph.replay()
                txn.completion.record_replay()
                txn.admit_peaks()                   # on the host while the device runs the step
                self.replays += 1

            return conclude(txn, replay)

    def _plan(self, txn: Transaction, inputs: Inputs) -> None:
        txn.advance()
        with self.model.kernels.planned():      # the lanes' fused ops: a kernel for each width
            run_stages(self.model, txn, inputs.step, paced=False)     # (it holds the runner's lock)
        txn.checks.fold()

    def _stage(self, inputs: Inputs, txn: Transaction, ids) -> None:
        """The step's inputs where the plan reads them; rows past a frontier zeroed where an
        aborted chunk may have left anything there."""
        for p in txn.parts:
            p.image.clean_tails()
        inputs.fill([None if p.failure is not None else (p.frontier, p.record.bank, p.record.slot, p.table)
                     for p in txn.parts], ids)

    def _capture(self, key, inputs: Inputs, images, budgets, ids) -> _Graph | None:
        """Capture the plan of `key` with these sessions' inputs (their blocks taken, then given
        back: the step runs from the graph as any later one does)."""
        try:
            txn = self._transaction(images, budgets, key[1], key[3], inputs, ids=ids)
        except ChunkAborted:
            return None
        try:
            self._stage(inputs, txn, ids)
            if self._memory is None:
                self._memory = torch.cuda.graph_pool_handle()
            graph, self.refused = capture(lambda: self._plan(txn, inputs), self._memory)
            if graph is None or any(p.failure is not None for p in txn.parts):   # refused during capture
                return None
            self.captures += 1
            held = self.graphs[key] = _Graph(graph, txn.captured())
            return held
        finally:
            txn.abort()

    def _transaction(self, images, budgets, length: int, each: bool, inputs: Inputs,
                     template: Captured | None = None, ids=()) -> Transaction:
        """`ids`: the step's token ids, `length` a session (what a session's constraint takes)."""
        return transaction(self.model, images, budgets, [length] * len(images), each=each, lanes=inputs.step,
                           template=template, tokens=[ids[i * length:(i + 1) * length] for i in range(len(images))])
