"""The gated delta rule through fla's Triton kernels: the chunked form for a chunk, the fused
recurrence for one token. Same contract as `hebrus.ops.gdn` (its readable twins): q, k [T, H, dk]
(already l2-normalised, q already scaled), v [T, H, dv], g, beta [T, H], state [H, dk, dv] left
untouched -> (o [T, H, dv], final state in the state's dtype). fla's dots run in TF32 for float32
inputs (about 1e-3 relative), so the op table uses it for 16-bit models only."""
from __future__ import annotations

import functools
import importlib

import torch

from hebrus.uploads import upload

CHUNK = 64          # the tokens of a chunk of fla's chunked kernels (their default, named in each call)


def available() -> bool:
    """Whether fla is installed. A broken install raises rather than falling back quietly."""
    try:
        importlib.import_module("fla.ops.gated_delta_rule")
    except ModuleNotFoundError:
        return False
    return True


def gdn_fla(q, k, v, g, beta, state):
    """Also for several sequences at once: q [B, T, H, dk], state [B, H, dk, dv]."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    rule = fused_recurrent_gated_delta_rule if q.shape[-3] == 1 else chunk_gated_delta_rule
    dtype, sequences = q.dtype, q.dim() == 4
    q, k, v, g, beta, initial = (t if sequences else t[None] for t in (q, k, v, g, beta, state))
    # by keyword: the fused recurrence takes gk and gv between g and beta
    o, final = rule(q.contiguous(), k.to(dtype).contiguous(), v.to(dtype).contiguous(),
                    g=g.float().contiguous(), beta=beta.float().contiguous(), scale=1.0,
                    initial_state=initial.float(), output_final_state=True)
    return (o, final.to(state.dtype)) if sequences else (o[0], final[0].to(state.dtype))


def gdn_fla_ragged(q, k, v, g, beta, state, cu_seqlens, bounds):
    """N sequences of any lengths in one call of fla's chunked kernel: q [T, H, dk] ..., state
    [N, H, dk, dv], sequence i rows bounds[i]..bounds[i+1] -> (o [T, H, dv], final states
    [N, ...]). The contract of `hebrus.ops.gdn.gdn_ragged`, its readable twin (fla is given the
    bounds as `varlen` makes them from `bounds`)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    dtype = q.dtype
    on_device, _, chunks = varlen(tuple(bounds), q.device)
    o, final = chunk_gated_delta_rule(q[None].contiguous(), k.to(dtype)[None].contiguous(),
                                      v.to(dtype)[None].contiguous(), g=g.float()[None].contiguous(),
                                      beta=beta.float()[None].contiguous(), scale=1.0, initial_state=state.float(),
                                      output_final_state=True, cu_seqlens=on_device, chunk_indices=chunks,
                                      chunk_size=CHUNK)
    return o[0], final.to(state.dtype)


@functools.lru_cache(maxsize=64)
def varlen(bounds: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fla's varlen inputs for sequences at `bounds` (host): (the bounds as int64 on the device,
    the same on the host, and each `CHUNK`-token chunk's (sequence, its chunk index in it)
    [chunks, 2] int64 on the device), made on the host and queued without a wait. Left to
    itself, fla makes the chunks' list from the device's bounds, which waits for the device,
    in every layer; here the same bounds give the same tensors (every layer of a pass asks),
    which fla's own caches also know by identity."""
    chunks = [(i, c) for i in range(len(bounds) - 1) for c in range(-(-(bounds[i + 1] - bounds[i]) // CHUNK))]
    host = torch.tensor(bounds, dtype=torch.int64)
    return upload(host, torch.int64, device), host, upload(chunks, torch.int64, device).view(-1, 2)
