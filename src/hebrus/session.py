"""Session: one conversation's state and the plain loop that runs a chunk as a transaction.

    begin -> for each stage: run, injection point, seal -> validate -> publish

Input is checked before anything begins; any failure after that raises a `ChunkAborted` and
publishes nothing.
"""
from __future__ import annotations

import threading
from typing import Iterator

import numpy as np
import torch

from hebrus import faults
from hebrus.errors import AllocationError, ChunkAborted, InvalidInput, StructuralError
from hebrus.sampling import sample
from hebrus.state.budget import MemoryBudget, Refused
from hebrus.state.image import Image
from hebrus.state.txn import Transaction

_OOM = (MemoryError, getattr(torch, "OutOfMemoryError", MemoryError))


class Session:
    def __init__(self, model, memory_budget: int | None = None):
        if memory_budget is not None and (not isinstance(memory_budget, int) or memory_budget < 1):
            raise ValueError(f"memory_budget must be a positive number of bytes or None, got {memory_budget!r}")
        self.model = model
        self.config = model.config
        self.image = Image(model.owners, model.device)
        self.budget = MemoryBudget(memory_budget)
        try:
            self.budget.hold(self.image.bank_bytes, "the session's two banks")
        except Refused as exc:
            raise ValueError(f"memory_budget too small for a session of this model: {exc}") from None
        self._stage_names = model.stage_names
        self._lock = threading.Lock()           # one transaction at a time per session

    # ---- reading the public image ----------------------------------------------------------
    @property
    def frontier(self) -> int:
        return self.image.public.frontier

    def digest(self) -> str:
        return self.image.digest()

    @property
    def logits(self) -> torch.Tensor:
        """A copy of the last committed token's logits."""
        return self.image.read("logits").clone()

    # ---- transactions ----------------------------------------------------------------------
    def feed(self, ids, out: torch.Tensor | None = None) -> torch.Tensor:
        """Run one chunk as one transaction; return the last position's logits (a new tensor,
        or `out`, which is written only if the chunk publishes)."""
        chunk = self._ids(ids)
        self._check_room(len(chunk))
        self._check_out(out)
        self._check_faults()
        self._run(chunk, out)
        return out if out is not None else self.logits

    def prefill(self, ids, chunk_size: int = 64) -> torch.Tensor:
        """Feed `ids` in chunks of `chunk_size`, one transaction each. If a chunk fails, the
        error's `.published` says how many tokens of this call were published before it."""
        _check_chunk_size(chunk_size)
        tokens = self._ids(ids)
        self._check_room(len(tokens))
        self._check_faults()
        for begin in range(0, len(tokens), chunk_size):
            try:
                self._run(tokens[begin:begin + chunk_size], None)
            except ChunkAborted as exc:
                exc.with_published(begin)
                raise
        return self.logits

    def generate(self, ids=(), max_new_tokens: int = 32, temperature: float = 0.0,
                 top_p: float = 1.0, seed: int = 0, chunk_size: int = 64) -> Iterator[int]:
        """Prefill `ids` (may be empty once the session holds tokens), then sample and commit one
        token per transaction. Arguments are checked now; tokens come as you iterate."""
        prompt = self._ids(ids, allow_empty=self.frontier > 0)
        _check_chunk_size(chunk_size)
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise InvalidInput(f"seed must be an integer, got {seed!r}")
        if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
            raise InvalidInput(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}")
        if not (isinstance(temperature, (int, float)) and temperature >= 0):
            raise InvalidInput(f"temperature must be >= 0, got {temperature!r}")
        if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
            raise InvalidInput(f"top_p must be in (0, 1], got {top_p!r}")
        self._check_room(len(prompt) + max_new_tokens)
        return self._generate(prompt, max_new_tokens, float(temperature), float(top_p), seed, chunk_size)

    def _generate(self, prompt, max_new_tokens, temperature, top_p, seed, chunk_size):
        logits = self.prefill(prompt, chunk_size) if len(prompt) else self.logits
        generator = torch.Generator().manual_seed(seed)
        for _ in range(max_new_tokens):
            token = sample(logits, temperature, top_p, generator)
            logits = self.feed([token])
            yield token

    def _run(self, ids: torch.Tensor, out: torch.Tensor | None) -> None:
        with self._lock:
            self._transact(ids, out)

    def _transact(self, ids: torch.Tensor, out: torch.Tensor | None) -> None:
        txn = Transaction(self.image, len(ids), self._stage_names, self.budget,
                          max_rows=self.config.max_context)
        txn.local["ids"] = ids.to(self.model.device)
        try:
            for slot, stage in enumerate(self.model.stages):
                txn.enter(slot)
                try:
                    stage.run(txn)
                    faults.after(stage.name, txn)
                    txn.seal()
                except ChunkAborted:
                    raise
                except _OOM as exc:
                    raise AllocationError(stage.name, f"{type(exc).__name__}: {exc}") from exc
                except Exception as exc:
                    raise StructuralError(stage.name, f"{type(exc).__name__}: {exc}") from exc
            txn.validate()
            txn.publish(out)
        finally:
            txn.abort()

    # ---- input checks (before anything is touched) -----------------------------------------
    def _ids(self, ids, allow_empty: bool = False) -> torch.Tensor:
        tokens = _as_int64(ids)
        if tokens.numel() == 0 and not allow_empty:
            raise InvalidInput("empty chunk: give at least one token id")
        vocab = self.config.vocab_size
        if tokens.numel() and not (0 <= int(tokens.min()) and int(tokens.max()) < vocab):
            i = int(((tokens < 0) | (tokens >= vocab)).nonzero()[0, 0])
            raise InvalidInput(f"token id {int(tokens[i])} at index {i} is outside the vocabulary [0, {vocab})")
        return tokens

    def _check_room(self, count: int) -> None:
        limit = self.config.max_context
        if self.frontier + count > limit:
            raise InvalidInput(f"{count} more tokens would take the session to {self.frontier + count}, past its "
                               f"context limit of {limit} ({limit - self.frontier} tokens left)")

    def _check_out(self, out) -> None:
        if out is None:
            return
        want = (self.config.vocab_size,)
        if not isinstance(out, torch.Tensor):
            raise InvalidInput(f"out must be a torch.Tensor of shape {want}, got {type(out).__name__}")
        if tuple(out.shape) != want or out.dtype != self.model.dtype or out.device != self.model.device:
            raise InvalidInput(f"out must have shape {want}, dtype {self.model.dtype} and device "
                               f"{self.model.device}; got {tuple(out.shape)}, {out.dtype}, {out.device}")

    def _check_faults(self) -> None:
        unknown = [f.stage for f in faults.armed() if f.stage not in self._stage_names]
        if unknown:
            raise InvalidInput(f"fault armed for unknown stage {unknown[0]!r}; stages are: "
                               + ", ".join(self._stage_names))


