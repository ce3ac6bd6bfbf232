"""Triton kernels of one decoding step on a state: two launches for a few new tokens of every head.

The state stays in the packed layout of the contract, [B, Hkv, F, dv+1] (rows H0, H1, H2 with r <= t, the last
column the normaliser; `oal.ops`), and is updated in place. `_dec_step`: one program per block of RB state rows of
one (batch row, KV head); for each new token it adds psi(k) [v, 1] to its rows (Eq. 5), then reads them out for
every query head of the KV head: phi(q) . S over its rows (Eq. 6), one partial sum per program. `_dec_out` adds
the partials of a (batch row, query head, token) and divides by the normaliser. The token loop of the torch path
(`ops.recurrent`) is the reference.

Row f of the state holds the product psi_f(x) = x_r x_t with (r, t) = (ROWR[f], ROWT[f]), where -1 stands for a
factor 1 (row 0: 1; row 1 + r: x_r); phi_f(q) = W[h, f] psi_f(q) with W the per-head query coefficients
(`kernel.query_coefficients`, the scale folded in).

Overflow (`checks.rescaled`): a program whose scores could overflow (|scale| d max|q_h| max|k| above the
dtype's max^(1/4)) evaluates kappa / lam exactly, with q / max|q_h| and the row weights W divided by lam and
multiplied by max|q_h|^(order of the row); num / den does not change.
Value checks on the device (`checks`): non-finite q, k, v and out, and max |k|, into the slots of `guard.py` by
atomic max (the values are >= 0); the host reads them later.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from oal.ops import checks
from oal.ops.kernel import cached_coefficients, row_maps
from oal.ops.triton import parallel
from oal.ops.triton.launch import Launch
from oal.ops.triton.tiles import cdiv, next_pow2, tl_dtype


@triton.jit
def _nonfinite(x):
    """1.0 if the vector x holds NaN or Inf, else 0.0: x - x is 0 only for finite x."""
    return tl.max(tl.where(x - x == 0.0, 0.0, 1.0), axis=0)


@triton.jit
def _gather_product(X, rr, tt, rmask, qs, ACC_DT: tl.constexpr):
    """psi_f(x) for the rows given by (rr, tt): x_r x_t with -1 meaning 1, x scaled by qs."""
    xr = tl.where(rr >= 0, tl.load(X + rr, mask=rmask & (rr >= 0), other=0.0).to(ACC_DT) * qs, 1.0)
    xt = tl.where(tt >= 0, tl.load(X + tt, mask=rmask & (tt >= 0), other=0.0).to(ACC_DT) * qs, 1.0)
    return xr * xt


@triton.jit
def _dec_step(
    Q, K, V, W, ROWR, ROWT, S, PART, PARTN, STATUS, EK, EU, LL,
    F, d, dv, n_q, n_bq, s_stride, scale_abs, s_limit,
    T: tl.constexpr, REP: tl.constexpr, RB: tl.constexpr, BV: tl.constexpr, BDQ: tl.constexpr,
    ACC_DT: tl.constexpr, EVICT: tl.constexpr,
):
    """State rows [blk RB, blk RB + RB) of KV head (b, hk): T tokens' updates and readouts. Grid (NBLK, B * Hkv).

    Q [B, Hq, T, d], K [B, Hkv, T, d], V [B, Hkv, T, dv] contiguous; S: KV head bh's [F, dv+1] rows at
    S + bh s_stride (`item_stride`), fp32 (or fp64); PART [NBLK, B * Hq * T, BV], PARTN [NBLK, B * Hq * T].
    EVICT (oal-swa's prefix, `window_decode.py`): token t adds the row that left the window instead of its own key,
    EK [B * Hkv * T, d] and EU [B * Hkv * T, dv + 1] ([v, w], w = 0 for no row), and LL [B * Hq * T] gets
    log lam of each readout; the checks and the rescaling still read the call's own K and V."""
    blk = tl.program_id(0)
    bh = tl.program_id(1)
    n_kv = n_q // REP
    b = bh // n_kv
    hk = bh % n_kv
    rows = blk * RB + tl.arange(0, RB)
    rmask = rows < F
    rr = tl.load(ROWR + rows, mask=rmask, other=-1)
    tt = tl.load(ROWT + rows, mask=rmask, other=-1)
    vcol = tl.arange(0, BV)
    vmask = vcol < dv
    dcol = tl.arange(0, BDQ)
    dmask = dcol < d
    sbase = S + bh.to(tl.int64) * s_stride
    smask = rmask[:, None] & vmask[None, :]
    st = tl.load(sbase + rows[:, None] * (dv + 1) + vcol[None, :], mask=smask, other=0.0)
    sn = tl.load(sbase + rows * (dv + 1) + dv, mask=rmask, other=0.0)
    for t in range(T):
        kb = K + (bh * T + t).to(tl.int64) * d
        kvec = tl.load(kb + dcol, mask=dmask, other=0.0).to(ACC_DT)
        vv = tl.load(V + (bh * T + t).to(tl.int64) * dv + vcol, mask=vmask, other=0.0).to(ACC_DT)
        if EVICT:  # Eq. 5 for the evicted row u = [v, w]: w is 0 when no row left the window
            eu = EU + (bh * T + t).to(tl.int64) * (dv + 1)
            psi = _gather_product(EK + (bh * T + t).to(tl.int64) * d, rr, tt, rmask, 1.0, ACC_DT)
            psi = psi * tl.load(eu + dv).to(ACC_DT)
            st += psi[:, None] * tl.load(eu + vcol, mask=vmask, other=0.0).to(ACC_DT)[None, :]
        else:
            psi = _gather_product(kb, rr, tt, rmask, 1.0, ACC_DT)
            st += psi[:, None] * vv[None, :]
        sn += tl.where(rmask, psi, 0.0)
        kmax = tl.max(tl.abs(kvec), axis=0)
        if blk == 0:
            tl.atomic_max(STATUS + 3, _nonfinite(kvec).to(tl.float32))
            tl.atomic_max(STATUS + 5, _nonfinite(vv).to(tl.float32))
            tl.atomic_max(STATUS + 2, tl.where(kmax == kmax, kmax, 0.0).to(tl.float32))
        for r in range(REP):
            row = (b * n_q + hk * REP + r) * T + t
            qb = Q + row.to(tl.int64) * d
            qvec = tl.load(qb + dcol, mask=dmask, other=0.0).to(ACC_DT)
            qmax = tl.max(tl.abs(qvec), axis=0)
            if blk == 0:
                tl.atomic_max(STATUS + 1, _nonfinite(qvec).to(tl.float32))
            s_max = scale_abs * d * qmax * kmax
            big = s_max > s_limit
            qs = tl.where(big, 1.0 / qmax, 1.0)
            inv_s = tl.where(big, 1.0 / s_max, 1.0)  # lam = s_max^2 is never formed: it can overflow
            ratio = tl.where(big, qmax, 1.0) * inv_s  # 1 / (|scale| d max|k|) when rescaled
            mult = tl.where(rr < 0, inv_s * inv_s, tl.where(tt < 0, ratio * inv_s, ratio * ratio))
            w = tl.load(W + (hk * REP + r) * F + rows, mask=rmask, other=0.0).to(ACC_DT)
            phi = w * mult * _gather_product(qb, rr, tt, rmask, qs, ACC_DT)
            if EVICT and blk == 0:  # lam = s_max^2 when rescaled, as log lam = -2 log(1 / s_max)
                tl.store(LL + row, -2.0 * tl.log(inv_s))
            out = blk.to(tl.int64) * n_bq * T + row
            tl.store(PART + out * BV + vcol, tl.sum(phi[:, None] * st, axis=0))
            tl.store(PARTN + out, tl.sum(phi * sn, axis=0))
    tl.store(sbase + rows[:, None] * (dv + 1) + vcol[None, :], st, mask=smask)
    tl.store(sbase + rows * (dv + 1) + dv, sn, mask=rmask)


@triton.jit
def _partial_sums(PART, PARTN, row, n_rows, NBLK: tl.constexpr, BV: tl.constexpr):
    """(numerator [BV], normaliser) of query row `row`: the sums of `_dec_step`'s NBLK partials."""
    vcol = tl.arange(0, BV)
    num = tl.load(PART + row.to(tl.int64) * BV + vcol)
    den = tl.load(PARTN + row)
    for i in range(1, NBLK):
        off = i * n_rows + row.to(tl.int64)
        num += tl.load(PART + off * BV + vcol)
        den += tl.load(PARTN + off)
    return num, den


@triton.jit
def _store_out(O, STATUS, row, out, dv, BV: tl.constexpr):
    """Row `row` of the output [.., dv] in O's dtype, and its non-finite flag into the output's status slot."""
    vcol = tl.arange(0, BV)
    tl.store(O + row.to(tl.int64) * dv + vcol, out.to(O.dtype.element_ty), mask=vcol < dv)
    tl.atomic_max(STATUS + 13, _nonfinite(tl.where(vcol < dv, out, 0.0)).to(tl.float32))


@triton.jit
def _dec_out(PART, PARTN, O, STATUS, n_rows, dv, NBLK: tl.constexpr, BV: tl.constexpr):
    """out = sum of the partial numerators / sum of the partial normalisers, for one (batch row, query head,
    token). Grid (B * Hq * T,)."""
    row = tl.program_id(0)
    num, den = _partial_sums(PART, PARTN, row, n_rows, NBLK, BV)
    _store_out(O, STATUS, row, num / den, dv, BV)


# ptxas (scripts/triton_sm90_check.py, sm_90, d = dv = 64): 4 warps spilled 580 bytes per thread, 8 spill 24 (0
# with EVICT, and 0 at d = dv = 128 where 4 warps spilled 436)
NUM_WARPS = 8


def rows_per_program(bv: int) -> int:
    """State rows of one _dec_step program: [RB, BV] fp32 tiles of 4096 entries (64 x 64; 32 x 128 for dv > 64,
    where 64 rows spilled 2.5 KB of registers at d = dv = 128)."""
    return 4096 // bv


def scratch(like: torch.Tensor, name: str, *shape, dtype: torch.dtype) -> torch.Tensor:
    """The decoding kernels' scratch buffer `name` on `like`'s device, shared by every plan of its shape, dtype,
    device and stream (their kernels run one after another in that stream's order)."""
    key = (name, like.device, dtype, shape)
    if like.device.type == "cuda":
        key += (torch.cuda.current_stream(like.device).cuda_stream,)
    buf = _SCRATCH.get(key)
    if buf is None:
        if len(_SCRATCH) >= 64:  # shapes come and go (batch sizes): keep the recent ones
            _SCRATCH.clear()
        buf = _SCRATCH[key] = parallel.empty(like, *shape, dtype=dtype)
    return buf


_SCRATCH: dict = {}


def kernel_operands(q, groups, factor, eps: float, scale: float, acc, *, by_version: bool):
    """`_dec_step`'s (W, ROWR, ROWT, s_limit) for OAL's kernel (groups, factor) in the state's dtype `acc`."""
    _, w = cached_coefficients(factor, groups, eps, scale, by_version=by_version, dtype=acc)
    rowr, rowt = row_maps(q.shape[-1], q.device)
    return w.to(acc).contiguous(), rowr, rowt, checks.rescale_bound(acc)[1]


def own_state(state: torch.Tensor, inplace: bool, acc) -> bool:
    """Whether the kernels may update `state` itself: `inplace` asked, and already contiguous in `acc`."""
    return inplace and state.dtype == acc and state.is_contiguous()


def state_copy(state: torch.Tensor, acc) -> torch.Tensor:
    return state.to(dtype=acc, memory_format=torch.contiguous_format, copy=True)


class Step:
    """`_dec_step`'s launch for one call signature on states of `rows` rows per head: grid, sizes, constants, meta
    and the partial sums' scratch (in the state's dtype `acc`). `kernel`: (W, ROWR, ROWT, s_limit) of
    `kernel_operands`."""

    def __init__(self, q, k, v, rows: int, kernel, scale: float, acc, *, evict: bool):
        bsz, n_q, n_t, d = q.shape
        n_kv, dv = k.shape[1], v.shape[-1]
        bv = max(16, next_pow2(dv))
        rb = rows_per_program(bv)
        self.bv, self.nblk, self.n_rows = bv, cdiv(rows, rb), bsz * n_q * n_t
        self.part = scratch(q, "part", self.nblk, self.n_rows, bv, dtype=acc)
        self.partn = scratch(q, "partn", self.nblk, self.n_rows, dtype=acc)
        self.grid = (self.nblk, bsz * n_kv)
        self.kernel = kernel[:3]
        self.sizes = (rows, d, dv, n_q, bsz * n_q)
        self.consts = (abs(scale), kernel[3])
        self.launch = Launch(self.grid, dict(T=n_t, REP=n_q // n_kv, RB=rb, BV=bv, BDQ=max(16, next_pow2(d)),
                                             ACC_DT=tl_dtype(acc), EVICT=evict, num_warps=NUM_WARPS))

    def __call__(self, q, k, v, state, status, evicted=None) -> None:
        """Update `state` [B, Hkv, F, dv+1] (each head's rows contiguous, the heads at one stride: `item_stride`)
        and write the readouts' partial sums into `part`, `partn`. `evicted`: (EK, EU, LL) of EVICT."""
        ek, eu, ll = evicted if evicted is not None else (k, v, self.part)  # unread without EVICT
        self.launch(_dec_step, q, k, v, *self.kernel, state, self.part, self.partn, status, ek, eu, ll, *self.sizes,
                    item_stride(state), *self.consts)


def item_stride(state: torch.Tensor) -> int:
    """The stride `_dec_step` steps by from one (batch row, KV head) item of `state` [B, Hkv, ...] to the next
    (item b Hkv + hk): stride(1), or stride(0) with one KV head, where stride(1) is arbitrary (the window state's
    prefix view has F (dv+1) there, not the row's size: batch row 1 then read and updated its own slots as its
    prefix)."""
    bsz, n_kv = state.shape[:2]
    step = state.stride(0) if n_kv == 1 else state.stride(1)
    if bsz > 1 and n_kv > 1 and state.stride(0) != n_kv * step:  # the kernel trusts the layout: refuse, not misread
        raise ValueError(f"state: expected its batch rows at Hkv times the KV heads' stride, got strides "
                         f"{tuple(state.stride())}")
    return step


class Plan:
    """OAL's decoding call of one signature (`oal.ops.plans`), worked out once: the kernels' operands besides q, k,
    v and the state, their grids, constants and scratch. `inplace`: the caller's state may be updated itself. The
    coefficients are cached by the kernel tensors' versions on a deferred device (no host read), else by value."""

    def __init__(self, q, k, v, groups, factor, eps: float, scale: float, state, inplace: bool):
        self.acc = checks.compute_dtype(q.dtype)
        self.inplace = own_state(state, inplace, self.acc)
        kernel = kernel_operands(q, groups, factor, eps, scale, self.acc, by_version=checks.deferred(q))
        self.step = Step(q, k, v, state.shape[2], kernel, scale, self.acc, evict=False)
        self.out_shape = (*q.shape[:3], v.shape[-1])
        self.out_args = (self.step.n_rows, v.shape[-1])
        self.out_launch = Launch((self.step.n_rows,), dict(NBLK=self.step.nblk, BV=self.step.bv))

    def __call__(self, q, k, v, state, status):
        """One call: (out [B, Hq, T, dv] in q's dtype, the updated state). q, k, v contiguous."""
        if not self.inplace:
            state = state_copy(state, self.acc)
        step = self.step
        step(q, k, v, state, status)
        out = parallel.empty(q, *self.out_shape)
        self.out_launch(_dec_out, step.part, step.partn, out, status, *self.out_args)
        return out, state
