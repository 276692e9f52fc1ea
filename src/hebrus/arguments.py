"""Checks on what a caller passes, made before a transaction begins.

Each function either returns the value in the form the engine uses or raises `InvalidInput`
saying what was wrong and what is allowed. None of them reads session state; the checks that do
(room left in the context) run under the session lock.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from hebrus.errors import InvalidInput
from hebrus.show import shown

SEED_RANGE = (-(2**63), 2**64)        # what torch.Generator.manual_seed accepts
ID_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
             torch.uint16, torch.uint32, torch.uint64)


def token_ids(ids, max_tokens: int, what: str = "token ids") -> torch.Tensor:
    """A fresh 1-D int64 CPU tensor (never the caller's storage) from a list/tuple/range of
    ints, an integer tensor or an integer array, of at most `max_tokens` ids."""
    if isinstance(ids, (str, bytes, bytearray)):
        raise InvalidInput("token ids expected, got text; encode it first (hebrus.tokenizer.encode)")
    if not isinstance(ids, (list, tuple, range, np.ndarray, torch.Tensor)):
        raise InvalidInput(f"token ids must be a list of ints or an integer tensor, got {type(ids).__name__}")
    _check_length(ids, max_tokens, what)
    if isinstance(ids, np.ndarray):
        return _from_array(ids)
    if isinstance(ids, torch.Tensor):
        return _from_tensor(ids)
    return _from_sequence(ids)


def _check_length(ids, max_tokens: int, what: str = "token ids") -> None:
    """Refuse what can never fit before converting it (a huge range would cost seconds)."""
    try:
        size = ids.numel() if isinstance(ids, torch.Tensor) else ids.size if isinstance(ids, np.ndarray) else len(ids)
    except OverflowError:
        size = max_tokens + 1
    except Exception as exc:
        raise InvalidInput(f"could not take the length of the token ids: {type(exc).__name__}: {exc}") from None
    if not isinstance(size, int) or size < 0:
        raise InvalidInput(f"the token ids report a length of {shown(size)}")
    if size > max_tokens:
        limit = "the model's context limit" if what == "token ids" else "the most allowed"
        raise InvalidInput(f"{size} {what} are more than {limit} of {max_tokens}")


def _from_array(ids: np.ndarray) -> torch.Tensor:
    if ids.dtype.kind not in "iu":
        raise InvalidInput(f"token ids must be integers, got an array of dtype {ids.dtype}")
    if ids.ndim != 1:
        raise InvalidInput(f"token ids must be one-dimensional, got shape {ids.shape}")
    if ids.dtype.kind == "u" and ids.size and int(ids.max()) >= 2**63:
        raise InvalidInput(f"token id {int(ids.max())} is outside the int64 range")
    return torch.from_numpy(ids.astype(np.int64, copy=True))


def _from_tensor(ids: torch.Tensor) -> torch.Tensor:
    if type(ids) is not torch.Tensor:
        raise InvalidInput(f"token ids must be a plain torch.Tensor, got {type(ids).__name__}")
    if ids.layout != torch.strided or ids.is_nested:
        raise InvalidInput(f"token ids must be a dense tensor, got layout {ids.layout}")
    if ids.device.type == "meta":
        raise InvalidInput("token ids are on the meta device: they have no values")
    if ids.dtype not in ID_DTYPES:
        raise InvalidInput(f"token ids must be integers, got a tensor of dtype {ids.dtype}")
    if ids.dim() != 1:
        raise InvalidInput(f"token ids must be one-dimensional, got shape {tuple(ids.shape)}")
    if not storage_covers(ids):
        raise InvalidInput("the token id tensor's storage is smaller than the tensor (was it resized?)")
    copy = ids.detach().to(device="cpu", copy=True).contiguous()
    if copy.dtype == torch.uint64 and bool((copy.view(torch.int64) < 0).any()):
        raise InvalidInput("a token id is at least 2**63, outside the int64 range")
    return copy.to(torch.int64)


def storage_covers(t: torch.Tensor) -> bool:
    """Does the tensor's storage hold every element its shape and strides reach?"""
    if t.numel() == 0:
        return True
    last = t.storage_offset() + sum((n - 1) * step for n, step in zip(t.shape, t.stride()))
    return t.untyped_storage().nbytes() >= (last + 1) * t.element_size()


def _from_sequence(ids) -> torch.Tensor:
    try:
        items = list(ids)                      # one walk: what is checked is what is converted
    except Exception as exc:
        raise InvalidInput(f"could not read the token ids: {type(exc).__name__}: {exc}") from None
    if not all(type(x) is int for x in items):         # plain ints at once; anything else item by item
        for i, x in enumerate(items):
            if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
                raise InvalidInput(f"token ids must be integers; item {i} is {shown(x)}")
    try:
        return torch.from_numpy(np.array(items, dtype=np.int64))        # (a quarter of torch.tensor's time)
    except (OverflowError, RuntimeError, ValueError) as exc:
        raise InvalidInput(f"token ids must fit in int64: {exc}") from None


def in_vocabulary(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    values = tokens.numpy() if tokens.device.type == "cpu" else tokens
    if tokens.numel() and not (0 <= int(values.min()) and int(values.max()) < vocab):
        i = int(((tokens < 0) | (tokens >= vocab)).nonzero()[0, 0])
        raise InvalidInput(f"token id {int(tokens[i])} at index {i} is outside the vocabulary [0, {vocab})")
    return tokens


def output_buffer(out, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  forbidden: frozenset[int] = frozenset()) -> None:
    """`out` must be a plain dense tensor that a copy of the logits cannot fail to write, and
    must not share storage with the model (`forbidden`: data pointers of its weights)."""
    if out is None:
        return
    if type(out) is not torch.Tensor:
        what = "an nn.Parameter" if isinstance(out, torch.nn.Parameter) else type(out).__name__
        raise InvalidInput(f"out must be a plain torch.Tensor of shape {shape}, got {what}")
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device or out.layout != torch.strided:
        raise InvalidInput(f"out must have shape {shape}, dtype {dtype} and device {device} (dense); "
                           f"got {tuple(out.shape)}, {out.dtype}, {out.device}, {out.layout}")
    if out.requires_grad:
        raise InvalidInput("out must not require grad: the engine writes it in place")
    if out.numel() > 1 and 0 in out.stride():
        raise InvalidInput("out is an expanded (stride-0) view whose elements share memory; pass a "
                           "tensor with its own storage, e.g. torch.empty(...)")
    if out.is_neg() or out.is_conj():
        raise InvalidInput("out must not be a negated or conjugated view")
    if not storage_covers(out):
        raise InvalidInput("out's storage is smaller than the tensor (was it resized?)")
    if out.untyped_storage().data_ptr() in forbidden:
        raise InvalidInput("out shares storage with the model's weights; writing it would change the model")


def chunk_size(value) -> int:
    return positive_int("chunk_size", value)


def positive_int(name: str, value) -> int:
    number = _integer(name, value)
    if number < 1:
        raise InvalidInput(f"{name} must be a positive integer, got {shown(value)}")
    return number


def reserve(value, max_context: int) -> int:
    """A session's row reservation: 0 (grow as needed) up to the model's context limit."""
    number = _integer("reserve (rows of context to hold from the first chunk on)", value)
    if not 0 <= number <= max_context:
        raise InvalidInput(f"reserve must lie in [0, {max_context}] (the model's context limit), got {shown(value)}")
    return number


def marks(value, length: int) -> tuple[int, ...]:
    """Counts of a chunk's tokens after which state is kept: a non-empty sequence of integers,
    strictly increasing, each in [1, length]."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, range)):
        raise InvalidInput(f"marks must be a list of token counts, got {shown(value)}")
    out = tuple(_integer("a mark (a count of the chunk's tokens)", m) for m in value)
    if not out or any(not 1 <= m <= length for m in out) or any(a >= b for a, b in zip(out, out[1:])):
        raise InvalidInput(f"marks must be strictly increasing counts from 1 to the chunk's {length} tokens, "
                           f"at least one; got {shown(list(out))}")
    return out


GATHER_MS = 100         # the longest gap a command line may ask an idle engine to gather a burst over


def gather_seconds(ms: float, flag: str) -> float:
    """A command line's `flag` of milliseconds to gather a burst of requests over (the engine
    loop's `gather`), checked -> seconds."""
    if not 0 <= ms <= GATHER_MS:
        raise InvalidInput(f"{flag} must be from 0 to {GATHER_MS}, got {ms}")
    return ms / 1e3


def count(name: str, value) -> int:
    number = _integer(name, value)
    if number < 0:
        raise InvalidInput(f"{name} must be a non-negative integer, got {shown(value)}")
    return number


def _integer(name: str, value) -> int:
    """The plain int an int (or numpy integer) holds; subclasses cannot change its value."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidInput(f"{name} must be an integer, got {shown(value)}")
    return int.__index__(value) if isinstance(value, int) else int(value)


def generator(seed) -> torch.Generator:
    seed = _integer("seed", seed)
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise InvalidInput(f"seed must lie in [-2**63, 2**64), got {shown(seed)}")
    return torch.Generator().manual_seed(seed)


def temperature(value) -> float:
    """0 (greedy) or a finite positive number."""
    number = _real("temperature", value)
    if not (math.isfinite(number) and number >= 0):
        raise InvalidInput(f"temperature must be a finite number >= 0 (0 = greedy), got {shown(value)}")
    return number


def top_p(value) -> float:
    number = _real("top_p", value)
    if not 0 < number <= 1:
        raise InvalidInput(f"top_p must be in (0, 1], got {shown(value)}")
    return number


def min_p(value) -> float:
    number = _real("min_p", value)
    if not 0 <= number <= 1:
        raise InvalidInput(f"min_p must be in [0, 1], got {shown(value)}")
    return number


def repetition_penalty(value) -> float:
    number = _real("repetition_penalty", value)
    if not 0.01 <= number <= 100:
        raise InvalidInput(f"repetition_penalty must be in [0.01, 100] (1 = none), got {shown(value)}")
    return number


def output_penalty(name: str, value) -> float:
    """A presence or frequency penalty: a number in [-2, 2] (0: none)."""
    number = _real(name, value)
    if not -2.0 <= number <= 2.0:
        raise InvalidInput(f"{name} must be in [-2, 2] (0 = none), got {shown(value)}")
    return number


def sampling_option(name: str, value):
    """One sampling option checked: temperature, top_p, top_k, min_p, repetition_penalty,
    presence_penalty or frequency_penalty."""
    checks = {"temperature": temperature, "top_p": top_p, "top_k": lambda v: count("top_k", v), "min_p": min_p,
              "repetition_penalty": repetition_penalty,
              "presence_penalty": lambda v: output_penalty("presence_penalty", v),
              "frequency_penalty": lambda v: output_penalty("frequency_penalty", v)}
    return checks[name](value)


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidInput(f"{name} must be a number, got {shown(value)}")
    try:
        if isinstance(value, int):
            return float(int.__index__(value))
        return float.__float__(value) if isinstance(value, float) else float(value)
    except OverflowError:
        raise InvalidInput(f"{name} {shown(value)} is too large for a float") from None