def _check_chunk_size(chunk_size) -> None:
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise InvalidInput(f"chunk_size must be a positive integer, got {chunk_size!r}")


def _as_int64(ids) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a list/tuple of ints, an integer tensor or an integer array."""
    if isinstance(ids, (str, bytes)):
        raise InvalidInput("token ids expected, got text; encode it first (hebrus.tokenizer.encode)")
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise InvalidInput(f"token ids must be integers, got an array of dtype {ids.dtype}")
        ids = torch.from_numpy(ids.astype(np.int64))
    if isinstance(ids, torch.Tensor):
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise InvalidInput(f"token ids must be integers, got a tensor of dtype {ids.dtype}")
        if ids.dim() != 1:
            raise InvalidInput(f"token ids must be one-dimensional, got shape {tuple(ids.shape)}")
        return ids.detach().to(device="cpu", dtype=torch.int64)
    if not isinstance(ids, (list, tuple, range)):
        raise InvalidInput(f"token ids must be a list of ints or an integer tensor, got {type(ids).__name__}")
    for i, x in enumerate(ids):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise InvalidInput(f"token ids must be integers; item {i} is {x!r}")
    try:
        return torch.tensor(list(ids), dtype=torch.int64)
    except (OverflowError, RuntimeError, ValueError) as exc:
        raise InvalidInput(f"token ids must fit in int64: {exc}") from None
