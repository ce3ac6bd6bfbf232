"""Triton kernels of OAL attention (paper Eq. 5-7, App. D), forward and backward.

Layout of the state of one KV head in these kernels ("block layout", R rows x dv columns, plus a separate
normaliser column of R entries, which is the state's last column dv+1 of the packed contract):

    row 0                       H0 (sum of u_j)
    rows 1 .. D16               H1 (sum of k_jr u_j), d padded to D16 = 16 * NB with zeros
    rows 1 + D16 + 256 p + f    H2 for the block pair p = (I, J), I <= J, of 16-wide feature blocks,
                                f = 16 r + t  ->  sum of k_j(16I+r) k_j(16J+t) u_j

The diagonal pairs (I, I) hold both (r, t) and (t, r), so the quadratic readout sums every ordered pair of a
diagonal block once and every pair of an off-diagonal block twice (multiplicity 2; `pairs` lists the diagonal
pairs first). Features are formed in registers and fed to `tl.dot`; they never go to HBM. A pair is taken in
16 / RH steps of RH rows of block I (RH * 16 features, rows 1 + D16 + 256 p + 16 RH s ..): RH is a compile-time
tile size chosen per shape and target (tiles.py) so that the dot operands fit in shared memory at d, dv = 128.

Per query head h the coefficients come in as A[h] = a (eps included), BS[h, r] = scale b_r,
CS[h, r, t] = scale^2 C_rt, and for the dense intra-chunk kernel WS[h, m, r] = scale L[g(r)+1, m],
L0[h, m] = L[0, m], with kappa = eps + sum_m (L0[m] + (q * WS[m]) . k)^2 (Eq. 7).
"""

from __future__ import annotations

import triton
import triton.language as tl

from oal.ops.triton.blocks import (
    _block,
    _carry_in,
    _flat,
    _kv_chunk,
    _norm_acc,
    _norm_ops,
    _norm_rows,
    _norm_store,
    _norm_vals,
    _pair_coef,
    _pair_cs,
    _pair_step,
    _place,
    _query_chunk,
    _scan_inputs,
    _scan_step,
    _scatter,
    _state,
    _sub,
    _tile,
)
from oal.ops.triton.guard import flag_out
from oal.ops.triton.intra import _intra_z, _kappa_dk

BLK = 16  # feature block width: a block pair is 16 x 16 = 256 features, tl.dot's smallest K is 16


