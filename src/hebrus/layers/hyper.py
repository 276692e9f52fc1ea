"""The residual around a sublayer, in its two forms.

Both take the streams X [T, n, D]: `pre` gives the sublayer's input (before its norm) and what
`post` needs; `post` folds the sublayer's output back in; `head` gives the final hidden state.
"""
from __future__ import annotations

import torch

from hebrus.layers.kernels import Kernels
from hebrus.layers.kind import normal, uniform
from hebrus.ops.hyper import hc_gates, hc_head, hc_post


class HyperConnection:
    """n streams mixed by learned gates and a Sinkhorn-projected stream mix (mHC)."""

    def __init__(self, s, params: dict[str, torch.Tensor], prefix: str, kernels: Kernels):
        self.fn, self.base, self.scale = (params[f"{prefix}.{k}"] for k in ("fn", "base", "scale"))
        self.iters, self.hc_eps, self.rms_eps = s.hc_sinkhorn_iters, s.hc_eps, s.rms_norm_eps
        self.fused, self.sinkhorn = kernels.fused, kernels.sinkhorn

    def pre(self, X: torch.Tensor):
        """X [T, n, D] -> (c [T, D], post [T, n], comb [T, n, n]): `ops.hyper.hc_pre`."""
        c, post, logits = self.fused(hc_gates)(X, self.fn, self.base, self.scale, self.hc_eps, self.rms_eps)
        return c, post, self.sinkhorn(logits, self.iters, self.hc_eps)

    def post(self, X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return self.fused(hc_post)(X, y, post, comb)

    def head(self, X: torch.Tensor) -> torch.Tensor:
        """The head's single mix-down: X [T, n, D] -> h [T, D]."""
        return self.fused(hc_head)(X, self.fn, self.base, self.scale, self.hc_eps, self.rms_eps)


class PlainResidual:
    """One stream, x + f(norm(x)) exactly: no gates, no mixing."""

    @staticmethod
    def pre(X: torch.Tensor):
        return X[:, 0], None, None

    @staticmethod
    def post(X: torch.Tensor, y: torch.Tensor, post, comb) -> torch.Tensor:
        return X + y.unsqueeze(1)

    @staticmethod
    def head(X: torch.Tensor) -> torch.Tensor:
        return X[:, 0]


def residual(s, params: dict[str, torch.Tensor], prefix: str, kernels: Kernels):
    """The residual the spec names, reading its parameters under `prefix` (hyper only), running
    the op table's forms of its ops (`layers.kernels`)."""
    if s.residual == "hyper":
        return HyperConnection(s, params, prefix, kernels)
    if s.residual == "plain":
        return PlainResidual()
    raise ValueError(f"unknown residual {s.residual!r}")


def mix_dim(s) -> int:
    """Width of a sublayer's hyper-connection map: pre and post gates and the n × n stream mix."""
    return (2 + s.hc_streams) * s.hc_streams


def sublayer_weights(s, prefix: str) -> dict[str, tuple[int, ...]]:
    """A sublayer's residual parameters under `prefix` ("layers.3.mixer_hc"): none when plain."""
    if s.residual == "plain":
        return {}
    n, D = s.hc_streams, s.hidden_size
    return {f"{prefix}.fn": (mix_dim(s), n * D), f"{prefix}.base": (mix_dim(s),), f"{prefix}.scale": (3,)}


def head_weights(s) -> dict[str, tuple[int, ...]]:
    """The head's single mix-down: none when plain."""
    if s.residual == "plain":
        return {}
    n, D = s.hc_streams, s.hidden_size
    return {"head_hc.fn": (n, n * D), "head_hc.base": (n,), "head_hc.scale": (1,)}


def init(leaf: str, shape: tuple[int, ...], gen):
    """Gates' scales in [0.5, 1.5], their biases N(0, 0.5²); the maps are projections (None)."""
    if leaf == "scale":
        return uniform(shape, 0.5, 1.5, gen)
    if leaf == "base":
        return normal(shape, 0.5, gen)
    return None
