"""Triton kernels of the parallel form: OAL without a state, for short sequences (paper Eq. 7 on the causal triangle).

FlashAttention with kappa in place of exp (like fla's `parallel_based`): per query block, a loop over the key
blocks before it; each key block's kappa tile is eps + sum_m z_m^2 with z_m = L[0, m] + scale (q * w_m) . k
(G+1 score dots, `intra._intra_z`), then the causal mask, `kappa V` and the normaliser, in fp32. No state, no
feature expansion: (G+1) * 2d + 2 dv FLOPs per (query, key) pair, quadratic in N, so it serves sequences below a
crossover length (`function.PARALLEL_MAX`) and the chunked kernels serve the rest.

Backward (FlashAttention-2 style, no atomics): GO = dO / den, DL = (dO . o) / den as in the chunked backward;
`_par_dq` walks the key blocks of a query block (dq and each program's share of d(WS), d(L0)), `_par_dkv` the
query blocks after a key block, for each query head of its KV head in turn (dk, dv).

Overflow (`checks.rescaled`, Eq. 7): every z is multiplied by zs = MULT[5] (`checks.device_rescale`'s 1 / s_max
when the scores would overflow, else 1): q as it is loaded, L[0, m] in `_intra_z`, eps by zs^2. That divides every
kappa by s_max^2, which the output does not see, so the kernels take the caller's coefficients and eps unchanged
(no torch operator per call for the rescaling). MULT is the guard's multiplier vector [qs, m_a, m_b, m_c, m_w,
m_l0]; only m_l0 = 1 / s_max is read.

Run-time loop bounds: compiled, the key loops are `for` loops (which Triton software-pipelines); Triton's CPU
interpreter cannot take a run-time bound in `range`, so under it (LOOP_FOR=False) they are `while` loops. The
loop bodies are the same jit functions.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from oal.ops.triton.blocks import _tile
from oal.ops.triton.guard import flag_out
from oal.ops.triton.intra import _intra_z, _kappa_dk
from oal.ops.triton.launch import Launch
from oal.ops.triton.tiles import cdiv, next_pow2


@triton.jit
def _query_rows(Q, K, V, zs, N, n_q, d, dv, REP: tl.constexpr, BM: tl.constexpr, BD: tl.constexpr,
                ACC_DT: tl.constexpr):
    """Program (query block, query head h, batch row b) of a per-query-head kernel: its rows, their tile of q
    (times zs, the overflow multiplier, in ACC_DT) and the key and value pointers of h's KV head."""
    pid = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    bh = (b * (n_q // REP) + h // REP).to(tl.int64)
    offs_m = pid * BM + tl.arange(0, BM)
    mmask = offs_m < N
    qrow = (b * n_q + h).to(tl.int64)
    q = _tile(Q + qrow * N * d, offs_m, mmask, tl.arange(0, BD), d).to(ACC_DT) * zs
    return pid, h, b, qrow, offs_m, mmask, q, K + bh * N * d, V + bh * N * dv


@triton.jit
def _kappa_tile(q, k, WS, L0, eps, zs, h, g1, offs_m, offs_n, N, GMAX: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BD: tl.constexpr, DOT_DT: tl.constexpr, ACC_DT: tl.constexpr, PREC: tl.constexpr):
    """kappa(q_i, k_j) times zs^2 (eps comes scaled) on the causal triangle of one [BM, BN] tile; zero where j > i
    or j >= N."""
    kap = tl.zeros([BM, BN], ACC_DT) + eps
    for m in range(GMAX):  # G is a run-time value so that one variant serves every layer
        if m < g1:
            z = _intra_z(q, k, WS, L0, zs, h, m, g1, BD, DOT_DT, ACC_DT, PREC)
            kap += z * z
    return tl.where((offs_m[:, None] >= offs_n[None, :]) & (offs_n < N)[None, :], kap, 0.0)


@triton.jit
def _fwd_block(acc, den, q, kh, vh, WS, L0, eps, zs, h, g1, s, offs_m, N, d, dv, GMAX: tl.constexpr, BM: tl.constexpr,
               BN: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, DOT_DT: tl.constexpr, ACC_DT: tl.constexpr,
               PREC: tl.constexpr):
    offs_n = s + tl.arange(0, BN)
    nmask = offs_n < N
    k = _tile(kh, offs_n, nmask, tl.arange(0, BD), d).to(ACC_DT).to(DOT_DT)
    v = _tile(vh, offs_n, nmask, tl.arange(0, BV), dv).to(ACC_DT).to(DOT_DT)
    kap = _kappa_tile(q, k, WS, L0, eps, zs, h, g1, offs_m, offs_n, N, GMAX, BM, BN, BD, DOT_DT, ACC_DT, PREC)
    acc = tl.dot(kap.to(DOT_DT), v, acc, input_precision=PREC, out_dtype=ACC_DT)
    return acc, den + tl.sum(kap, axis=1)


@triton.jit
def _par_fwd(
    Q, K, V, WS, L0, EPS, MULT, O, DEN, STATUS,
    N, n_q, d, dv, g1, NBKT,
    REP: tl.constexpr, GMAX: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, DOT_DT: tl.constexpr,
    ACC_DT: tl.constexpr, PREC: tl.constexpr, LOOP_FOR: tl.constexpr, CHECK: tl.constexpr, BM: tl.constexpr,
    BN: tl.constexpr,
):
    """Output (and normaliser) of one block of BM queries of one query head. Grid (cdiv(N, BM), Hq, B).

    CHECK: the output's value check into STATUS (`guard.flag_out`). NBKT (the length's power-of-two bucket) is read
    by nothing: it is the autotuner's key."""
    zs = tl.load(MULT + 5)
    pid, h, b, qrow, offs_m, mmask, q, kh, vh = _query_rows(Q, K, V, zs, N, n_q, d, dv, REP, BM, BD, ACC_DT)
    eps = tl.load(EPS) * zs * zs
    acc = tl.zeros([BM, BV], ACC_DT)
    den = tl.zeros([BM], ACC_DT)
    hi = tl.minimum((pid + 1) * BM, N)
    if LOOP_FOR:
        for s in range(0, hi, BN):
            acc, den = _fwd_block(acc, den, q, kh, vh, WS, L0, eps, zs, h, g1, s, offs_m, N, d, dv, GMAX, BM, BN, BD,
                                  BV, DOT_DT, ACC_DT, PREC)
    else:
        s = 0
        while s < hi:
            acc, den = _fwd_block(acc, den, q, kh, vh, WS, L0, eps, zs, h, g1, s, offs_m, N, d, dv, GMAX, BM, BN, BD,
                                  BV, DOT_DT, ACC_DT, PREC)
            s += BN
    vcol = tl.arange(0, BV)
    out = (acc / tl.where(mmask, den, 1.0)[:, None]).to(O.dtype.element_ty)
    omask = mmask[:, None] & (vcol < dv)[None, :]
    tl.store(O + qrow * N * dv + offs_m[:, None] * dv + vcol[None, :], out, mask=omask)
    if CHECK:
        flag_out(STATUS, out, omask)
    tl.store(DEN + qrow * N + offs_m, den, mask=mmask)


@triton.jit
def _dq_block(dq, dws, dl0, q, go, dl, kh, vh, WS, L0, zs, h, g1, s, offs_m, N, d, dv, GMAX: tl.constexpr,
              BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, DOT_DT: tl.constexpr,
              ACC_DT: tl.constexpr, PREC: tl.constexpr):
    """One key block's share of dq and of the (G+1) x BD gradient of WS and the G+1 of L0."""
    offs_n = s + tl.arange(0, BN)
    nmask = offs_n < N
    dcol = tl.arange(0, BD)
    k = _tile(kh, offs_n, nmask, dcol, d).to(ACC_DT).to(DOT_DT)
    v = _tile(vh, offs_n, nmask, tl.arange(0, BV), dv).to(ACC_DT).to(DOT_DT)
    dkap = tl.dot(go, tl.trans(v), input_precision=PREC, out_dtype=ACC_DT) - dl[:, None]
    dkap2 = tl.where((offs_m[:, None] >= offs_n[None, :]) & nmask[None, :], 2.0 * dkap, 0.0)  # dz_m's 2, once
    rows = tl.arange(0, GMAX)
    for m in range(GMAX):
        if m < g1:
            dz = _intra_z(q, k, WS, L0, zs, h, m, g1, BD, DOT_DT, ACC_DT, PREC) * dkap2
            t = tl.dot(dz.to(DOT_DT), k, input_precision=PREC, out_dtype=ACC_DT)  # sum_j dz_ij k_j
            dq += t * tl.load(WS + (h * g1 + m) * BD + dcol)[None, :]
            # rows of a register tile cannot be indexed at run time: add row m through a mask
            dws += tl.where((rows == m)[:, None], tl.sum(q.to(ACC_DT) * t, axis=0)[None, :], 0.0)
            dl0 += tl.where(rows == m, tl.sum(tl.sum(dz, axis=1), axis=0), 0.0)
    return dq, dws, dl0


@triton.jit
def _par_dq(
    Q, K, V, GO, DL, WS, L0, MULT, DQ, PART,
    N, n_q, d, dv, g1, NBKT,
    REP: tl.constexpr, GMAX: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, DOT_DT: tl.constexpr,
    ACC_DT: tl.constexpr, PREC: tl.constexpr, LOOP_FOR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    """dq of one block of BM queries of one query head, and its share of d(WS) [GMAX, BD] and d(L0) [GMAX] in
    PART[b, pid, h] (GMAX * BD + GMAX entries). Grid (cdiv(N, BM), Hq, B)."""
    zs = tl.load(MULT + 5)
    pid, h, b, qrow, offs_m, mmask, q, kh, vh = _query_rows(Q, K, V, zs, N, n_q, d, dv, REP, BM, BD, ACC_DT)
    dcol = tl.arange(0, BD)
    go = _tile(GO + qrow * N * dv, offs_m, mmask, tl.arange(0, BV), dv).to(DOT_DT)
    dl = tl.load(DL + qrow * N + offs_m, mask=mmask, other=0.0)
    dq = tl.zeros([BM, BD], ACC_DT)
    dws = tl.zeros([GMAX, BD], ACC_DT)
    dl0 = tl.zeros([GMAX], ACC_DT)
    hi = tl.minimum((pid + 1) * BM, N)
    if LOOP_FOR:
        for s in range(0, hi, BN):
            dq, dws, dl0 = _dq_block(dq, dws, dl0, q, go, dl, kh, vh, WS, L0, zs, h, g1, s, offs_m, N, d, dv, GMAX, BM,
                                     BN, BD, BV, DOT_DT, ACC_DT, PREC)
    else:
        s = 0
        while s < hi:
            dq, dws, dl0 = _dq_block(dq, dws, dl0, q, go, dl, kh, vh, WS, L0, zs, h, g1, s, offs_m, N, d, dv, GMAX, BM,
                                     BN, BD, BV, DOT_DT, ACC_DT, PREC)
            s += BN
    dq = dq * zs  # the gradient for the caller's q (the kernel's is q * zs)
    tl.store(DQ + qrow * N * d + offs_m[:, None] * d + dcol[None, :], dq.to(DQ.dtype.element_ty),
             mask=mmask[:, None] & (dcol < d)[None, :])
    part = PART + ((b * tl.num_programs(0) + pid) * n_q + h).to(tl.int64) * (GMAX * BD + GMAX)
    rows = tl.arange(0, GMAX)
    tl.store(part + rows[:, None] * BD + dcol[None, :], dws)
    tl.store(part + GMAX * BD + rows, dl0 * zs)  # L[0, m] enters z times zs


@triton.jit
def _dkv_block(dk, dv_acc, k, v, qh, zs, goh, dlh, WS, L0, eps, h, g1, s, offs_n, N, d, dv, GMAX: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, DOT_DT: tl.constexpr,
               ACC_DT: tl.constexpr, PREC: tl.constexpr):
    """One query block's share of dk and dv for the key block (k, v) and query head h."""
    offs_m = s + tl.arange(0, BM)
    mmask = offs_m < N
    dcol = tl.arange(0, BD)
    vcol = tl.arange(0, BV)
    q = _tile(qh, offs_m, mmask, dcol, d).to(ACC_DT) * zs
    go = _tile(goh, offs_m, mmask, vcol, dv).to(DOT_DT)
    dl = tl.load(dlh + offs_m, mask=mmask, other=0.0)
    causal = (offs_m[:, None] >= offs_n[None, :]) & (offs_n < N)[None, :]
    dkap = tl.where(causal, tl.dot(go, tl.trans(v), input_precision=PREC, out_dtype=ACC_DT) - dl[:, None], 0.0)
    kap, dk = _kappa_dk(q, k, dkap, dk, causal, WS, L0, eps, zs, h, g1, GMAX, BM, BN, BD, DOT_DT, ACC_DT, PREC)
    dv_acc = tl.dot(tl.trans(kap.to(DOT_DT)), go, dv_acc, input_precision=PREC, out_dtype=ACC_DT)
    return dk, dv_acc


@triton.jit
def _par_dkv(
    Q, K, V, GO, DL, WS, L0, EPS, MULT, DK, DV,
    N, n_q, d, dv, g1, NBKT,
    REP: tl.constexpr, GMAX: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, DOT_DT: tl.constexpr,
    ACC_DT: tl.constexpr, PREC: tl.constexpr, LOOP_FOR: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
):
    """dk and dv of one block of BN keys of one KV head, over the query blocks at and after it, one query head of
    the KV head at a time (no atomics). Grid (cdiv(N, BN), Hkv, B)."""
    pid = tl.program_id(0)
    hk = tl.program_id(1)
    b = tl.program_id(2)
    n_kv = n_q // REP
    bh = (b * n_kv + hk).to(tl.int64)
    offs_n = pid * BN + tl.arange(0, BN)
    nmask = offs_n < N
    dcol = tl.arange(0, BD)
    vcol = tl.arange(0, BV)
    k = _tile(K + bh * N * d, offs_n, nmask, dcol, d).to(ACC_DT).to(DOT_DT)
    v = _tile(V + bh * N * dv, offs_n, nmask, vcol, dv).to(ACC_DT).to(DOT_DT)
    zs = tl.load(MULT + 5)
    eps = tl.load(EPS) * zs * zs
    dk = tl.zeros([BN, BD], ACC_DT)
    dv_acc = tl.zeros([BN, BV], ACC_DT)
    lo = (pid * BN // BM) * BM  # the query block holding this key block's first key
    for r in range(REP):
        h = hk * REP + r
        qrow = (b * n_q + h).to(tl.int64)
        qh = Q + qrow * N * d
        goh = GO + qrow * N * dv
        dlh = DL + qrow * N
        if LOOP_FOR:
            for s in range(lo, N, BM):
                dk, dv_acc = _dkv_block(dk, dv_acc, k, v, qh, zs, goh, dlh, WS, L0, eps, h, g1, s, offs_n, N, d, dv,
                                        GMAX, BM, BN, BD, BV, DOT_DT, ACC_DT, PREC)
        else:
            s = lo
            while s < N:
                dk, dv_acc = _dkv_block(dk, dv_acc, k, v, qh, zs, goh, dlh, WS, L0, eps, h, g1, s, offs_n, N, d, dv,
                                        GMAX, BM, BN, BD, BV, DOT_DT, ACC_DT, PREC)
                s += BM
    tl.store(DK + bh * N * d + offs_n[:, None] * d + dcol[None, :], dk.to(DK.dtype.element_ty),
             mask=nmask[:, None] & (dcol < d)[None, :])
    tl.store(DV + bh * N * dv + offs_n[:, None] * dv + vcol[None, :], dv_acc.to(DV.dtype.element_ty),
             mask=nmask[:, None] & (vcol < dv)[None, :])


# Tiles of the parallel kernels: BM queries x BN keys, 4 warps (8 warps with chained dots: see tiles.NUM_WARPS).
# Compiled, `triton.autotune` picks among the configs of the shape (`configs`) on the first call per (d, dv, G,
# dtypes, length bucket); every config is compiled for sm_90 and sm_80 by scripts/triton_sm90_check.py. fp32 inputs
# at d or dv > 64 (tf32x3 dots keep two operand copies) need smaller tiles: 64 x 64 took 256 KB of shared memory
# for the dk/dv kernel on sm_90. The interpreter runs DEFAULT.
CONFIGS = [(64, 64, 2), (64, 64, 3), (128, 64, 2), (128, 32, 3)]  # (BM, BN, stages)
CONFIGS_FP32_BIG = [(32, 32, 2), (64, 32, 2), (32, 64, 2)]
DEFAULT = (64, 64, 2)
NUM_WARPS = 4
MIN_BM = min(bm for bm, _, _ in CONFIGS + CONFIGS_FP32_BIG)  # the dq partials are allocated for it
# Tests set this to fill the outputs with NaN before the kernels write them, so that an unwritten entry shows up.
NAN_SCRATCH = False


def configs(half: bool, big: bool) -> list[tuple[int, int, int]]:
    """The (BM, BN, stages) the autotuner may pick for half-precision dots or not, max(d, dv) > 64 or not."""
    return CONFIGS_FP32_BIG if big and not half else CONFIGS


def empty(like: torch.Tensor, *shape, dtype=None) -> torch.Tensor:
    out = like.new_empty(shape, dtype=dtype or like.dtype)
    return out.fill_(float("nan")) if NAN_SCRATCH else out


def short_bench(fn, quantiles):
    """The autotuners' timing: short (they run on the first call per key, inside the caller's first call)."""
    return triton.testing.do_bench(fn, warmup=5, rep=25, quantiles=quantiles)


@functools.cache
def tuned(kernel, half: bool, big: bool):
    """`kernel` autotuned over `configs(half, big)` (compiled runs only). dq's partials (PART) are zeroed before
    each config's trial and after the last: a config with larger query blocks writes fewer rows, and the sum over
    all rows would otherwise take the rows a smaller one left there."""
    options = [triton.Config({"BM": bm, "BN": bn}, num_warps=NUM_WARPS, num_stages=st)
               for bm, bn, st in configs(half, big)]
    reset = ["PART"] if "PART" in kernel.arg_names else None
    return triton.autotune(options, key=["d", "dv", "g1", "NBKT"], do_bench=short_bench, reset_to_zero=reset)(kernel)


def _site(device, grid, consts: dict) -> tuple[bool, object, dict]:
    """(tuned, grid, meta) of a launch: on a GPU the autotuned kernel and a grid of its config's tiles, under the
    interpreter DEFAULT's; grid(BM, BN) -> the grid."""
    if device.type == "cuda":
        return True, lambda meta: grid(meta["BM"], meta["BN"]), dict(consts, LOOP_FOR=True)
    bm, bn, stages = DEFAULT
    return False, grid(bm, bn), dict(consts, LOOP_FOR=False, BM=bm, BN=bn, num_warps=NUM_WARPS, num_stages=stages)


def _kernel(kernel, consts: dict, is_tuned: bool):
    """`kernel`, autotuned on a GPU over the configs of its dtypes and head dims."""
    if not is_tuned:
        return kernel
    return tuned(kernel, consts["DOT_DT"] in (tl.bfloat16, tl.float16), max(consts["BD"], consts["BV"]) > 64)


def _launch(kernel, grid, *args, **consts):
    """Launch with the tuned tiles on a GPU, DEFAULT under the interpreter; grid(BM, BN) -> the grid."""
    is_tuned, grid, meta = _site(args[0].device, grid, consts)
    _kernel(kernel, consts, is_tuned)[grid](*args, **meta)


def _consts(q, v, consts: dict, gmax: int) -> dict:
    d, dv = q.shape[-1], v.shape[-1]
    return dict(REP=q.shape[1] // v.shape[1], GMAX=gmax, BD=max(16, next_pow2(d)),
                BV=max(16, next_pow2(dv)), **{name: consts[name] for name in ("DOT_DT", "ACC_DT", "PREC")})


class Forward:
    """`_par_fwd`'s launch for inputs of one shape: its sizes, grid and meta worked out once (a prefill plan keeps
    one, `oal.ops.triton.prefill`; OAL_TRITON_DIRECT_LAUNCH=1 then launches it directly, `launch.Launch`).
    c: the kernel's constants (`_consts`); g1: G + 1; check: whether the kernel checks its output into a status."""

    def __init__(self, q, v, c: dict, g1: int, acc_dtype: torch.dtype, check: bool):
        bsz, n_q, n, d = q.shape
        self.out_shape, self.den_shape, self.acc = (bsz, n_q, n, v.shape[-1]), (bsz, n_q, n), acc_dtype
        self.sizes = (n, n_q, d, v.shape[-1], g1, bucket(n))
        self.tuned, grid, meta = _site(q.device, lambda bm, bn: (cdiv(n, bm), n_q, bsz), dict(c, CHECK=check))
        self.c, self.launch = c, Launch(grid, meta)

    def __call__(self, q, k, v, ws, l0, eps_t, mult, status):
        """(out, normaliser); `status` None: no output check (`check` False)."""
        o = empty(q, *self.out_shape)
        den = empty(q, *self.den_shape, dtype=self.acc)
        self.launch(_kernel(_par_fwd, self.c, self.tuned), q, k, v, ws, l0, eps_t, mult, o, den,
                    eps_t if status is None else status, *self.sizes)
        return o, den


def _forward(q, k, v, ws, l0, eps_t, mult, status, c: dict, acc_dtype: torch.dtype):
    """(out, normaliser) from one launch of `_par_fwd`; c: its constants (`_consts`). A one-off launch: a plan
    keeps a `Forward` instead."""
    bsz, n_q, n, _ = q.shape
    o = empty(q, bsz, n_q, n, v.shape[-1])
    den = empty(q, bsz, n_q, n, dtype=acc_dtype)
    args = (q, k, v, ws, l0, eps_t, mult, o, den, eps_t if status is None else status, n, n_q, q.shape[-1],
            v.shape[-1], ws.shape[1], bucket(n))
    _launch(_par_fwd, lambda bm, bn: (cdiv(n, bm), n_q, bsz), *args, **c, CHECK=status is not None)
    return o, den


class OALParallel(torch.autograd.Function):
    """Causal OAL without a state on the parallel kernels; gradients for q, k, v, WS and L0 (the factor's through
    torch, as for the chunked kernels)."""

    @staticmethod
    def forward(ctx, q, k, v, ws, l0, eps_t, mult, status, consts: dict, gmax: int, acc_dtype: torch.dtype):
        c = _consts(q, v, consts, gmax)
        o, den = _forward(q, k, v, ws, l0, eps_t, mult, status, c, acc_dtype)
        ctx.save_for_backward(q, k, v, ws, l0, eps_t, mult, o, den)
        ctx.c = c
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, ws, l0, eps_t, mult, o, den = ctx.saved_tensors
        c = ctx.c
        bsz, n_q, n, d = q.shape
        n_kv, dv = k.shape[1], v.shape[-1]
        g1, acc = ws.shape[1], den.dtype
        do = do.to(acc)
        go = (do / den[..., None]).to(torch.bfloat16 if c["DOT_DT"] == tl.bfloat16 else acc).contiguous()
        dl = ((do * o.to(acc)).sum(-1) / den).contiguous()
        dq, dk, dv_ = empty(q, *q.shape), empty(k, *k.shape), empty(v, *v.shape)
        width = c["GMAX"] * c["BD"] + c["GMAX"]
        part = q.new_zeros(bsz * cdiv(n, MIN_BM) * n_q, width, dtype=acc)
        tail = (n, n_q, d, dv, g1, bucket(n))
        _launch(_par_dq, lambda bm, bn: (cdiv(n, bm), n_q, bsz), q, k, v, go, dl, ws, l0, mult, dq, part, *tail,
                **c)
        _launch(_par_dkv, lambda bm, bn: (cdiv(n, bn), n_kv, bsz), q, k, v, go, dl, ws, l0, eps_t, mult, dk, dv_,
                *tail, **c)
        # the partials of every (batch row, query block) of head h: rows b * blocks * Hq + block * Hq + h
        part = part.view(-1, n_q, width).sum(0)
        dws = part[:, : c["GMAX"] * c["BD"]].view(n_q, c["GMAX"], c["BD"])[:, :g1]
        dl0 = part[:, c["GMAX"] * c["BD"]:][:, :g1]
        return dq, dk, dv_, dws, dl0, None, None, None, None, None, None


def bucket(n: int) -> int:
    """The autotuners' length key: log2 of N rounded up."""
    return max(0, (n - 1).bit_length())


def attention(q, k, v, ws, l0, eps_t, mult, consts: dict, gmax: int, status=None):
    """Causal OAL of a fresh sequence without its state: out [B, Hq, N, dv] in q's dtype. q, k, v contiguous;
    ws [Hq, G+1, BD], l0 [Hq, G+1] as `function._params` builds them; eps_t (eps) and mult (the guard's overflow
    multipliers, see the module docstring) on the device. `status`: the call's device checks, into which the
    forward kernel writes its output check (None: no check). Without a gradient to compute, the kernel runs
    without autograd's bookkeeping (a few µs of host time a call)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, ws, l0)):
        return OALParallel.apply(q, k, v, ws, l0, eps_t, mult, status, consts, gmax, eps_t.dtype)
    return _forward(q, k, v, ws, l0, eps_t, mult, status, _consts(q, v, consts, gmax), eps_t.dtype)[0]