@triton.jit(do_not_specialize=["store", "has_carry", "add_prev"])  # run-time flags: one variant serves all
def _state_scan(
    X, Y, NW, A, BS, CS, PAIRS, ST, STN, TOT, TOTN, CARRY, CARRYN, PREV, PREVN,
    N, HX, n_seg, d, dv, R, store, has_carry, add_prev,
    NB: tl.constexpr, SEG: tl.constexpr, REP: tl.constexpr, C: tl.constexpr, BV: tl.constexpr, NPAIR: tl.constexpr,
    RH: tl.constexpr, QUERY: tl.constexpr, REVERSE: tl.constexpr,
    DOT_DT: tl.constexpr, ACC_DT: tl.constexpr, PREC: tl.constexpr, NORM_DOT: tl.constexpr,
):
    """Scan of state increments over the chunks of one segment, for one feature block of one KV head.

    Keys mode (QUERY=False, REP=1): X = k, Y = v; the increment of chunk c is psi(K_c)^T [V_c | 1] (Eq. 5).
    Query mode (QUERY=True): X = q, Y = dO / den, NW = -delta, summed over the REP query heads of the KV head:
    phi(Q_c)^T [Y_c | NW_c], the gradient that chunk c's readout sends to its state (Eq. 6, backward).
    The running value starts at zero, plus CARRY (the initial state of the KV head) when `has_carry`, plus the sums
    of the earlier segments in PREV when `add_prev` (`_carry_in`), and ends in TOT; with `store` it is also
    written before each chunk (exclusive; REVERSE scans from the segment's last chunk: suffix sums).
    The running value is fp32 whatever the dot type. ST takes it in its own dtype: bf16 for half inputs in keys
    mode, which the output and dq kernels' bf16 dots would round it to anyway (the H0 row, added outside a dot,
    is rounded too), fp32 in query mode, where `_bwd_dkv` adds the carry before rounding. The normaliser (STN),
    the segment ends and the carries stay fp32.
    SEG (chunks per segment) is a compile-time constant, a power of four (see function._segments), so a few
    variants are compiled. The state tensor holds n_seg * SEG chunks; those past N add nothing.
    NORM_DOT (keys mode; the host sets it for half inputs): the H2 normaliser rows are summed by a dot of the
    rounded features against `_norm_cols`, as the state's own rows are, rather than in registers (there the
    reduction over the chunk's tokens took about a quarter of the loop's instructions). In query mode, and for
    fp32 and fp64 inputs (whose three-pass dots cost more registers than the sums), they are summed in registers.
    Grid: (NPAIR * 16 / RH + NB + 1 feature blocks, n_seg, B * Hkv); an H2 program owns RH * 16 state rows.
    """
    D16 = NB * 16
    NS: tl.constexpr = 16 // RH
    REG: tl.constexpr = QUERY or not NORM_DOT
    SPLIT: tl.constexpr = NORM_DOT and not QUERY  # the per-chunk normaliser stored split (`_norm_store`)
    pid_t = tl.program_id(0)
    seg = tl.program_id(1)
    bh = tl.program_id(2)
    n_kv = HX // REP
    b = bh // n_kv
    hk = bh % n_kv
    vcol = tl.arange(0, BV)
    vmask = vcol < dv
    st_base = bh.to(tl.int64) * (n_seg * SEG) * R
    tot_base = (bh * n_seg + seg).to(tl.int64) * R
    if pid_t < NPAIR * NS:  # H2, one step of one block pair
        p = pid_t // NS
        s = pid_t % NS
        I = tl.load(PAIRS + 2 * p)
        J = tl.load(PAIRS + 2 * p + 1)
        rows = 1 + D16 + p * 256 + s * RH * 16 + tl.arange(0, RH * 16)
        acc = _carry_in(tl.zeros([RH * 16, BV], ACC_DT), CARRY, PREV, bh, seg, n_seg, rows, vcol, dv, R, has_carry,
                        add_prev, False)
        accn = _norm_acc(_carry_in(tl.zeros([RH * 16], ACC_DT), CARRYN, PREVN, bh, seg, n_seg, rows, vcol, dv, R,
                                   has_carry, add_prev, True), RH, REG)
        for i in range(SEG):
            c, tok, tmask = _scan_step(seg, i, N, SEG, C, REVERSE)
            if store:
                off = st_base + c * R + rows
                tl.store(ST + off[:, None] * dv + vcol[None, :], acc.to(ST.dtype.element_ty), mask=vmask[None, :])
                _norm_store(STN, off, _norm_rows(accn, RH, REG), SPLIT, DOT_DT)
            for r in range(REP):
                xh = (b * HX + hk * REP + r).to(tl.int64)
                f3 = _sub(X + xh * N * d, tok, tmask, I, s, d, RH).to(ACC_DT)[:, :, None]
                f3 = f3 * _block(X + xh * N * d, tok, tmask, J, d).to(ACC_DT)[:, None, :]
                if QUERY:
                    f3 = f3 * _pair_coef(CS, hk * REP + r, I, J, s, D16, RH)[None, :, :]
                y, nw = _scan_inputs(Y, NW, xh, tok, tmask, vcol, N, dv, QUERY, ACC_DT, DOT_DT)
                f2 = tl.trans(_flat(f3.to(DOT_DT), C, RH))
                acc = tl.dot(f2, y, acc, input_precision=PREC, out_dtype=ACC_DT)
                if REG:
                    accn += tl.sum(f3 * nw[:, None, None], axis=0)
                else:
                    # keys mode: nw is 1 on the chunk's tokens, so its `_norm_cols` is that mask in column 0
                    ones = tl.where((tl.arange(0, 16) == 0)[None, :] & tmask[:, None], 1.0, 0.0).to(DOT_DT)
                    accn = tl.dot(f2, ones, accn, input_precision=PREC, out_dtype=ACC_DT)
        tl.store(TOT + (tot_base + rows)[:, None] * dv + vcol[None, :], acc, mask=vmask[None, :])
        tl.store(TOTN + tot_base + rows, _norm_rows(accn, RH, REG))
    elif pid_t < NPAIR * NS + NB:  # H1, one 16-wide block
        I1 = pid_t - NPAIR * NS
        rows1 = 1 + I1 * 16 + tl.arange(0, 16)
        acc1 = _carry_in(tl.zeros([16, BV], ACC_DT), CARRY, PREV, bh, seg, n_seg, rows1, vcol, dv, R, has_carry,
                         add_prev, False)
        accn1 = _carry_in(tl.zeros([16], ACC_DT), CARRYN, PREVN, bh, seg, n_seg, rows1, vcol, dv, R, has_carry,
                          add_prev, True)
        for i in range(SEG):
            c1, tok1, tmask1 = _scan_step(seg, i, N, SEG, C, REVERSE)
            if store:
                off1 = st_base + c1 * R + rows1
                tl.store(ST + off1[:, None] * dv + vcol[None, :], acc1.to(ST.dtype.element_ty), mask=vmask[None, :])
                _norm_store(STN, off1, accn1, SPLIT, DOT_DT)
            for r in range(REP):
                xh1 = (b * HX + hk * REP + r).to(tl.int64)
                f1 = _block(X + xh1 * N * d, tok1, tmask1, I1, d).to(ACC_DT)
                if QUERY:
                    f1 = f1 * tl.load(BS + (hk * REP + r) * D16 + I1 * 16 + tl.arange(0, 16))[None, :]
                y1, nw1 = _scan_inputs(Y, NW, xh1, tok1, tmask1, vcol, N, dv, QUERY, ACC_DT, DOT_DT)
                acc1 = tl.dot(tl.trans(f1.to(DOT_DT)), y1, acc1, input_precision=PREC, out_dtype=ACC_DT)
                accn1 += tl.sum(f1 * nw1[:, None], axis=0)
        tl.store(TOT + (tot_base + rows1)[:, None] * dv + vcol[None, :], acc1, mask=vmask[None, :])
        tl.store(TOTN + tot_base + rows1, accn1)
    else:  # H0
        one = tl.arange(0, 1)
        acc0 = tl.reshape(_carry_in(tl.zeros([1, BV], ACC_DT), CARRY, PREV, bh, seg, n_seg, one, vcol, dv, R,
                                    has_carry, add_prev, False), [BV])
        accn0 = _carry_in(tl.zeros([1], ACC_DT), CARRYN, PREVN, bh, seg, n_seg, one, vcol, dv, R, has_carry, add_prev,
                          True)
        for i in range(SEG):
            c0, tok0, tmask0 = _scan_step(seg, i, N, SEG, C, REVERSE)
            if store:
                tl.store(ST + (st_base + c0 * R) * dv + vcol, acc0.to(ST.dtype.element_ty), mask=vmask)
                _norm_store(STN, st_base + c0 * R + one, accn0, SPLIT, DOT_DT)
            for r in range(REP):
                xh0 = (b * HX + hk * REP + r).to(tl.int64)
                y0, nw0 = _scan_inputs(Y, NW, xh0, tok0, tmask0, vcol, N, dv, QUERY, ACC_DT, ACC_DT)
                coef = 1.0
                if QUERY:
                    coef = tl.load(A + hk * REP + r)
                acc0 += coef * tl.sum(y0, axis=0)
                accn0 += coef * tl.sum(nw0, axis=0)
        tl.store(TOT + tot_base * dv + vcol, acc0, mask=vmask)
        tl.store(TOTN + tot_base + one, accn0)


