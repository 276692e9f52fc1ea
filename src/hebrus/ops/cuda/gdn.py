"""The gated delta rule through fla's Triton kernels: the chunked form for a chunk, the fused
recurrence for one token. Same contract as `hebrus.ops.gdn` (its readable twins): q, k [T, H, dk]
(already l2-normalised, q already scaled), v [T, H, dv], g, beta [T, H], state [H, dk, dv] left
untouched -> (o [T, H, dv], final state in the state's dtype). fla's dots run in TF32 for float32
inputs (about 1e-3 relative), so the op table uses it for 16-bit models only."""
from __future__ import annotations

import importlib


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
    [N, H, dk, dv], sequence i rows cu_seqlens[i]..cu_seqlens[i+1] -> (o [T, H, dv], final
    states [N, ...]). The contract of `hebrus.ops.gdn.gdn_ragged`, its readable twin."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    dtype = q.dtype
    o, final = chunk_gated_delta_rule(q[None].contiguous(), k.to(dtype)[None].contiguous(),
                                      v.to(dtype)[None].contiguous(), g=g.float()[None].contiguous(),
                                      beta=beta.float()[None].contiguous(), scale=1.0, initial_state=state.float(),
                                      output_final_state=True, cu_seqlens=cu_seqlens.long())
    return o[0], final.to(state.dtype)
