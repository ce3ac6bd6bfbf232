"""Token-by-token sliding-window attention: the decode path, and a second oracle for the state logic.

Per token: the token fills the next sink row while fewer than S tokens have been seen, otherwise it enters the
window rows and the oldest window row leaves them (for oal-swa into OAL's prefix state, Eq. 5; a sink never leaves
its row, so only keys j >= S enter the prefix). The query then reads the filled rows (sinks and window) with softmax
weights and, for oal-swa, the prefix state with the kernel (Eq. 6), both in the one normaliser.
O((S + W)(d + dv) [+ F dv]) per token, independent of the tokens seen. On the CPU without autograd the same loop
runs in C (`cpu_kernel.window_decode`), and on CUDA in Triton (`triton.window_decode`); this one is their reference.
"""

from __future__ import annotations

import torch

from oal.ops.kernel import key_features, query_features
from oal.ops.window.normaliser import normalise


def _push(slots, row, sinks: int):
    """slots [B, Hkv, S + W, c] with token row [B, Hkv, c] added; returns (slots, the row that left the window)."""
    sink_rows, buf = slots[:, :, :sinks], slots[:, :, sinks:]
    to_sink = torch.zeros(row.shape[:2], dtype=torch.bool, device=row.device)
    if sinks:
        filled = (sink_rows[..., -1] > 0).sum(-1)  # sinks fill in order: this is the next free row
        to_sink = filled < sinks
        hit = torch.arange(sinks, device=row.device) == filled[..., None]
        sink_rows = torch.where(hit[..., None], row[:, :, None], sink_rows)
    shifted = torch.cat([buf[:, :, 1:], row[:, :, None]], dim=2)
    left = buf[:, :, 0].masked_fill(to_sink[..., None], 0.0)
    buf = torch.where(to_sink[..., None, None], buf, shifted)
    return torch.cat([sink_rows, buf], dim=2), left


def recurrent_window_attention(q, k, v, *, sinks: int, kernel, scale: float, slots, prefix, inplace: bool = False):
    """out [B, Hq, n, dv] and the state's (slots, prefix) after the call. slots [B, Hkv, S + W, d+dv+1];
    prefix [B, Hkv, F, dv+1] (kernel) or None. `inplace`: the prefix is updated in place (the slots, a few rows,
    are always new tensors): a copy of the whole prefix per token was most of a step's memory traffic."""
    bsz, n_q, n, d = q.shape
    n_kv = k.shape[1]
    rep = n_q // n_kv
    rows = torch.cat([k, v, torch.ones_like(v[..., :1])], dim=-1)
    outs = []
    for t in range(n):
        slots, left = _push(slots, rows[:, :, t], sinks)
        s = (q[:, :, t].view(bsz, n_kv, rep, d) * scale) @ slots[..., :d].transpose(-1, -2)  # [B, Hkv, rep, S+W]
        s = s.masked_fill(~(slots[..., -1] > 0)[:, :, None], -torch.inf)
        m = s.detach().amax(-1)  # finite: the token's own row is filled
        acc = torch.exp(s - m.unsqueeze(-1)) @ slots[..., d:]
        older = None
        if kernel is not None:
            psi = key_features(left[:, :, None, :d]).transpose(-1, -2)  # Eq. 5 for the evicted row, in one pass
            flat = prefix.flatten(0, 1)
            if inplace and flat.data_ptr() == prefix.data_ptr():  # a view: the update lands in the state
                flat.baddbmm_(psi.flatten(0, 1), left[:, :, None, d:].flatten(0, 1))
            else:
                prefix = torch.baddbmm(flat, psi.flatten(0, 1), left[:, :, None, d:].flatten(0, 1))
                prefix = prefix.view(bsz, n_kv, *prefix.shape[1:])
            phi = query_features(kernel.q[:, :, t : t + 1], *kernel.coeffs, kernel.scale,
                                 weights=kernel.weights)  # [B, Hq, 1, F]
            older = phi.view(bsz, n_kv, rep, -1) @ prefix
        outs.append(normalise(m, acc, older, kernel.log_lam if kernel is not None else 0.0))
    out = torch.stack(outs, dim=3).reshape(bsz, n_q, n, -1)
    return out, slots, prefix