@triton.jit
def _fwd_out(
    Q, K, V, A, BS, CS, WS, L0, EPS, MULT, PAIRS, ST, STN, O, DEN, STATUS,
    N, n_q, n_cs, d, dv, R, g1, NBKT,
    NB: tl.constexpr, REP: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, NPAIR: tl.constexpr,
    GMAX: tl.constexpr, RH: tl.constexpr, DOT_DT: tl.constexpr, ACC_DT: tl.constexpr, PREC: tl.constexpr,
    CHECK: tl.constexpr, NORM_DOT: tl.constexpr, PROD_DT: tl.constexpr,
):
    """Output of one chunk of one query head: intra-chunk Eq. 7 plus the readout of the chunk's state (Eq. 6).

    Grid (Hq, n_c, B): the query heads of a KV head are adjacent, so K, V and the chunk's state come from L2.
    Loops run at run time: unrolled, the compiler keeps every iteration's tiles live and runs out of registers.
    EPS: eps as a device scalar. MULT: the overflow multipliers [qs, m_a, m_b, m_c, m_w, m_l0] of
    `checks.device_rescale`, applied here (all 1 where the caller rescaled): q times qs for the features, a, b, C
    times m_a, m_b, m_c, and the intra-chunk z times zs = m_l0 = m_w qs (eps times zs^2), so every kappa is
    kappa / lam with no torch operator. CHECK: the output's value check into STATUS (`guard.flag_out`). NBKT (the
    length's power-of-two bucket) is read by nothing: it is the autotuner's key. NORM_DOT (half inputs): the
    normaliser's readout of H1 and H2 is a dot of the rounded features against `_norm_cols`, beside the
    numerator's dot, its operand loaded as the key scan stored it (`_norm_ops`); otherwise it is summed in
    registers from the unrounded features. PROD_DT: the type of the feature products (`function._prod_dt`).
    """
    D16 = NB * 16
    h, c, b, n_kv, hk, tok, tmask, dcol, vcol, qh, q, k, v = _query_chunk(Q, K, V, N, n_q, d, dv, REP, C, BD, BV,
                                                                          ACC_DT, DOT_DT)
    j16 = tl.arange(0, 16)
    qs = tl.load(MULT)
    m_b = tl.load(MULT + 2)
    m_c = tl.load(MULT + 3)
    zs = tl.load(MULT + 5)
    # inter-chunk: phi(q) . S_c (Eq. 6); S_c holds every earlier chunk. Block pairs first, their features
    # without a scalar factor (one multiplied in each step cost a layout conversion there: about 30% of the step's
    # instructions): the diagonal pairs come first (`function._maps`), their sums are halved where the
    # off-diagonal ones begin, and everything is doubled and rescaled (qs^2 m_c) once after the loop, before
    # anything else is in acc (x 0.5 and x 2 are exact). With NORM_DOT the normaliser's readout rides on the dots
    # (`_norm_cols`): summed in registers it took about 60% of the bf16 pair loop's instructions (lane shuffles),
    # and that loop issued about 5x its MMA time.
    base = ((b * n_kv + hk) * n_cs + c).to(tl.int64) * R
    acc = tl.zeros([C, BV], ACC_DT)
    den = tl.zeros([C], ACC_DT)
    den_mma = tl.zeros([C, 16], ACC_DT)
    for p in range(NPAIR):
        pi = tl.load(PAIRS + 2 * p)
        pj = tl.load(PAIRS + 2 * p + 1)
        if p == NB:  # the first off-diagonal pair
            acc = acc * 0.5
            den = den * 0.5
            den_mma = den_mma * 0.5
        for s in range(16 // RH):
            rows2, q_i, q_j = _pair_step(pi, pj, p, s, qh, tok, tmask, d, D16, RH, PROD_DT)
            f3 = q_i[:, :, None] * q_j[:, None, :] * _pair_cs(CS, h, pi, pj, s, D16, RH).to(PROD_DT)[None, :, :]
            f2 = _flat(f3.to(DOT_DT), C, RH)  # rounded, then reshaped
            acc = tl.dot(f2, _state(ST, base, rows2, vcol, dv).to(DOT_DT), acc, input_precision=PREC,
                         out_dtype=ACC_DT)
            if NORM_DOT:
                den_mma = tl.dot(f2, _norm_ops(STN, base, rows2), den_mma, input_precision=PREC, out_dtype=ACC_DT)
            else:
                sn = tl.reshape(tl.load(STN + base + rows2), [RH, 16])
                den += tl.sum(tl.sum(f3 * sn[None, :, :], axis=2), axis=1)
    w2 = qs * qs * m_c
    if NPAIR > NB:  # a compile-time branch: off-diagonal pairs count twice
        w2 = w2 * 2.0
    acc = acc * w2
    den = den * w2
    den_mma = den_mma * w2
    for I in range(NB):
        rows = 1 + I * 16 + j16
        f1 = _block(qh, tok, tmask, I, d).to(ACC_DT) * qs * (tl.load(BS + h * D16 + I * 16 + j16) * m_b)[None, :]
        f1d = f1.to(DOT_DT)
        acc = tl.dot(f1d, _state(ST, base, rows, vcol, dv).to(DOT_DT), acc, input_precision=PREC, out_dtype=ACC_DT)
        if NORM_DOT:
            den_mma = tl.dot(f1d, _norm_ops(STN, base, rows), den_mma, input_precision=PREC, out_dtype=ACC_DT)
        else:
            den += tl.sum(f1 * tl.load(STN + base + rows)[None, :], axis=1)
    if NORM_DOT:
        den += tl.sum(den_mma, axis=1)
    a = tl.load(A + h) * tl.load(MULT + 1)
    acc += a * tl.load(ST + base * dv + vcol, mask=vcol < dv, other=0.0).to(ACC_DT)[None, :]
    den += a * tl.sum(_norm_vals(STN, base, tl.arange(0, 1), NORM_DOT), axis=0)
    # intra-chunk: the dense kernel on the causal triangle (Eq. 7)
    kap = tl.zeros([C, C], ACC_DT) + tl.load(EPS) * zs * zs
    qz = q.to(ACC_DT) * zs
    for m in range(GMAX):  # the G + 1 columns of L; G is a run-time value so that one variant serves every layer
        if m < g1:
            z = _intra_z(qz, k, WS, L0, zs, h, m, g1, BD, DOT_DT, ACC_DT, PREC)
            kap += z * z
    kap = tl.where(tok[:, None] >= tok[None, :], kap, 0.0)
    acc = tl.dot(kap.to(DOT_DT), v, acc, input_precision=PREC, out_dtype=ACC_DT)
    den += tl.sum(kap, axis=1)
    out = (acc / tl.where(tmask, den, 1.0)[:, None]).to(O.dtype.element_ty)
    omask = tmask[:, None] & (vcol < dv)[None, :]
    tl.store(O + (b * n_q + h).to(tl.int64) * N * dv + tok[:, None] * dv + vcol[None, :], out, mask=omask)
    if CHECK:
        flag_out(STATUS, out, omask)
    tl.store(DEN + (b * n_q + h).to(tl.int64) * N + tok, den, mask=tmask)


@triton.jit
def _bwd_dq(
    Q, K, V, GO, DL, BS, CS, WS, L0, PAIRS, ST, STN, DQ, PART,
    N, n_q, n_c, n_cs, d, dv, R, P, g1,
    NB: tl.constexpr, REP: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr, NPAIR: tl.constexpr,
    GMAX: tl.constexpr, RH: tl.constexpr, DOT_DT: tl.constexpr, ACC_DT: tl.constexpr, PREC: tl.constexpr,
    NORM_DOT: tl.constexpr,
):
    """dq of one chunk of one query head, and its share of the coefficient gradients.

    GO = dO / den is the gradient of the numerator and DL = (dO . o) / den minus that of the normaliser, so
    the gradient of kappa_ij is GO_i . v_j - DL_i and that of phi(q_i) is S_c [GO_i; -DL_i].
    PART[b, c, h] receives [d(A) | d(BS) (D16) | d(CS) per pair (NPAIR x 256) | d(WS) (g1 x BD) | d(L0) (g1)],
    g1 = G + 1. NORM_DOT (half inputs): the normaliser rows come split (`_norm_vals`) and the coefficient shares
    are summed by a dot. Grid (Hq, n_c, B).
    """
    D16 = NB * 16
    h, c, b, n_kv, hk, tok, tmask, dcol, vcol, qh, q, k, v = _query_chunk(Q, K, V, N, n_q, d, dv, REP, C, BD, BV,
                                                                          ACC_DT, DOT_DT)
    j16 = tl.arange(0, 16)
    part = PART + ((b * n_c + c) * n_q + h).to(tl.int64) * P
    off_w = 1 + D16 + NPAIR * 256
    off_l0 = off_w + g1 * BD
    go = _tile(GO + (b * n_q + h).to(tl.int64) * N * dv, tok, tmask, vcol, dv).to(DOT_DT)
    dl = tl.load(DL + (b * n_q + h).to(tl.int64) * N + tok, mask=tmask, other=0.0)
    # intra-chunk: dkappa = go . v - dl on the causal triangle, dz_m = 2 z_m dkappa
    dkap = tl.dot(go, tl.trans(v), input_precision=PREC, out_dtype=ACC_DT) - dl[:, None]
    dkap2 = tl.where(tok[:, None] >= tok[None, :], 2.0 * dkap, 0.0)  # the factor 2 of dz_m, once (exact)
    dq = tl.zeros([C, BD], ACC_DT)
    for m in range(GMAX):
        if m < g1:
            dz = _intra_z(q, k, WS, L0, 1.0, h, m, g1, BD, DOT_DT, ACC_DT, PREC) * dkap2
            tl.store(part + off_l0 + m, tl.sum(tl.sum(dz, axis=1), axis=0))
            t = tl.dot(dz.to(DOT_DT), k, input_precision=PREC, out_dtype=ACC_DT)  # sum_j dz_ij k_j
            dq += t * tl.load(WS + (h * g1 + m) * BD + dcol)[None, :]
            tl.store(part + off_w + m * BD + dcol, tl.sum(q.to(ACC_DT) * t, axis=0))
    # inter-chunk: the gradient of phi(q) is [go, -dl] S_c^T, then through phi (Eq. 6)
    base = ((b * n_kv + hk) * n_cs + c).to(tl.int64) * R
    s0 = tl.load(ST + base * dv + vcol, mask=vcol < dv, other=0.0).to(ACC_DT)
    r0 = tl.sum(go.to(ACC_DT) * s0[None, :], axis=1) - dl * tl.sum(_norm_vals(STN, base, tl.arange(0, 1), NORM_DOT),
                                                                   axis=0)
    tl.store(part, tl.sum(r0, axis=0))
    for I in range(NB):
        rows = 1 + I * 16 + j16
        r1 = tl.dot(go, tl.trans(_state(ST, base, rows, vcol, dv).to(DOT_DT)), input_precision=PREC,
                    out_dtype=ACC_DT)
        r1 -= dl[:, None] * _norm_vals(STN, base, rows, NORM_DOT)[None, :]
        dq = _scatter(dq, r1 * tl.load(BS + h * D16 + I * 16 + j16)[None, :], I, BD, PREC)
        tl.store(part + 1 + I * 16 + j16, tl.sum(_block(qh, tok, tmask, I, d).to(ACC_DT) * r1, axis=0))
    ones = tl.where(tl.arange(0, 16)[None, :] == 0, tl.full([C, 16], 1.0, DOT_DT), 0.0).to(DOT_DT)
    for p in range(NPAIR):
        pi = tl.load(PAIRS + 2 * p)
        pj = tl.load(PAIRS + 2 * p + 1)
        x_i = tl.zeros([C, 16], ACC_DT)  # this pair's share of dq in blocks I and J
        x_j = tl.zeros([C, 16], ACC_DT)
        for s in range(16 // RH):
            rows2, q_i, q_j = _pair_step(pi, pj, p, s, qh, tok, tmask, d, D16, RH, ACC_DT)
            dphi = tl.dot(go, tl.trans(_state(ST, base, rows2, vcol, dv).to(DOT_DT)), input_precision=PREC,
                          out_dtype=ACC_DT)
            dphi -= dl[:, None] * _norm_vals(STN, base, rows2, NORM_DOT)[None, :]
            d3 = tl.reshape(dphi, [C, RH, 16])
            # the coefficients' share, summed over the chunk's tokens: for half inputs by a dot against a ones
            # column (summed across the lanes and warps that hold the tokens, it was about a third of the step's
            # instructions; fp32's three-pass dot spills more than the sums cost)
            e3 = q_i[:, :, None] * q_j[:, None, :] * d3
            if NORM_DOT:
                e2 = tl.trans(_flat(e3.to(DOT_DT), C, RH))
                dcs = tl.sum(tl.dot(e2, ones, input_precision=PREC, out_dtype=ACC_DT), axis=1)
            else:
                dcs = tl.reshape(tl.sum(e3, axis=0), [RH * 16])
            tl.store(part + 1 + D16 + p * 256 + s * RH * 16 + tl.arange(0, RH * 16), dcs * tl.where(pi < pj, 2.0, 1.0))
            d3 = d3 * _pair_coef(CS, h, pi, pj, s, D16, RH)[None, :, :]
            x_i += _place(tl.sum(d3 * q_j[:, None, :], axis=2), s, C, RH)
            x_j += tl.sum(d3 * q_i[:, :, None], axis=1)
        dq = _scatter(dq, x_i, pi, BD, PREC)
        dq = _scatter(dq, x_j, pj, BD, PREC)
    tl.store(DQ + (b * n_q + h).to(tl.int64) * N * d + tok[:, None] * d + dcol[None, :], dq.to(DQ.dtype.element_ty),
             mask=tmask[:, None] & (dcol < d)[None, :])


@triton.jit
def _bwd_dkv(
    Q, K, V, GO, DL, WS, L0, EPS, PAIRS, ST, STN, CARRY, CARRYN, DK, DV,
    N, n_q, n_cs, seg_len, n_seg, d, dv, R, g1,
    NB: tl.constexpr, REP: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
    NPAIR: tl.constexpr, GMAX: tl.constexpr, RH: tl.constexpr, DOT_DT: tl.constexpr, ACC_DT: tl.constexpr,
    PREC: tl.constexpr,
):
    """dk and dv of one chunk of one KV head, looping over its query heads (no atomics).

    ST/STN hold the state gradient from the later chunks of the same segment and CARRY/CARRYN the one from later
    segments and from the final state. Grid (Hkv, n_c, B).
    """
    D16 = NB * 16
    hk = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2)
    n_kv = n_q // REP
    tok, tmask, dcol, vcol, kh, k, v = _kv_chunk(K, V, b, hk, n_kv, c, N, d, dv, C, BD, BV, ACC_DT, DOT_DT)
    j16 = tl.arange(0, 16)
    causal = tok[:, None] >= tok[None, :]
    dk = tl.zeros([C, BD], ACC_DT)
    dv_acc = tl.zeros([C, BV], ACC_DT)
    # intra-chunk, one query head at a time
    for r in range(REP):
        h = hk * REP + r
        q = _tile(Q + (b * n_q + h).to(tl.int64) * N * d, tok, tmask, dcol, d)
        goh = GO + (b * n_q + h).to(tl.int64) * N * dv
        dl = tl.load(DL + (b * n_q + h).to(tl.int64) * N + tok, mask=tmask, other=0.0)
        dkap = tl.dot(_tile(goh, tok, tmask, vcol, dv).to(DOT_DT), tl.trans(v), input_precision=PREC, out_dtype=ACC_DT)
        dkap = tl.where(causal, dkap - dl[:, None], 0.0)
        kap, dk = _kappa_dk(q, k, dkap, dk, causal, WS, L0, tl.load(EPS), 1.0, h, g1, GMAX, C, C, BD, DOT_DT, ACC_DT,
                            PREC)
        # go loaded again rather than kept: its shared-memory copy would be live across the loop over L's columns
        # (the eviction hint keeps the compiler from merging the two loads)
        go = tl.load(goh + tok[:, None] * dv + vcol[None, :], mask=tmask[:, None] & (vcol < dv)[None, :], other=0.0,
                     eviction_policy="evict_first")
        dv_acc = tl.dot(tl.trans(kap.to(DOT_DT)), go.to(DOT_DT), dv_acc, input_precision=PREC, out_dtype=ACC_DT)
    # inter-chunk: every later query read these keys through the state; dH_c = local + carry
    base = ((b * n_kv + hk) * n_cs + c).to(tl.int64) * R
    cbase = ((b * n_kv + hk) * n_seg + c // seg_len).to(tl.int64) * R
    # the two states' pointers advanced to this chunk once, so their rows' offsets stay 32-bit (with 64-bit
    # offsets per element, address arithmetic was a fifth of the pair step's instructions; compiled counts)
    st_c = ST + base * dv
    carry_c = CARRY + cbase * dv
    dh0 = tl.load(ST + base * dv + vcol, mask=vcol < dv, other=0.0)
    dv_acc += (dh0 + tl.load(CARRY + cbase * dv + vcol, mask=vcol < dv, other=0.0))[None, :]
    for I in range(NB):
        rows = 1 + I * 16 + j16
        dh1 = (_state(st_c, 0, rows, vcol, dv) + _state(carry_c, 0, rows, vcol, dv)).to(DOT_DT)
        dv_acc = tl.dot(_block(kh, tok, tmask, I, d).to(ACC_DT).to(DOT_DT), dh1, dv_acc, input_precision=PREC,
                        out_dtype=ACC_DT)
        dpsi = tl.dot(v, tl.trans(dh1), input_precision=PREC, out_dtype=ACC_DT)
        dpsi += (tl.load(STN + base + rows) + tl.load(CARRYN + cbase + rows))[None, :]
        dk = _scatter(dk, dpsi, I, BD, PREC)
    for p in range(NPAIR):
        pi = tl.load(PAIRS + 2 * p)
        pj = tl.load(PAIRS + 2 * p + 1)
        x_i = tl.zeros([C, 16], ACC_DT)  # this pair's share of dk in blocks I and J
        x_j = tl.zeros([C, 16], ACC_DT)
        for s in range(16 // RH):
            rows2, k_i, k_j = _pair_step(pi, pj, p, s, kh, tok, tmask, d, D16, RH, ACC_DT)
            dh2 = (_state(st_c, 0, rows2, vcol, dv) + _state(carry_c, 0, rows2, vcol, dv)).to(DOT_DT)
            psi = _flat((k_i[:, :, None] * k_j[:, None, :]).to(DOT_DT), C, RH)
            dv_acc = tl.dot(psi, dh2, dv_acc, input_precision=PREC, out_dtype=ACC_DT)
            dpsi2 = tl.dot(v, tl.trans(dh2), input_precision=PREC, out_dtype=ACC_DT)
            dpsi2 += (tl.load(STN + base + rows2) + tl.load(CARRYN + cbase + rows2))[None, :]
            d3 = tl.reshape(dpsi2, [C, RH, 16])
            x_i += _place(tl.sum(d3 * k_j[:, None, :], axis=2), s, C, RH)
            x_j += tl.sum(d3 * k_i[:, :, None], axis=1)
        dk = _scatter(dk, x_i, pi, BD, PREC)
        dk = _scatter(dk, x_j, pj, BD, PREC)
    tl.store(DK + (b * n_kv + hk).to(tl.int64) * N * d + tok[:, None] * d + dcol[None, :], dk.to(DK.dtype.element_ty),
             mask=tmask[:, None] & (dcol < d)[None, :])
    tl.store(DV + (b * n_kv + hk).to(tl.int64) * N * dv + tok[:, None] * dv + vcol[None, :],
             dv_acc.to(DV.dtype.element_ty), mask=tmask[:, None] & (vcol < dv)[None, :])
