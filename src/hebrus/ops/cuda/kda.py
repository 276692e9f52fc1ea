"""Kimi delta attention through fla's Triton kernels (`fla.ops.kda`): the chunked form for a
chunk, the fused recurrence for single tokens. The contract of `hebrus.ops.kda` (its readable
twins): q, k [T, H, dk] (already l2-normalised, q already scaled), v [T, H, dv], g [T, H, dk]
(log decays), beta [T, H], state [H, dk, dv] left untouched -> (o [T, H, dv], final state in the
state's dtype). For 16-bit models only, as `ops.cuda.gdn` (TF32 dots)."""
from __future__ import annotations

import importlib

import torch

from hebrus.ops.cuda.gdn import varlen


def available() -> bool:
    """Whether fla with its KDA kernels is installed. A broken install raises."""
    try:
        importlib.import_module("fla.ops.kda")
    except ModuleNotFoundError:
        return False
    return True


def _run(q, k, v, g, beta, state, cu_seqlens=None, on_host=None):
    """One call over [1, T, ...] inputs and [N, H, dk, dv] states (N sequences by cu_seqlens;
    `on_host`, the same bounds on the host, spares fla a wait for the device)."""
    from fla.ops.kda import chunk_kda, fused_recurrent_kda
    single = cu_seqlens is not None and q.shape[1] == cu_seqlens.numel() - 1     # a token each
    rule = fused_recurrent_kda if q.shape[1] == 1 or single else chunk_kda
    dtype = q.dtype
    o, final = rule(q.contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous(), g=g.float().contiguous(),
                    beta=beta.float().contiguous(), scale=1.0, initial_state=state.float().contiguous(),
                    output_final_state=True, cu_seqlens=cu_seqlens,
                    **({"cu_seqlens_cpu": on_host} if rule is chunk_kda and on_host is not None else {}))
    return o[0], final


def kda_fla(q, k, v, g, beta, state):
    """Also several sequences' single tokens at once (q [B, 1, H, dk], state [B, H, dk, dv]):
    through the varlen form, a token a sequence."""
    if q.dim() == 4:
        B = q.shape[0]
        cu = torch.arange(B + 1, device=q.device, dtype=torch.long)
        o, final = _run(*(t.transpose(0, 1) for t in (q, k, v, g, beta)), state, cu)
        return o[:, None], final.to(state.dtype)
    o, final = _run(q[None], k[None], v[None], g[None], beta[None], state[None])
    return o, final[0].to(state.dtype)


def kda_fla_ragged(q, k, v, g, beta, state, cu_seqlens, bounds):
    """N sequences of any lengths in one call: the contract of `hebrus.ops.gdn.gdn_ragged`."""
    o, final = _run(q[None], k[None], v[None], g[None], beta[None], state, *varlen(tuple(bounds), q.device)[:2])
    return o, final.to(state.dtype)
