"""Pure ops compiled into fused kernels for the CUDA fast path (torch.compile: inductor writes
one Triton kernel where eager torch launches one per elementwise step). The op itself is the
readable twin: the compiled one computes the same function, rounded differently, but always the
same way for the same inputs.

A decode step is hundreds of small ops; launched one by one, even from a CUDA graph, their
count rather than the bytes they move sets its time. An op compiles on first use for each new
shape signature, which is why a planned step runs uncaptured before it is captured. Within a
planned step (`planned()`: the lanes of a decode step, a few widths the server's warm-up meets
all of), rows that are a power of two up to STATIC_ROWS get a kernel made for exactly their
shape; every other call (a prompt's pass, its pieces between a prefix cache's marks, the rows of
several sessions' chunks together: lengths without end) shares a kernel in which the rows are
symbolic and the model's widths and numbers are constants (a slice's row stride and storage
offset stay symbolic too: a few entries apart by layout, and by rows fewer than a conv's taps).
An op marked `any_rows` (its shapes vary with more than the rows: a pass of several sessions')
always takes the shared kernel. An op's `fresh` arguments (by position: a state read where its
slot lies, stacked from several sessions', or left by a piece before) are given to the compiled
form as tensors of their own, contiguous, so that where the value came from never makes the
compiler's guards fail (each failure compiled the op again, seconds, while every request waited).
Set HEBRUS_FUSE=0 to run every op unfused. If compiling an op fails, it warns once and that op
runs unfused in this process from then on (the compiled form is shared by every model).
"""
from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Callable

import torch
import torch._dynamo
from torch.fx.experimental import _config as fx_config

_fused: dict[Callable, "_Fused"] = {}

# Each op is compiled once per shape signature and model dtype, and a process may hold several
# models: allow more than the compiler's default eight versions per op before it gives up (both
# forms below count against it: every lanes' row count is a version of its own).
RECOMPILES = 256

# A kernel made for every length is tuned for the first one it meets: after a prefill of 2048 rows,
# a reduction over 64 rows ran in one block of the whole GPU (13.9 us against 1.8 us for a kernel
# made for 64 rows, on an H200). A planned step's lanes of a power of two of rows up to this many
# (a few shapes per op) get a kernel of their own. Not a prompt's pass: a server met powers of two
# there that its warm-up had not (a pass of pieces, several sessions' chunks adding up to one),
# and each compiled while every request waited.
STATIC_ROWS = 512

# The shared form's compiler options: the default, named, because torch.compile lets calls whose
# compilers compare equal share compiled code, and the shared form's kernel (rows symbolic) would
# then answer the static form's calls too, or the other way round, by which came first.
SHARED = {"triton.cudagraphs": False}


def _chained(options: dict) -> dict | None:
    """`options`, with the kernels made to launch as a chain where a step's kernels do
    (`ops.cuda.chain`) and this torch's compiler can; None for none."""
    try:
        from hebrus.ops.cuda.chain import WANTED
    except ImportError:                 # no Triton (ops compiled for the CPU): nothing launches so
        return options or None
    import torch._inductor.config
    if WANTED and hasattr(torch._inductor.config.triton, "enable_pdl"):
        return {**options, "triton.enable_pdl": True}
    return options or None


def enabled() -> bool:
    return os.environ.get("HEBRUS_FUSE", "1") != "0"


def fused(op: Callable) -> Callable:
    """The compiled form of `op` (one per op, shared by every layer that runs it)."""
    got = _fused.get(op)
    if got is None:
        got = _fused[op] = _Fused(op)
    return got


_thread = threading.local()


def _configure() -> None:
    """The compiler's settings fused ops need, in the calling thread (where torch keeps them per
    thread, one set elsewhere would not reach it: an engine thread compiling under the default
    limit of eight versions ran every later shape of an op unfused)."""
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), RECOMPILES))
    if hasattr(config, "accumulated_recompile_limit"):        # the compiler's cap over all of them
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * RECOMPILES)
    # symbolic strides and storage offsets each their own symbol, not tied to an equal size
    # (any other torch.compile in the thread sees it too)
    fx_config.use_duck_shape = False
    if _in_process:
        from torch._inductor import config as inductor_config
        inductor_config.compile_threads = 1
    _thread.configured = _settings


_in_process = False
_settings = 1          # raised when a setting changes: each thread configures itself again


