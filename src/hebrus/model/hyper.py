"""A hyper-connection around one sublayer: `pre` mixes n streams down to the sublayer's input,
`post` mixes the sublayer's output back into n streams."""
from __future__ import annotations

import torch

from hebrus.config import HebrusConfig
from hebrus.ops.hyper import hc_head, hc_post, hc_pre


class HyperConnection:
    def __init__(self, c: HebrusConfig, params: dict[str, torch.Tensor], prefix: str):
        self.fn, self.base, self.scale = (params[f"{prefix}.{k}"] for k in ("fn", "base", "scale"))
        self.iters, self.hc_eps, self.rms_eps = c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps

    def pre(self, X: torch.Tensor):
        """X [T, n, D] -> (c [T, D], post [T, n], comb [T, n, n])."""
        return hc_pre(X, self.fn, self.base, self.scale, self.iters, self.hc_eps, self.rms_eps)

    @staticmethod
    def post(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        return hc_post(X, y, post, comb)

    def head(self, X: torch.Tensor) -> torch.Tensor:
        """The head's single mix-down: X [T, n, D] -> h [T, D]."""
        return hc_head(X, self.fn, self.base, self.scale, self.hc_eps, self.rms_eps)
