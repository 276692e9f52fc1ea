"""Device-side checks, read back once per chunk, and completion records. Both are kept per cell:
a number the caller chooses (a transaction's cells are its stages' indices)."""
from __future__ import annotations

import enum
import functools
import math

import numpy as np
import torch

from hebrus.uploads import upload


class Status(enum.IntFlag):
    """The bit of a status word the seam sets itself. The other bits are the checks of the
    stages it runs (the layers' `Check`), named by whoever builds the transaction."""
    INJECTED = 1 << 30        # set by fault injection, through the same `flag` op


def describe(word: int, checks: type[enum.Flag]) -> str:
    """The bits set in a status word by name, lowest first: the seam's own and those of `checks`
    (the flag class of the stages' bits); the word in hex when none of them is set."""
    bits = sorted((*checks, *Status), key=lambda flag: flag.value)
    return ", ".join(flag.name.lower() for flag in bits if word & flag) or f"0x{word:x}"


class DeviceChecks:
    """Values computed on the device while a transaction runs, read back once by `validate`.

    Nothing here synchronises until `read`. A status check records one device reduction: `flag`
    the any() of a boolean tensor, `check_range` the min and max of an index tensor (the bounds
    are compared on the host once the values are back). A finite check records the largest
    magnitude of each written tensor (one multi-tensor reduction per call): any NaN or Inf makes
    it non-finite, and no finite value can. With `defer` (a planned step, whose writes are small
    and stay alive), finite checks wait for `fold`, which reduces every write of the chunk in
    one go. `read` brings everything back in one transfer and folds it into a status word per
    cell and the set of cells with a non-finite write.

    In a step of several sessions (`lengths`: each one's tokens), every value is kept per
    session: a tensor is reduced per session by its first dimension (T rows: each session its
    own tokens'; N rows: row i session i's; anything else concerns every session), a finite
    check's tensor also by the session named beside it (a session's rows). A finite check of a
    tensor of T rows takes each row's largest magnitude in the tensor's dtype, and each session
    the float64 sum of its rows' (non-finite exactly when a value is: float64 does not overflow on
    finite 16- or 32-bit values), all such tensors of a step summed by session in one addition when
    folded (a float64 sum of each tensor per session, and its own scatter, cost a 64-prompt pass on
    an H100 some 300 launches and a float64 copy of every tensor). Tensors of N
    rows are reduced together instead: those of one dtype and row length stacked, the least and
    largest value of each session's rows (both finite exactly when every value is; a step of a
    token each writes a hundred such tensors, and a launch each, with float64's cast, cost more
    than the step's attention); a non-finite result is then traced to its tensors by `read`,
    from the tensors themselves, which the checks keep. `read` gives each session its own.
    (Reading a tensor's rows as tensors of their own instead, all in one multi-tensor launch,
    costs more: each row's result is a launch of its own.)
    """

    def __init__(self, defer: bool = False, lengths: list[int] | None = None, device: torch.device | None = None):
        self.defer = defer
        self.lengths = lengths or [1]
        self.sessions, self.tokens, self.device = len(self.lengths), sum(self.lengths), device
        self._of_token: torch.Tensor | None = None     # each token's session (a ragged step's)
        self.reset()

    def reset(self) -> None:
        self._status: list[torch.Tensor] = []
        self._tests: list[tuple[int, int, object]] = []      # (cell, bit, bound test)
        self._finite: list[torch.Tensor] = []                # one session: a vector per launch; several: [N] each
        self._finite_cells: list[int] = []
        self._pending: list[tuple[torch.Tensor, int | None]] = []
        self._pending_cells: list[int] = []
        self._named: list[torch.Tensor] = []                 # several sessions': magnitudes of tensors named for one
        self._named_at: list[tuple[int, int]] = []           # (cell, session) of each
        self._rows: list[tuple[torch.Tensor, int]] = []      # (tensor of N rows, cell): reduced together
        self._token_rows: list[tuple[torch.Tensor, int]] = []    # (a tensor of T rows' row magnitudes, cell)
        self._row_groups: list[list[tuple[torch.Tensor, int]]] = []   # the same by dtype and row, once folded
        self._folded: torch.Tensor | None = None
        self._bounds: tuple[np.ndarray, np.ndarray] | None = None     # each test's kind and bound, as arrays

    def flag(self, cell: int, bad: torch.Tensor, bit: int) -> None:
        self._status.append(self._each(bad, "any"))
        self._tests.append((cell, int(bit), None))

    def check_range(self, cell: int, values: torch.Tensor, upper: int, bit: int, lower: int | None = 0) -> None:
        """Set `bit` unless every value lies in [lower, upper) (lower=None: no lower bound).
        Values are indices: a floating-point NaN would compare as in range."""
        if values.is_floating_point():
            raise TypeError(f"range checks take integer indices, not {values.dtype}")
        if not values.numel():
            return
        if lower is not None:
            if self.sessions == 1:
                low, high = torch.aminmax(values)
            elif values.dim() and values.shape[0] == self.sessions:   # a row each: both bounds in one reduction
                low, high = torch.aminmax(values.reshape(self.sessions, -1), dim=1)
            else:
                low, high = self._each(values, "min"), self._each(values, "max")
            self._status.append(low)
            self._tests.append((cell, int(bit), ("below", lower)))
        else:
            high = self._each(values, "max")
        self._status.append(high)
        self._tests.append((cell, int(bit), ("at_least", upper)))

    def finite(self, cell: int, written: list[tuple[torch.Tensor, int | None]]) -> None:
        """Check that every floating-point tensor written is finite (fp8 codes, which have no
        infinity and no reduction of their own, through the scales written beside them).
        `written`: (tensor, the session it belongs to, or None: by its first dimension)."""
        written = [(t, i) for t, i in written if t.is_floating_point() and t.numel() and t.element_size() > 1]
        if self._folded is not None and written:
            raise RuntimeError("a finite check after the checks were folded would not be read (reset first)")
        if self.defer:
            self._pending += written
            self._pending_cells += [cell] * len(written)
        elif written:
            self._magnitudes(written, [cell] * len(written))

    def _magnitudes(self, written: list[tuple[torch.Tensor, int | None]], cells: list[int]) -> None:
        """One session's: the largest magnitude of each tensor, one multi-tensor launch per
        dtype. Several sessions': a tensor named for a session, its largest magnitude (all of
        these together, one multi-tensor launch per dtype); any other tensor by its first
        dimension (a session's row, or a token's rows) gives a value per session, the float64 sum
        of its rows (a sum is non-finite exactly when a value is: float64 does not overflow on
        finite 16- or 32-bit values), one launch."""
        if self.sessions == 1:
            order, vectors = _norms([t for t, _ in written])
            self._finite += vectors
            self._finite_cells += [cells[i] for i in order]
            return
        named = []
        for (t, i), cell in zip(written, cells):
            if i is not None:
                named.append((t, i, cell))
            elif t.dim() and t.shape[0] == self.sessions:
                self._rows.append((t, cell))
            elif t.dim() and t.shape[0] == self.tokens and _row_norm_keeps_nan(t.device):
                # each row's largest magnitude, in the tensor's dtype (no float64 copy of the
                # tensor), added up by session for all such tensors at once when folded
                self._token_rows.append((_row_magnitudes(t.reshape(self.tokens, -1)), cell))
            else:
                self._finite.append(self._each(t, "sum"))
                self._finite_cells.append(cell)
        order, vectors = _norms([t for t, _, _ in named])
        self._named += vectors
        self._named_at += [(named[j][2], named[j][1]) for j in order]

    def _token_sessions(self, device: torch.device) -> torch.Tensor:
        """Each token's session (a ragged step's; made on first use, never inside a capture), on
        the checks' device, else on `device` (the values' it indexes)."""
        if self._of_token is None:
            self._of_token = upload(torch.repeat_interleave(torch.arange(self.sessions), torch.tensor(self.lengths)),
                                    torch.int64, self.device if self.device is not None else device)
        return self._of_token

    def _each(self, t: torch.Tensor, how: str) -> torch.Tensor:
        """`t` reduced ("any", "min", "max", or "sum" in float64): a scalar for one session, else
        [N] by its first dimension."""
        N = self.sessions
        if N == 1 or t.dim() == 0 or t.shape[0] not in (N, self.tokens):
            whole = _REDUCE[how](t.reshape(1, -1))[0]
            return whole if N == 1 else whole.reshape(1).expand(N)
        per = _REDUCE[how](t.reshape(t.shape[0], -1))
        if t.shape[0] == N:
            return per
        start = {"any": 0.0, "sum": 0.0, "min": float("inf"), "max": float("-inf")}[how]
        out = torch.full((N,), start, dtype=torch.float64, device=t.device)
        return out.scatter_reduce(0, self._token_sessions(t.device), per.to(torch.float64),
                                  {"any": "amax", "sum": "sum", "min": "amin", "max": "amax"}[how])

    def _by_session(self, token_rows: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
        """Row magnitudes [T] of several tensors -> [G, N] float64, each session's sum of its
        rows' (non-finite exactly when one is: they are not negative, and float64 does not
        overflow on finite 16- or 32-bit values), flattened; their cells go after the finite
        checks' so far. One stack and one cast per dtype, one addition by session for all."""
        groups: dict[torch.dtype, list[int]] = {}
        for i, (rows, _) in enumerate(token_rows):
            groups.setdefault(rows.dtype, []).append(i)
        order = [i for members in groups.values() for i in members]
        stacked = torch.cat([torch.stack([token_rows[i][0] for i in members]).to(torch.float64)
                             for members in groups.values()])
        sums = torch.zeros((len(order), self.sessions), dtype=torch.float64, device=stacked.device)
        sums.index_add_(1, self._token_sessions(stacked.device), stacked)
        self._finite_cells += [token_rows[i][1] for i in order]
        return sums.reshape(-1)

    def fold(self) -> torch.Tensor | None:
        """Every recorded value in one float64 device tensor (a device op: a captured step folds
        inside its graph, and each replay refills the same tensor)."""
        if self._folded is None:
            if self._pending:
                self._magnitudes(self._pending, self._pending_cells)
                self._pending, self._pending_cells = [], []
            if self._token_rows:
                self._finite.append(self._by_session(self._token_rows))
                self._token_rows = []
            groups: dict[tuple, list[tuple[torch.Tensor, int]]] = {}
            for t, cell in self._rows:
                groups.setdefault((t.dtype, t.numel() // self.sessions), []).append((t, cell))
            self._row_groups = list(groups.values())
            rows = [_least_largest([t.reshape(self.sessions, -1) for t, _ in group]) for group in self._row_groups]
            parts = [joined(group) for group in (self._status, self._finite, rows, self._named) if group]
            self._folded = torch.cat(parts) if parts else None
        return self._folded

    def read(self, live: int | None = None) -> list[tuple[dict[int, int], set[int]]]:
        """One device-to-host transfer -> per session ({cell: status word}, {cells with a
        non-finite write}). `live`: how many sessions (lanes) come first whose results are read
        (a planned step's padding lanes after them: a non-finite value there is not traced)."""
        folded = self.fold()
        values = folded.cpu().numpy() if folded is not None else np.zeros(0)
        N, k, f = self.sessions, len(self._tests), len(self._finite_cells)
        out: list[tuple[dict[int, int], set[int]]] = [({}, set()) for _ in range(N)]
        if k:
            if self._bounds is None or len(self._bounds[0]) != k:      # a replay's tests are the captured ones
                self._bounds = (np.array([0 if t is None else 1 if t[0] == "below" else 2 for _, _, t in self._tests])[:, None],
                                np.array([0 if t is None else t[1] for _, _, t in self._tests], dtype=np.float64)[:, None])
            kinds, bounds = self._bounds
            status = values[:k * N].reshape(k, N)
            failed = np.where(kinds == 0, status != 0, np.where(kinds == 1, status < bounds, status >= bounds))
            for j, i in zip(*np.nonzero(failed)):
                cell, bit, _ = self._tests[j]
                out[i][0][cell] = out[i][0].get(cell, 0) | bit
        finite = values[k * N:k * N + f * N].reshape(f, N)
        for j, i in zip(*np.nonzero(~np.isfinite(finite))):
            out[i][1].add(self._finite_cells[j])
        g = len(self._row_groups)
        rows = values[(k + f) * N:(k + f + 2 * g) * N].reshape(g, 2, N)      # each group's lows, highs
        for j, i in zip(*np.nonzero(~np.isfinite(rows).all(1))):
            if live is None or i < live:
                out[i][1].update(self._located(j, i))
        named = values[(k + f + 2 * g) * N:]
        for j in np.nonzero(~np.isfinite(named))[0]:
            cell, i = self._named_at[j]
            out[i][1].add(cell)
        return out

    def _located(self, group: int, session: int) -> set[int]:
        """The cells whose tensors in row group `group` hold a non-finite value in `session`'s
        row (a failure's second look, one transfer a tensor); every cell of the group if none
        does any longer."""
        members = self._row_groups[group]
        cells = {cell for t, cell in members if not bool(torch.isfinite(t[session]).all())}
        return cells or {cell for _, cell in members}


def joined(values: list[torch.Tensor]) -> torch.Tensor:
    """Tensors -> one float64 vector of their values, in order (each flattened): each run of one
    dtype joined in one copy, then cast. (One stack across dtypes copied every value with a kernel
    of its own: 147 of a decode step's 463 launches on the 1.68B shape, traced on an H100.)"""
    pieces, start = [], 0
    for end in range(1, len(values) + 1):
        if end < len(values) and values[end].dtype == values[start].dtype:
            continue
        pieces.append(torch.cat([v.reshape(-1) for v in values[start:end]]).to(torch.float64))
        start = end
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _least_largest(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Tensors [N, L] of one dtype and L -> [2, N]: the least and the largest value of each row
    over all of them (a NaN in a row makes both NaN). Stacked one after another, each a dense
    block of the copy (side by side, each row's pieces apart, the copy ran at a fiftieth of the
    bandwidth on an H200), then every row of every tensor reduced along its own values, one
    contiguous row each (reducing the stack over its first and last dimensions at once took 28
    µs a group of a few MB at 8 sessions on an H200, twice), and the tensors' results last."""
    stacked = tensors[0] if len(tensors) == 1 else torch.stack(tensors)       # [N, L] or [G, N, L]
    low, high = torch.aminmax(stacked.reshape(-1, stacked.shape[-1]), dim=1)
    if len(tensors) > 1:
        low, high = low.view(len(tensors), -1).amin(0), high.view(len(tensors), -1).amax(0)
    return torch.stack((low, high))


_REDUCE = {                     # each row of a [rows, values] tensor -> [rows]
    "any": lambda rows: rows.any(1),
    "min": lambda rows: rows.amin(1),
    "max": lambda rows: rows.amax(1),
    "sum": lambda rows: rows.sum(1, dtype=torch.float64),
}


def _norms(tensors: list[torch.Tensor]) -> tuple[list[int], list[torch.Tensor]]:
    """The largest magnitude of each tensor (a NaN or Inf makes it non-finite), one multi-tensor
    launch per dtype (the ∞-norm; on the CPU the max of the absolute values): the fused route
    takes dense tensors of one dtype (any other mix falls back to a launch per tensor). ->
    (the tensors' indices in the order of the results, a vector of results per launch): each
    launch's results stacked in one copy of one dtype."""
    groups: dict[object, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype if t.is_contiguous() else i, []).append(i)
    order, vectors = [], []
    for members in groups.values():
        group = [tensors[i] for i in members]
        device = group[0].device
        if device.type == "cpu" and _max_keeps_nan():
            # the same largest magnitudes: on the CPU the ∞-norm is not vectorised, and the max of
            # the absolute values ran 7x faster over a 256-token chunk's writes (1.5 ms a stage)
            norms = torch._foreach_max(torch._foreach_abs(group))
        elif _norm_keeps_nan(device):
            norms = torch._foreach_norm(group, math.inf)
        else:                           # float64: no finite 16- or 32-bit values overflow it
            norms = [t.sum(dtype=torch.float64) for t in group]
        order += members
        vectors.append(torch.stack(list(norms)))
    return order, vectors


@functools.cache
def _max_keeps_nan() -> bool:
    """Whether this torch has a multi-tensor max on the CPU that carries a NaN through (probed
    once); else the CPU takes the ∞-norm too."""
    probe = [torch.tensor([1.0, float("nan"), 2.0])]
    return hasattr(torch, "_foreach_max") and bool(torch._foreach_max(torch._foreach_abs(probe))[0].isnan())


_KEEPS_NAN: dict[tuple[str, str], bool] = {}     # (reduction, device type) -> whether a NaN comes through


def _keeps_nan(name: str, device: torch.device, reduce) -> bool:
    """Whether `reduce(probe)` of a probe holding a NaN (first row or vector) gives a NaN on this
    kind of device; probed once per reduction and device type."""
    key = (name, device.type)
    if key not in _KEEPS_NAN:
        probe = torch.tensor([[1.0, float("nan"), 2.0], [1.0, 2.0, 3.0]], device=device)
        _KEEPS_NAN[key] = bool(reduce(probe)[0].isnan())
    return _KEEPS_NAN[key]


def _row_magnitudes(rows: torch.Tensor) -> torch.Tensor:
    """[R, L] -> each row's largest magnitude [R], in its dtype (non-finite exactly when a value
    of the row is): the ∞-norm along the rows, one launch with no copy, on a GPU; the max of the
    absolute values on the CPU, where the norm is not vectorised (7x slower over 100 tensors of
    256 x 1024)."""
    if rows.device.type == "cpu":
        return rows.abs().amax(1)
    return torch.linalg.vector_norm(rows, math.inf, dim=1)


def _row_norm_keeps_nan(device: torch.device) -> bool:
    """Whether `_row_magnitudes` carries a NaN through on this kind of device; where it does not,
    a tensor's rows are summed in float64."""
    return _keeps_nan("rows", device, lambda probe: _row_magnitudes(probe.bfloat16()))


def _norm_keeps_nan(device: torch.device) -> bool:
    """Whether this torch's multi-tensor ∞-norm carries a NaN through on this kind of device
    (older CUDA builds took a plain max, which drops it). Where it does not, each tensor is
    summed instead: a NaN or Inf always makes a sum non-finite."""
    return _keeps_nan("norm", device, lambda probe: torch._foreach_norm([probe[0]], math.inf))


class Completion:
    """Completion records, one per cell (a stage). On CUDA each is an event; on the CPU work is
    synchronous, so a record is complete unless something marked it otherwise. A captured step (a CUDA
    graph) records no event per stage: one event after each replay stands for all of them, and
    when it has not completed the step's first stage is reported, since a graph cannot say which
    of its stages did not finish."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.records: list[tuple[int, object]] = []
        self.failed: set[int] = set()
        self.replay: object = None

    def record(self, cell: int) -> None:
        event = None
        if self.cuda and not torch.cuda.is_current_stream_capturing():
            event = torch.cuda.Event()
            event.record()
        self.records.append((cell, event))

    def record_replay(self) -> None:
        """After a replay of a captured step: the one event that covers its stages."""
        self.replay = torch.cuda.Event()
        self.replay.record()

    def restart(self) -> None:
        """A replay of the same records: nothing marked incomplete yet."""
        self.failed.clear()
        self.replay = None

    def mark_incomplete(self, cell: int) -> None:
        self.failed.add(cell)

    def first_incomplete(self) -> int | None:
        """Cell of the first record whose work did not complete; call after the device sync.
        Work on one stream completes in order, so when nothing was marked and the last record
        completed, so did every earlier one: one query, not one per stage."""
        if self.replay is not None and not _complete(self.replay):
            return self.records[0][0] if self.records else 0
        if not self.failed and self.records and _complete(self.records[-1][1]):
            return None
        for cell, event in self.records:
            if cell in self.failed or not _complete(event):
                return cell
        return None


def _complete(event) -> bool:
    if event is None:
        return True
    try:
        return bool(event.query())
    except RuntimeError:
        return False
