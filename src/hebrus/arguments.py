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

SEED_RANGE = (-(2**63), 2**64)        # what torch.Generator.manual_seed accepts


def token_ids(ids, max_tokens: int) -> torch.Tensor:
    """A fresh 1-D int64 CPU tensor (never the caller's storage) from a list/tuple/range of
    ints, an integer tensor or an integer array, of at most `max_tokens` ids."""
    if isinstance(ids, (str, bytes, bytearray)):
        raise InvalidInput("token ids expected, got text; encode it first (hebrus.tokenizer.encode)")
    if not isinstance(ids, (list, tuple, range, np.ndarray, torch.Tensor)):
        raise InvalidInput(f"token ids must be a list of ints or an integer tensor, got {type(ids).__name__}")
    _check_length(ids, max_tokens)
    if isinstance(ids, np.ndarray):
        return _from_array(ids)
    if isinstance(ids, torch.Tensor):
        return _from_tensor(ids)
    return _from_sequence(ids)


def _check_length(ids, max_tokens: int) -> None:
    """Refuse what can never fit before converting it (a huge range would cost seconds)."""
    size = ids.numel() if isinstance(ids, torch.Tensor) else ids.size if isinstance(ids, np.ndarray) else len(ids)
    if size > max_tokens:
        raise InvalidInput(f"{size} token ids are more than the model's context limit of {max_tokens}")


def _from_array(ids: np.ndarray) -> torch.Tensor:
    if ids.dtype.kind not in "iu":
        raise InvalidInput(f"token ids must be integers, got an array of dtype {ids.dtype}")
    if ids.ndim != 1:
        raise InvalidInput(f"token ids must be one-dimensional, got shape {ids.shape}")
    return torch.from_numpy(ids.astype(np.int64, copy=True))


def _from_tensor(ids: torch.Tensor) -> torch.Tensor:
    if ids.layout != torch.strided or ids.is_nested or ids.is_quantized:
        raise InvalidInput(f"token ids must be a dense tensor, got layout {ids.layout}")
    if ids.device.type == "meta":
        raise InvalidInput("token ids are on the meta device: they have no values")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise InvalidInput(f"token ids must be integers, got a tensor of dtype {ids.dtype}")
    if ids.dim() != 1:
        raise InvalidInput(f"token ids must be one-dimensional, got shape {tuple(ids.shape)}")
    return ids.detach().to(device="cpu", dtype=torch.int64, copy=True).contiguous()


def _from_sequence(ids) -> torch.Tensor:
    for i, x in enumerate(ids):
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise InvalidInput(f"token ids must be integers; item {i} is {x!r}")
    try:
        return torch.tensor(list(ids), dtype=torch.int64)
    except (OverflowError, RuntimeError, ValueError) as exc:
        raise InvalidInput(f"token ids must fit in int64: {exc}") from None


def in_vocabulary(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    if tokens.numel() and not (0 <= int(tokens.min()) and int(tokens.max()) < vocab):
        i = int(((tokens < 0) | (tokens >= vocab)).nonzero()[0, 0])
        raise InvalidInput(f"token id {int(tokens[i])} at index {i} is outside the vocabulary [0, {vocab})")
    return tokens


def output_buffer(out, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
    """`out` must be a plain dense tensor that a copy of the logits cannot fail to write."""
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


def chunk_size(value) -> int:
    return positive_int("chunk_size", value)


def positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InvalidInput(f"{name} must be a positive integer, got {value!r}")
    return value


def count(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidInput(f"{name} must be a non-negative integer, got {value!r}")
    return value


def generator(seed) -> torch.Generator:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise InvalidInput(f"seed must be an integer, got {seed!r}")
    if not SEED_RANGE[0] <= seed < SEED_RANGE[1]:
        raise InvalidInput(f"seed must lie in [-2**63, 2**64), got {seed}")
    return torch.Generator().manual_seed(seed)


def temperature(value) -> float:
    """0 (greedy) or a finite positive number."""
    number = _real("temperature", value)
    if not (math.isfinite(number) and number >= 0):
        raise InvalidInput(f"temperature must be a finite number >= 0 (0 = greedy), got {value!r}")
    return number


def top_p(value) -> float:
    number = _real("top_p", value)
    if not 0 < number <= 1:
        raise InvalidInput(f"top_p must be in (0, 1], got {value!r}")
    return number


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidInput(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise InvalidInput(f"{name} {value!r} is too large for a float") from None
