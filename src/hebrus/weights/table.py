"""How a family's files become the model's tensors: a names table.

`shapes` lists every tensor the checkpoint must hold (and its shape on disk); `sources` says, for
every tensor the model needs (`models.layout.parameter_shapes`), which file tensors it is built
from and how. Tensors a family knows but the model does not use (a vision tower, a multi-token
prediction head) are `ignored`; anything else unexpected is an error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass(frozen=True)
class Source:
    names: tuple[str, ...]                                   # file tensors, in the order build takes them
    build: Callable[..., torch.Tensor] = _same
    # Optional: where file tensor i lies in the model tensor (a view of it), so each can be read
    # straight into place instead of being built; must agree with `build`.
    part: Callable[[torch.Tensor, int], torch.Tensor] | None = None

    @property
    def is_copy(self) -> bool:
        """One file tensor taken as it is."""
        return len(self.names) == 1 and self.build is _same


@dataclass
class NamesTable:
    shapes: dict[str, tuple[int, ...]]
    sources: dict[str, Source]
    ignored: Callable[[str], bool] = lambda name: False
    dtypes: Callable[[str], tuple[str, ...]] = lambda name: FLOAT_DTYPES

    @classmethod
    def identity(cls, shapes: dict[str, tuple[int, ...]], dtypes=None) -> "NamesTable":
        table = cls(dict(shapes), {name: Source((name,)) for name in shapes})
        if dtypes is not None:
            table.dtypes = dtypes
        return table

    def add(self, model_name: str, file_name: str, shape: tuple[int, ...], build=_same) -> None:
        """One model tensor from one file tensor."""
        self.add_source(model_name, {file_name: shape}, build)

    def add_source(self, model_name: str, files: dict[str, tuple[int, ...]], build=_same, part=None) -> None:
        """One model tensor from file tensors (in the order `build` takes them), each expected
        with its shape; a file tensor may feed several model tensors."""
        self.shapes.update(files)
        self.sources[model_name] = Source(tuple(files), build, part)