def compile_in_process() -> None:
    """From now on fused ops compile in this process, not in the compiler's pool of worker
    processes: in this thread at once, in any other from its next fused op on."""
    global _in_process, _settings
    _in_process = True
    _settings += 1
    _configure()


@contextlib.contextmanager
def planned():
    """Within, in this thread, the fused ops run a planned step's lanes: a power of two of rows
    up to STATIC_ROWS gets a kernel of its own (`engine.graphs` runs its plans so)."""
    before = getattr(_thread, "planned", False)
    _thread.planned = True
    try:
        yield
    finally:
        _thread.planned = before


class _Fused:
    def __init__(self, op: Callable):
        self.op = op
        # rows symbolic from the first call: a kernel per op for every chunk length (lengths 0
        # and 1, and ranges a guard splits off, aside: each length always meets the same one),
        # never a kernel for the first length seen and another for the rest (with
        # the compiler's default, a shape met again after the switch ran the other kernel, rounded
        # otherwise, so the same chunk on the same state could give other bits). Only the rows:
        # with every size and number symbolic (`dynamic=True`) each index was divided by a width
        # known only at run time, and `gdn_inputs` over 8192 rows of the 1.68B shape took 901 us
        # on an H200 against 325 us made for that length (benchmarks/conv_prefill.py).
        self.compiled = torch.compile(op, fullgraph=True, dynamic=False, options=_chained(SHARED))
        self.static = torch.compile(op, fullgraph=True, dynamic=False, options=_chained({}))
        self.failed: str | None = None
        self.fresh, self.any_rows = getattr(op, "fresh", ()), getattr(op, "any_rows", False)

    def __call__(self, *args):
        if self.failed is None:
            if getattr(_thread, "configured", 0) != _settings:
                _configure()
            try:
                args = _fresh(args, self.fresh)
                if getattr(_thread, "planned", False) and static_shape(args) and not self.any_rows:
                    return self.static(*args)
                return self.compiled(*rows_symbolic(args))
            except Exception as exc:
                # only the compiler's own failures turn fusing off, and never one met while a
                # CUDA graph is captured (the capture fails and the step runs uncaptured)
                if torch.cuda.is_current_stream_capturing() or not _compiler_failure(exc):
                    raise
                self.failed = f"{type(exc).__name__}: {exc}"[:500]
                warnings.warn(f"hebrus: compiling {self.op.__name__} failed, running it unfused: {self.failed}",
                              RuntimeWarning, stacklevel=2)
        return self.op(*args)


def static_shape(args: tuple) -> bool:
    """Whether an op's call within a planned step gets a kernel made for its shape alone: its
    first argument (rows first, as every fused op takes them) has a power of two of rows up to
    STATIC_ROWS. A function of the shapes only, so the same shapes always run the same kernel in
    a planned step (and the shared one outside it: the two may round differently)."""
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        return False
    rows = first.shape[0]
    return 0 < rows <= STATIC_ROWS and rows & (rows - 1) == 0


def _fresh(args: tuple, which: tuple[int, ...]) -> tuple:
    """`args` with those at positions `which` copied to tensors of their own, contiguous (an
    op's `fresh` arguments: one layout, one storage offset and one kind of tensor, whatever
    their source, for the compiler's guards)."""
    if not which:
        return args
    return tuple(arg.clone(memory_format=torch.contiguous_format) if i in which and isinstance(arg, torch.Tensor)
                 else arg for i, arg in enumerate(args))


def rows_symbolic(args: tuple) -> tuple:
    """`args` with each tensor given as a view whose first dimension the compiler may keep
    symbolic (the caller's tensors stay unmarked). Every tensor's, whatever its size: which are
    marked is then a function of the op's arguments alone, never of a size that happens to equal
    the rows (the compiler keys its kernels on the marks). A weight's first dimension that meets
    a constant width (a norm's weight against its rows' features) becomes that constant again."""
    marked = []
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0:
            arg = arg.view(arg.shape)
            torch._dynamo.maybe_mark_dynamic(arg, 0)
        marked.append(arg)
    return tuple(marked)


def _compiler_failure(exc: Exception) -> bool:
    """An error of the compiler (dynamo or inductor) itself: not an error of the op it traced
    (raised again unfused, it is the op's error), nor an allocation failure anywhere in the chain."""
    if type(exc).__name__ == "TorchRuntimeError":
        return False
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, (MemoryError, torch.OutOfMemoryError)):
            return False
        cause = cause.__cause__
    module = type(exc).__module__ or ""
    return module.startswith(("torch._dynamo", "torch._inductor"))
