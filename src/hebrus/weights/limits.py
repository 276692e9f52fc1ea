"""The type and allowed range of every config field, and the checks that apply them.

`bounded(...)` declares a field's range as dataclass metadata; `value_problems` checks a value
against it. Values may come from untrusted JSON, so nothing here trusts a value's type: a bool is
not an integer, a float is not an integer, a string is not a number.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any, Callable, Iterator

from hebrus.show import shown

# Bounds every family's config fields share (docs/checkpoint.md has the table): far above real
# models, far below overflow.
MAX_HEADS = 1024        # attention and delta-rule heads, and their head dims
MAX_WIDTH = 2**16       # model and per-layer-embedding widths
MAX_ROWS = 2**24        # table rows: vocabulary, n-gram buckets
MAX_KERNEL = 64         # causal conv taps (a session keeps kernel - 1 rows)


@dataclass(frozen=True)
class Range:
    low: float = -math.inf
    high: float = math.inf
    open_low: bool = False
    choices: tuple[str, ...] = ()

    def holds(self, x: float) -> bool:
        return (x > self.low if self.open_low else x >= self.low) and x <= self.high

    def __str__(self) -> str:
        if self.high == math.inf:
            return f"{'>' if self.open_low else '>='} {_number(self.low)}"
        return f"in {'(' if self.open_low else '['}{_number(self.low)}, {_number(self.high)}]"


def bounded(low: float = -math.inf, high: float = math.inf, default: Any = dataclasses.MISSING, *,
            open_low: bool = False, choices: tuple[str, ...] = ()) -> Any:
    """A dataclass field whose values must lie in [low, high] (or (low, high])."""
    return dataclasses.field(default=default, metadata={"range": Range(low, high, open_low, choices)})


def json_kind(value: Any) -> str:
    """What a parsed JSON value is, in JSON's words."""
    kinds = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", int: "a number",
             float: "a number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def value_problems(name: str, kind: str, value: Any, allowed: Range) -> list[str]:
    """What is wrong with `value` for a field of type `kind` (its annotation) and range `allowed`."""
    return list(_CHECKS[kind](name, value, allowed))


def canonical(kind: str, value: Any) -> Any:
    """A checked value in its field's own type (an int, a float, a tuple)."""
    return _CANONICAL.get(kind, lambda v: v)(value)


def _is_integer(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _as_float(value: Any) -> float:
    """A real number as a float (math.inf when it is too large); NaN for anything else."""
    if not isinstance(value, Real) or isinstance(value, bool):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf


def _integer(name: str, value: Any, allowed: Range) -> Iterator[str]:
    if not _is_integer(value) or not allowed.holds(int(value)):
        yield f"{name} must be an integer {allowed}, got {shown(value)}"


def _finite(name: str, value: Any, allowed: Range) -> Iterator[str]:
    number = _as_float(value)
    if not math.isfinite(number) or not allowed.holds(number):
        yield f"{name} must be a finite number {allowed}, got {shown(value)}"


def _boolean(name: str, value: Any, allowed: Range) -> Iterator[str]:
    if not isinstance(value, bool):
        yield f"{name} must be true or false, got {shown(value)}"


def _kinds(name: str, value: Any, allowed: Range) -> Iterator[str]:
    names = ", ".join(map(repr, allowed.choices))
    if not isinstance(value, (list, tuple)):
        yield f"{name} must be a list of layer types ({names}), got {shown(value)}"
        return
    for i, kind in enumerate(value):
        if not isinstance(kind, str) or kind not in allowed.choices:
            yield f"{name}[{i}] is {shown(kind)}, not one of {names}"


def _choice(name: str, value: Any, allowed: Range) -> Iterator[str]:
    if not isinstance(value, str) or value not in allowed.choices:
        yield f"{name} must be one of {', '.join(map(repr, allowed.choices))}, got {shown(value)}"


def _integers(name: str, value: Any, allowed: Range) -> Iterator[str]:
    if not isinstance(value, (list, tuple)):
        yield f"{name} must be a list of integers, got {shown(value)}"
        return
    for i, item in enumerate(value):
        yield from _integer(f"{name}[{i}]", item, allowed)


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


_CHECKS: dict[str, Callable[[str, Any, Range], Iterator[str]]] = {
    "int": _integer, "float": _finite, "bool": _boolean, "str": _choice,
    "tuple[str, ...]": _kinds, "tuple[int, ...]": _integers,
}
_CANONICAL: dict[str, Callable[[Any], Any]] = {
    "int": int, "float": float,
    "tuple[str, ...]": tuple, "tuple[int, ...]": lambda v: tuple(int(b) for b in v),
}


def field_problems(obj: Any) -> list[str]:
    """What is wrong with each field of a `bounded` dataclass instance, on its own (values may
    come from an untrusted file); when nothing is, the fields are made canonical in place."""
    problems = [p for f in dataclasses.fields(obj)
                for p in value_problems(f.name, f.type, getattr(obj, f.name), f.metadata["range"])]
    if not problems:
        for f in dataclasses.fields(obj):
            setattr(obj, f.name, canonical(f.type, getattr(obj, f.name)))
    return problems


def from_json(cls, data: dict[str, Any]):
    """An instance of the `bounded` dataclass `cls` from the JSON object `data`: every required
    key present, unknown keys ignored."""
    required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    missing = sorted(required - data.keys())
    if missing:
        from hebrus.errors import InvalidInput
        raise InvalidInput(f"config is missing required keys: {', '.join(missing)}")
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in known})
