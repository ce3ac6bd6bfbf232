"""Triton kernels of one decoding step of swa and oal-swa on their state (`oal.ops.window.state`), in place.

swa is one launch, oal-swa three, for a few new tokens of every head (the torch token loop,
`window.recurrent`, is the reference and runs everywhere else):

- `_win_step`, one program per (batch row, KV head): the softmax part of every query of the KV head, the state's
  slots updated, and for oal-swa the row each token pushes out of the window;
- oal-swa: `decode._dec_step` with EVICT adds those rows to the prefix state (Eq. 5) and reads it out (Eq. 6),
  and `_win_out` joins the two parts under one normaliser (`window.normaliser`).

The slots are not shifted token by token. The program loads the S sink rows, the W window rows and the T new
tokens as one tile of candidate rows. After the first t + 1 new tokens, with n_s sinks filled before the call:

- the tokens j < j0 = min(max(S - n_s, 0), T) became sinks (rows n_s + j);
- the others were pushed into the window, c_t = max(t + 1 - j0, 0) of them. The window is then rows
  [c_t, c_t + W) of the sequence (old window rows, then the new non-sink tokens);
- so query t reads the filled sinks, the old window rows at positions >= c_t, and the new tokens j <= t that are
  sinks or lie at sequence position W + j - j0 >= c_t;
- and its push (t >= j0) evicted sequence row e = t - j0 (an empty old row holds zeros: nothing enters).

The new slots are gathered from memory the same way, after a barrier, so that the update can be in place.
Value checks as `decode.py`: non-finite q, k, v and out, and max |k| (atomic max into the slots of `guard.py`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from oal.ops import checks
from oal.ops.triton import decode, parallel
from oal.ops.triton.decode import _nonfinite, _partial_sums, _store_out
from oal.ops.triton.launch import Launch
from oal.ops.triton.tiles import next_pow2, tl_dtype


@triton.jit
def _win_step(
    Q, K, V, SL, O, M, ACC, ACCN, EK, EU, STATUS,
    size, d, dv, n_q, scale,
    T: tl.constexpr, REP: tl.constexpr, SINKS: tl.constexpr, WIN: tl.constexpr, R: tl.constexpr,
    BD: tl.constexpr, BV: tl.constexpr, EVICT: tl.constexpr, ACC_DT: tl.constexpr,
):
    """KV head bh = (b, hk) of T new tokens. Grid (B * Hkv,). Q [B, Hq, T, d], K [B, Hkv, T, d], V [B, Hkv, T, dv]
    contiguous; SL: the state [B, Hkv, size], its first (S + W)(d + dv + 1) entries the slots.

    swa (not EVICT): out into O [B, Hq, T, dv]. oal-swa: the window part of query row r, m = max of its scores into
    M[r], sum e^(s - m) v into ACC [r, BV] and sum e^(s - m) w into ACCN[r]; the evicted rows into EK [bh T + t, d]
    and EU [bh T + t, dv + 1]."""
    bh = tl.program_id(0)
    n_kv = n_q // REP
    b = bh // n_kv
    hk = bh % n_kv
    width = d + dv + 1
    base = SL + bh.to(tl.int64) * size
    n_old: tl.constexpr = SINKS + WIN
    i = tl.arange(0, R)  # candidate rows: sinks, window, new tokens
    old = i < n_old
    new = (i >= n_old) & (i < n_old + T)
    j = i - n_old  # new token index
    dcol = tl.arange(0, BD)
    dmask = dcol < d
    vcol = tl.arange(0, BV)
    vmask = vcol < dv
    newrow = (bh * T + j).to(tl.int64)
    kt = (tl.load(base + i[:, None] * width + dcol[None, :], mask=old[:, None] & dmask[None, :], other=0.0).to(ACC_DT)
          + tl.load(K + newrow[:, None] * d + dcol[None, :], mask=new[:, None] & dmask[None, :], other=0.0)
          .to(ACC_DT))
    vt = (tl.load(base + i[:, None] * width + d + vcol[None, :], mask=old[:, None] & vmask[None, :], other=0.0)
          .to(ACC_DT)
          + tl.load(V + newrow[:, None] * dv + vcol[None, :], mask=new[:, None] & vmask[None, :], other=0.0)
          .to(ACC_DT))
    wt = tl.load(base + i * width + d + dv, mask=old, other=0.0).to(ACC_DT) + tl.where(new, 1.0, 0.0)
    # the call's keys and values: checks
    newk = tl.where(new[:, None] & dmask[None, :], kt, 0.0)
    newv = tl.where(new[:, None] & vmask[None, :], vt, 0.0)
    kmax = tl.max(tl.max(tl.abs(newk), axis=1), axis=0)
    tl.atomic_max(STATUS + 2, tl.where(kmax == kmax, kmax, 0.0).to(tl.float32))
    tl.atomic_max(STATUS + 3, tl.max(_nonfinite(newk), axis=0).to(tl.float32))
    tl.atomic_max(STATUS + 5, tl.max(_nonfinite(newv), axis=0).to(tl.float32))

    n_s = tl.sum(tl.where((i < SINKS) & (wt > 0), 1, 0), axis=0)  # sinks fill in order
    j0 = tl.minimum(tl.maximum(SINKS - n_s, 0), T)
    pos = i - SINKS  # sequence position of an old window row
    for t in tl.static_range(T):
        c_t = tl.maximum(t + 1 - j0, 0)
        vis = (((i < SINKS) | ((pos >= c_t) & old)) & (wt > 0)) | (new & (j <= t) & ((j < j0) | (WIN + j - j0 >= c_t)))
        if EVICT:
            e = t - j0
            src = tl.where(t >= j0, tl.where(e < WIN, SINKS + e, n_old + j0 + e - WIN), -1)
            sel = i == src
            er = (bh * T + t).to(tl.int64)
            tl.store(EK + er * d + dcol, tl.sum(tl.where(sel[:, None], kt, 0.0), axis=0), mask=dmask)
            tl.store(EU + er * (dv + 1) + vcol, tl.sum(tl.where(sel[:, None], vt, 0.0), axis=0), mask=vmask)
            tl.store(EU + er * (dv + 1) + dv, tl.sum(tl.where(sel, wt, 0.0), axis=0))
        for r in range(REP):
            row = (b * n_q + hk * REP + r) * T + t
            qvec = tl.load(Q + row.to(tl.int64) * d + dcol, mask=dmask, other=0.0).to(ACC_DT)
            tl.atomic_max(STATUS + 1, _nonfinite(qvec).to(tl.float32))
            s = tl.where(vis, tl.sum(kt * qvec[None, :], axis=1) * scale, -float("inf"))
            m = tl.max(s, axis=0)  # finite: the token's own row is visible
            p = tl.exp(s - m)
            num = tl.sum(p[:, None] * vt, axis=0)
            den = tl.sum(p * wt, axis=0)
            if EVICT:
                tl.store(M + row, m)
                tl.store(ACC + row.to(tl.int64) * BV + vcol, num)
                tl.store(ACCN + row, den)
            else:
                _store_out(O, STATUS, row, num / den, dv, BV)

    # the new slots: sinks n_s .. n_s + j0 - 1 take the first new tokens, the window moves c = T - j0 rows
    c = tl.maximum(T - j0, 0)
    at = pos + c  # sequence position a window row now holds
    src = tl.where(i < SINKS, tl.where((i >= n_s) & (i < n_s + j0), n_old + i - n_s, i),
                   tl.where(at < WIN, SINKS + at, n_old + j0 + at - WIN))
    from_old = old & (src < n_old)
    from_new = old & (src >= n_old)
    nrow = (bh * T + src - n_old).to(tl.int64)
    gk = (tl.load(base + src[:, None] * width + dcol[None, :], mask=from_old[:, None] & dmask[None, :], other=0.0)
          + tl.load(K + nrow[:, None] * d + dcol[None, :], mask=from_new[:, None] & dmask[None, :], other=0.0)
          .to(SL.dtype.element_ty))
    gv = (tl.load(base + src[:, None] * width + d + vcol[None, :], mask=from_old[:, None] & vmask[None, :],
                  other=0.0)
          + tl.load(V + nrow[:, None] * dv + vcol[None, :], mask=from_new[:, None] & vmask[None, :], other=0.0)
          .to(SL.dtype.element_ty))
    gw = tl.load(base + src * width + d + dv, mask=from_old, other=0.0) + tl.where(from_new, 1.0, 0.0)
    tl.debug_barrier()  # every load of the old slots is done before any store overwrites them
    tl.store(base + i[:, None] * width + dcol[None, :], gk, mask=old[:, None] & dmask[None, :])
    tl.store(base + i[:, None] * width + d + vcol[None, :], gv, mask=old[:, None] & vmask[None, :])
    tl.store(base + i * width + d + dv, gw.to(SL.dtype.element_ty), mask=old)


@triton.jit
def _win_out(M, ACC, ACCN, PART, PARTN, LL, O, STATUS, n_rows, dv, NBLK: tl.constexpr, BV: tl.constexpr):
    """out of query row r: the window part (M, ACC, ACCN) and the prefix part (the partial sums of `_dec_step`,
    kappa / lam with log lam in LL) under one normaliser, `window.normaliser.normalise`. Grid (B * Hq * T,)."""
    row = tl.program_id(0)
    vcol = tl.arange(0, BV)
    num, den = _partial_sums(PART, PARTN, row, n_rows, NBLK, BV)
    m = tl.load(M + row)
    filled = den > 0  # no older key (or only rounding noise): weight 0
    safe = tl.where(filled, den, 1.0)
    log_older = tl.where(filled, tl.log(safe) + tl.load(LL + row), -float("inf"))
    c = tl.maximum(m, log_older)
    w_old = tl.exp(log_older - c) / safe  # the older part enters as a weighted mean: e^(-c) is never formed
    w_win = tl.exp(m - c)
    top = tl.load(ACC + row.to(tl.int64) * BV + vcol) * w_win + num * w_old
    _store_out(O, STATUS, row, top / (tl.load(ACCN + row) * w_win + den * w_old), dv, BV)


def num_warps(rows: int, bv: int) -> int:
    """Warps of a `_win_step` program: its [rows, BV] tiles of keys and values (two per program)."""
    return 4 if rows * bv < 8192 else 8


class Plan:
    """A decoding call of swa (groups and factor None) or oal-swa of one signature (`oal.ops.plans`), worked out
    once: grids, sizes, constants and scratch, and for oal-swa `decode.Step` on the prefix state. `inplace`: the
    caller's state may be updated itself."""

    def __init__(self, q, k, v, groups, factor, *, window: int, sinks: int, eps: float, scale: float, state,
                 inplace: bool):
        bsz, n_q, n_t, d = q.shape
        n_kv, dv = k.shape[1], v.shape[-1]
        self.acc = checks.compute_dtype(q.dtype)
        self.inplace = decode.own_state(state, inplace, self.acc)
        bv = max(16, next_pow2(dv))
        rows = next_pow2(sinks + window + n_t)
        n_rows = bsz * n_q * n_t
        self.out_shape, self.grid = (bsz, n_q, n_t, dv), (bsz * n_kv,)
        self.sizes = (state.shape[-1], d, dv, n_q, scale)
        self.launch = Launch(self.grid, dict(T=n_t, REP=n_q // n_kv, SINKS=sinks, WIN=window, R=rows,
                                             BD=max(16, next_pow2(d)), BV=bv, EVICT=factor is not None,
                                             ACC_DT=tl_dtype(self.acc), num_warps=num_warps(rows, bv)))
        self.step = None
        if factor is None:  # swa: one kernel, no scratch
            return
        # the window part of each query (max, numerator, normaliser) and the rows that left the window
        acc, n_new = self.acc, bsz * n_kv * n_t
        self.win = (decode.scratch(q, "m", n_rows, dtype=acc), decode.scratch(q, "acc", n_rows, bv, dtype=acc),
                    decode.scratch(q, "accn", n_rows, dtype=acc), decode.scratch(q, "ek", n_new, d, dtype=acc),
                    decode.scratch(q, "eu", n_new, dv + 1, dtype=acc))
        self.ll = decode.scratch(q, "ll", n_rows, dtype=acc)  # log lam of each readout
        self.n_slots, self.dv = (sinks + window) * (d + dv + 1), dv
        kernel = decode.kernel_operands(q, groups, factor, eps, scale, self.acc, by_version=True)
        prefix_rows = (state.shape[-1] - self.n_slots) // (dv + 1)
        self.step = decode.Step(q, k, v, prefix_rows, kernel, scale, acc, evict=True)
        self.out_args = (n_rows, dv)
        self.out_launch = Launch((self.step.n_rows,), dict(NBLK=self.step.nblk, BV=bv))

    def __call__(self, q, k, v, state, status):
        """One call on `state` [B, Hkv, size]: (out [B, Hq, T, dv] in q's dtype, the updated state). q, k, v
        contiguous."""
        if not self.inplace:
            state = decode.state_copy(state, self.acc)
        out = parallel.empty(q, *self.out_shape)
        win = (out,) * 5 if self.step is None else self.win  # unread by swa
        self.launch(_win_step, q, k, v, state, out, *win, status, *self.sizes)
        if self.step is None:
            return out, state
        step = self.step
        prefix = state[..., self.n_slots :].unflatten(-1, (-1, self.dv + 1))
        step(q, k, v, prefix, status, evicted=(*win[3:], self.ll))
        self.out_launch(_win_out, *win[:3], step.part, step.partn, self.ll, out, status, *self.out_args)
        return out, state
