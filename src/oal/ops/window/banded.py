"""Banded sliding-window attention in O(N (W + C)): the fast path of swa and oal-swa.

Every call is evaluated on an extended key sequence E = [W slots before the call; the call's own n tokens], so
that query i of the call (token W + i of E) sees exactly the window entries e in (i, i + W]. The W slots are the
state's window rows (a continuation) or empty rows (a fresh sequence, where min(W, n) of them suffice).
- window: queries in chunks of C; chunk t sees the C + W - 1 entries E[tC + 1 : tC + C + W], one batched GEMM
  for all chunks of a block (a strided view of E), masked to the band and to filled rows;
- sinks: the state's sink rows, and the call's first tokens while fewer than S have been seen; a new sink is
  added here only once it has left the query's window, so no key is counted twice. Their exact weights join the
  window's running max (`merge_max`), so the per-query shift covers them too;
- older keys (oal-swa): E[e <= i] is OAL's causal prefix with a lag of W, so it is `chunked_attention` over the
  first n entries of E (numerator not normalised, `raw`), continuing the state's prefix. Sinks never enter it:
  the window rows of the state hold no sink, and the call's new sinks are zeroed there (a zero row [0, 0, 0] adds
  nothing to OAL's sums). For a fresh sequence that is the plain causal call of queries W+S.. on keys S..n-W-1.
The parts meet in one normaliser (`normaliser.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from oal.ops.chunked import chunked_attention
from oal.ops.window.normaliser import merge_max, normalise

# Queries per chunk: a chunk computes C x (C + W - 1) scores for its C x W band, and small GEMMs cost overhead.
# Measured (swa, N=4096, W=64, d=64, Hq=4, 1 thread, one noisy run): C = 16, 32, 64 took 143, 147, 177 ms.
CHUNK = 32
# Scores per (batch, query head) in one block of chunks: bounds the band's memory for long sequences.
BAND_BLOCK = 1 << 19


def default_chunk(window: int) -> int:
    return min(CHUNK, max(window, 8))


def _band(q, ek, eu, window: int, scale: float, chunk: int):
    """Window part of queries q [B, Hkv, rep, n, d] on E: ek [B, Hkv, W + n, d], eu [B, Hkv, W + n, dv+1].

    Returns m [B, Hkv, rep, n] (max visible score, no gradient) and acc = sum exp(s - m) eu over e in (i, i + W].
    """
    bsz, n_kv, rep, n, d = q.shape
    dv1 = eu.shape[-1]
    c = min(chunk, n)
    n_c = -(-n // c)
    width = c + window - 1
    pad = n_c * c - n
    qc = F.pad(q * scale, (0, 0, 0, pad)).view(bsz, n_kv, rep, n_c, c, d).transpose(2, 3)
    qc = qc.reshape(bsz, n_kv, n_c, rep * c, d)
    # chunk t sees E[tC + 1 : tC + C + W]: windows of `width` rows at stride C over E[1:] (a view, no copy)
    kw = F.pad(ek[:, :, 1:], (0, 0, 0, pad)).unfold(2, width, c)  # [B, Hkv, nc, d, width]
    uw = F.pad(eu[:, :, 1:], (0, 0, 0, pad)).unfold(2, width, c)  # [B, Hkv, nc, dv+1, width]
    s = (qc @ kw).view(bsz, n_kv, n_c, rep, c, width)
    a = torch.arange(c, device=q.device)[:, None]
    b = torch.arange(width, device=q.device)[None, :]
    band = (b >= a) & (b < a + window)  # local row a is query tC + a, local column b is E entry tC + 1 + b
    visible = band & (uw[:, :, :, None, None, -1, :] > 0)  # and the row is filled
    s = s.masked_fill(~visible, -torch.inf)
    m = s.detach().amax(-1)
    m = m.masked_fill(m == -torch.inf, 0.0)  # padding rows past n see nothing; keep them finite
    p = torch.exp(s - m.unsqueeze(-1)).view(bsz, n_kv, n_c, rep * c, width)
    acc = (p @ uw.transpose(-1, -2)).view(bsz, n_kv, n_c, rep, c, dv1).transpose(2, 3)
    acc = acc.reshape(bsz, n_kv, rep, n_c * c, dv1)[:, :, :, :n]
    return m.transpose(2, 3).reshape(bsz, n_kv, rep, n_c * c)[:, :, :, :n], acc


def _window_part(q, ek, eu, window: int, scale: float, chunk: int):
    """`_band` a block of queries at a time (block i0.. needs E[i0 : i0 + block + W])."""
    n = q.shape[3]
    c = min(chunk, n)
    block = c * max(1, BAND_BLOCK // (c * (c + window)))
    if block >= n:
        return _band(q, ek, eu, window, scale, c)
    parts = [_band(q[:, :, :, i0 : i0 + block], ek[:, :, i0 : i0 + block + window], eu[:, :, i0 : i0 + block + window],
                   window, scale, c) for i0 in range(0, n, block)]
    return torch.cat([p[0] for p in parts], dim=3), torch.cat([p[1] for p in parts], dim=3)


def _sink_part(m, acc, q, rows, sink_rows, filled, window: int, sinks: int, scale: float):
    """Add the sinks to (m, acc). sink_rows [B, Hkv, S, d+dv+1] from the state (None when fresh), `filled` [B, Hkv]
    how many of them are filled; the call's tokens jj < S - filled are sinks too, once outside the window."""
    d, n = q.shape[-1], q.shape[3]
    new = rows[:, :, :sinks]
    jj = torch.arange(new.shape[2], device=q.device)
    i = torch.arange(n, device=q.device)[:, None]
    vis = (jj < (sinks - filled)[..., None, None]) & (jj <= i - window)  # [B, Hkv, n, S']
    if sink_rows is not None:
        old = (sink_rows[..., -1] > 0)[:, :, None, :].expand(-1, -1, n, -1)
        new, vis = torch.cat([sink_rows, new], dim=2), torch.cat([old, vis], dim=-1)
    s = (q * scale) @ new[..., :d].transpose(-1, -2).unsqueeze(2)  # [B, Hkv, rep, n, S'']
    return merge_max(m, acc, s.masked_fill(~vis.unsqueeze(2), -torch.inf), new[..., d:].unsqueeze(2))


def _non_sinks(rows, filled, sinks: int):
    """The call's rows with those that become sinks (the first S - filled) zeroed: the window and prefix rows."""
    if not sinks:
        return rows
    is_sink = torch.arange(rows.shape[2], device=rows.device) < (sinks - filled)[..., None]  # [B, Hkv, n]
    return rows.masked_fill(is_sink[..., None], 0.0)


def _older_part(kernel, rows, buf, prefix, window: int, sinks: int, filled, d: int, need_state: bool):
    """Raw OAL sum over the keys that left the window and are not sinks, [B, Hq, n, dv+1], and the prefix state
    after the call."""
    n = rows.shape[2]
    call = dict(groups=kernel.groups, factor=kernel.factor, coeffs=kernel.coeffs, eps=kernel.eps, scale=kernel.scale,
                causal=True, need_state=need_state, raw=True)
    if buf is not None:  # continuation: the first n entries of E = [window rows; new rows], after the prefix
        lagged = torch.cat([buf, _non_sinks(rows, filled, sinks)], dim=2)[:, :, :n]
        return chunked_attention(kernel.q, lagged[..., :d].contiguous(), lagged[..., d:].contiguous(), state=prefix,
                                 **call)
    lag = window + sinks  # fresh: query i reads keys S..i-W, so the first W + S queries read none
    older = rows.new_zeros(kernel.q.shape[0], kernel.q.shape[1], min(lag, n), rows.shape[-1] - d)
    if n <= lag:
        return older, prefix
    keys = rows[:, :, sinks : n - window]
    out, state = chunked_attention(kernel.q[:, :, lag:].contiguous(), keys[..., :d].contiguous(),
                                   keys[..., d:].contiguous(), state=prefix, state_is_zero=True, **call)
    return torch.cat([older, out], dim=2), state


def banded_window_attention(q, k, v, *, window: int, sinks: int, kernel, scale: float, slots, prefix,
                            need_state: bool, chunk_size: int | None):
    """out [B, Hq, n, dv] and the state's (slots, prefix) after the call (None unless `need_state`).

    slots [B, Hkv, S + W, d+dv+1] / prefix: the initial state's views; slots None for a fresh sequence, and then
    prefix is a zero state when there is a kernel."""
    bsz, n_q, n, d = q.shape
    n_kv = k.shape[1]
    rep = n_q // n_kv
    chunk = chunk_size or default_chunk(window)
    rows = torch.cat([k, v, torch.ones_like(v[..., :1])], dim=-1)  # [k, v, 1] per token
    fresh = slots is None
    if fresh:  # empty window rows: min(W, n) of them already show every token to every query
        sink_rows, filled = None, torch.zeros(bsz, n_kv, dtype=torch.long, device=q.device)
        buf, w_band = None, min(window, n)
        ext = torch.cat([rows.new_zeros(bsz, n_kv, w_band, rows.shape[-1]), rows], dim=2)
    else:
        sink_rows, buf, w_band = slots[:, :, :sinks], slots[:, :, sinks:], window
        filled = (sink_rows[..., -1] > 0).sum(-1)
        ext = torch.cat([buf, rows], dim=2)
    qg = q.view(bsz, n_kv, rep, n, d)
    m, acc = _window_part(qg, ext[..., :d], ext[..., d:], w_band, scale, chunk)
    if sinks:
        m, acc = _sink_part(m, acc, qg, rows, sink_rows, filled, window, sinks, scale)
    older, new_prefix = None, None
    if kernel is not None:
        older, new_prefix = _older_part(kernel, rows, buf, prefix, window, sinks, filled, d, need_state)
        older = older.view(bsz, n_kv, rep, n, -1)
    out = normalise(m, acc, older, kernel.log_lam if kernel is not None else 0.0).reshape(bsz, n_q, n, -1)
    if not need_state:
        return out, None, None
    return out, _next_slots(rows, sink_rows, buf, filled, window, sinks), new_prefix


def _next_slots(rows, sink_rows, buf, filled, window: int, sinks: int):
    """The slots after the call: sinks filled in order from the call's first tokens, then the last W tokens that
    are not sinks (right-aligned; a token that became a sink leaves an empty row)."""
    bsz, n_kv, n, width = rows.shape
    if buf is None:
        buf = rows.new_zeros(bsz, n_kv, window, width)
        sink_rows = rows.new_zeros(bsz, n_kv, sinks, width)
    if not sinks:
        return torch.cat([buf, rows], dim=2)[:, :, -window:]
    src = torch.arange(sinks, device=rows.device) - filled[..., None]  # sink slot s takes token s - filled
    take = (src >= 0) & (src < n)
    gathered = rows.gather(2, src.clamp(0, n - 1)[..., None].expand(-1, -1, -1, width))
    sink_rows = torch.where(take[..., None], gathered, sink_rows)
    return torch.cat([sink_rows, torch.cat([buf, _non_sinks(rows, filled, sinks)], dim=2)[:, :, -window:]], dim=2)
