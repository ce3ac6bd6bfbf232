"""Tiles, feature blocks and normaliser helpers shared by the chunked kernels (`kernels.py`, whose docstring
describes the state's block layout) and the parallel ones (`parallel.py`)."""

from __future__ import annotations

import triton
import triton.language as tl


# Inputs reach the dot type through fp32: fp16 inputs use bf16 dots (fp16 sums of states overflow), and Triton's
# interpreter has no direct fp16 -> bf16 cast.
@triton.jit
def _tile(ptr, tok, tmask, col, width):
    """Rows `tok`, columns `col` of a row-major [tokens, width] tensor; zero past N and past `width`."""
    return tl.load(ptr + tok[:, None] * width + col[None, :], mask=tmask[:, None] & (col[None, :] < width), other=0.0)


@triton.jit
def _block(ptr, tok, tmask, I, d):
    """Feature block I: columns 16 I .. 16 I + 15 of a [tokens, d] tensor, [C, 16]."""
    return _tile(ptr, tok, tmask, I * 16 + tl.arange(0, 16), d)


@triton.jit
def _state(ST, base, rows, vcol, dv):
    """Rows of a state in block layout ([R, dv] per chunk, row-major) as [len(rows), BV]."""
    return tl.load(ST + (base + rows)[:, None] * dv + vcol[None, :], mask=(vcol < dv)[None, :], other=0.0)


@triton.jit
def _sub(ptr, tok, tmask, I, s, d, RH: tl.constexpr):
    """Rows s RH .. s RH + RH - 1 of feature block I: columns 16 I + s RH + [0, RH) of a [tokens, d] tensor."""
    return _tile(ptr, tok, tmask, I * 16 + s * RH + tl.arange(0, RH), d)


@triton.jit
def _pair_coef(CS, h, I, J, s, D16, RH: tl.constexpr):
    """scale^2 C_rt of step s of block pair (I, J) as [RH, 16], times the multiplicity 2 off the diagonal."""
    return _pair_cs(CS, h, I, J, s, D16, RH) * tl.where(I < J, 2.0, 1.0)


@triton.jit
def _pair_cs(CS, h, I, J, s, D16, RH: tl.constexpr):
    """scale^2 C_rt of step s of block pair (I, J) as [RH, 16], without the multiplicity."""
    r = s * RH + tl.arange(0, RH)
    t = tl.arange(0, 16)
    return tl.load(CS + h * D16 * D16 + (I * 16 + r[:, None]) * D16 + J * 16 + t[None, :])


@triton.jit
def _flat(x3, C: tl.constexpr, RH: tl.constexpr):
    """[C, RH, 16] -> [C, 16 RH], column f = 16 r + t."""
    return tl.reshape(x3, [C, RH * 16])


@triton.jit
def _place(x, s, C: tl.constexpr, RH: tl.constexpr):
    """[C, RH] -> [C, 16] holding x in columns s RH .. s RH + RH - 1 and zeros elsewhere.

    Lets a step's share of block I go through `_scatter` (whose dot needs 16 columns) once per pair.
    """
    if RH == 16:
        return x
    x3 = tl.broadcast_to(x[:, None, :], [C, 16 // RH, RH])
    return tl.reshape(tl.where((tl.arange(0, 16 // RH) == s)[None, :, None], x3, 0.0), [C, 16])


@triton.jit
def _scatter(acc, x, I, BD: tl.constexpr, PREC: tl.constexpr):
    """acc[:, 16 I : 16 I + 16] += x for acc [C, BD], x [C, 16] fp32.

    A dot with a 0/1 placement matrix: a register tile cannot be indexed by a run-time block number.
    """
    place = (tl.arange(0, BD)[None, :] == I * 16 + tl.arange(0, 16)[:, None]).to(x.dtype)
    return tl.dot(x, place, acc, input_precision=PREC, out_dtype=acc.dtype)


@triton.jit
def _norm_cols(sn, DOT_DT: tl.constexpr):
    """[K] fp32 normaliser rows -> [K, 16] in the dot type: column 0 the rows rounded to it, column 1 what the
    rounding left, zeros elsewhere. A dot of features against it reads the normaliser out on the tensor cores at
    about 16 bits with bf16 (fp32 itself where the dot type is fp32), from the same rounded features as the
    numerator's dot. The kernels read it as the key scan stored it (`_norm_store`, `_norm_ops`); this is its
    definition, which the tests compare them with."""
    hi = sn.to(DOT_DT).to(sn.dtype)
    col = tl.arange(0, 16)[None, :]
    return tl.where(col == 0, hi[:, None], tl.where(col == 1, (sn - hi)[:, None], 0.0)).to(DOT_DT)


@triton.jit
def _norm_store(STN, off, x, SPLIT: tl.constexpr, DOT_DT: tl.constexpr):
    """Store normaliser rows x [K] (fp32) at row offsets `off`: as they are, or where SPLIT as `_norm_cols`'s two
    columns, (x rounded to the dot type, what the rounding left) in the dot type at 2 off and 2 off + 1 (the keys
    scan for half inputs: the output kernel's dot then loads its operand as it is, where building it took a
    fifth of that kernel's pair step and a barrier; `_norm_ops`)."""
    if SPLIT:  # a compile-time branch
        hi = x.to(DOT_DT)
        tl.store(STN + 2 * off, hi)
        tl.store(STN + 2 * off + 1, (x - hi.to(x.dtype)).to(DOT_DT))
    else:
        tl.store(STN + off, x)


@triton.jit
def _norm_ops(STN, base, rows):
    """The [K, 16] dot operand of `_norm_cols` for the normaliser rows `rows` of the chunk at row `base`, loaded as
    `_norm_store` split it (zeros past its two columns)."""
    col = tl.arange(0, 16)
    return tl.load(STN + 2 * (base + rows)[:, None] + col[None, :], mask=(col < 2)[None, :], other=0.0)


@triton.jit
def _norm_vals(STN, base, rows, SPLIT: tl.constexpr):
    """The normaliser rows `rows` of the chunk at row `base` in fp32: where SPLIT, the sum of `_norm_store`'s two
    parts (within 2^-16 of the fp32 sum for bf16 dots; exact for fp32 ones)."""
    if SPLIT:
        two = tl.load(STN + 2 * (base + rows)[:, None] + tl.arange(0, 2)[None, :])  # one 4-byte load a row
        vals = tl.sum(two.to(tl.float32), axis=1)
    else:
        vals = tl.load(STN + base + rows)
    return vals


@triton.jit
def _norm_acc(x, RH: tl.constexpr, REG: tl.constexpr):
    """A scan's running normaliser of RH * 16 rows: [RH, 16], summed in registers, where REG; else [RH * 16, 16]
    with x in column 0, as the dot against `_norm_cols` accumulates it."""
    if REG:  # a compile-time branch: the two shapes never meet
        acc = tl.reshape(x, [RH, 16])
    else:
        acc = tl.where(tl.arange(0, 16)[None, :] == 0, x[:, None], 0.0)
    return acc


@triton.jit
def _norm_rows(acc, RH: tl.constexpr, REG: tl.constexpr):
    """`_norm_acc`'s accumulator back as [RH * 16] rows."""
    if REG:
        rows = tl.reshape(acc, [RH * 16])
    else:
        rows = tl.sum(acc, axis=1)
    return rows


@triton.jit
def _scan_step(seg, i, N, SEG: tl.constexpr, C: tl.constexpr, REVERSE: tl.constexpr):
    """The i-th chunk a scan visits in its segment (from the end when REVERSE), its tokens and their mask."""
    c = seg * SEG + i
    if REVERSE:
        c = seg * SEG + SEG - 1 - i
    tok = c * C + tl.arange(0, C)
    return c, tok, tok < N


@triton.jit
def _scan_inputs(Y, NW, xh, tok, tmask, vcol, N, dv, QUERY: tl.constexpr, ACC_DT: tl.constexpr,
                 DOT_DT: tl.constexpr):
    """Y [C, BV] in DOT_DT and the normaliser weight [C]: NW in query mode, 1 for each real token in keys mode."""
    y = _tile(Y + xh * N * dv, tok, tmask, vcol, dv).to(ACC_DT).to(DOT_DT)
    if QUERY:
        nw = tl.load(NW + xh * N + tok, mask=tmask, other=0.0)
    else:
        nw = tmask.to(ACC_DT)
    return y, nw


@triton.jit
def _kv_chunk(K, V, b, hk, n_kv, c, N, d, dv, C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
              ACC_DT: tl.constexpr, DOT_DT: tl.constexpr):
    """Chunk c of KV head hk: token indices and mask, column indices, the key pointer, K [C, BD], V [C, BV]."""
    tok = c * C + tl.arange(0, C)
    tmask = tok < N
    dcol = tl.arange(0, BD)
    vcol = tl.arange(0, BV)
    kh = K + (b * n_kv + hk).to(tl.int64) * N * d
    k = _tile(kh, tok, tmask, dcol, d).to(ACC_DT).to(DOT_DT)
    v = _tile(V + (b * n_kv + hk).to(tl.int64) * N * dv, tok, tmask, vcol, dv).to(ACC_DT).to(DOT_DT)
    return tok, tmask, dcol, vcol, kh, k, v


@triton.jit
def _query_chunk(Q, K, V, N, n_q, d, dv, REP: tl.constexpr, C: tl.constexpr, BD: tl.constexpr, BV: tl.constexpr,
                 ACC_DT: tl.constexpr, DOT_DT: tl.constexpr):
    """Program (query head h, chunk c, batch b) of a per-query-head kernel and its tiles Q (input dtype), K, V."""
    h = tl.program_id(0)
    c = tl.program_id(1)
    b = tl.program_id(2)
    n_kv = n_q // REP
    hk = h // REP
    tok, tmask, dcol, vcol, kh, k, v = _kv_chunk(K, V, b, hk, n_kv, c, N, d, dv, C, BD, BV, ACC_DT, DOT_DT)
    qh = Q + (b * n_q + h).to(tl.int64) * N * d
    return h, c, b, n_kv, hk, tok, tmask, dcol, vcol, qh, _tile(qh, tok, tmask, dcol, d), k, v


@triton.jit
def _pair_step(I, J, p, s, xh, tok, tmask, d, D16, RH: tl.constexpr, ACC_DT: tl.constexpr):
    """Step s of block pair p = (I, J): its state rows, X's rows of block I [C, RH] and block J [C, 16]."""
    rows = 1 + D16 + p * 256 + s * RH * 16 + tl.arange(0, RH * 16)
    return rows, _sub(xh, tok, tmask, I, s, d, RH).to(ACC_DT), _block(xh, tok, tmask, J, d).to(ACC_DT)


@triton.jit
def _carry_in(acc, CARRY, PREV, bh, seg, n_seg, rows, vcol, dv, R, has_carry, add_prev, NORM: tl.constexpr):
    """The running value a segment starts from: the initial state (CARRY, one per KV head) and, in the second
    pass of a split scan, the sums of the segments before it (PREV, the first pass's TOT): the split's fix-up,
    done here rather than by torch between the passes. NORM: the normaliser column ([rows]), else [rows, BV]."""
    if has_carry:
        acc += _rows_of(CARRY, bh.to(tl.int64) * R, rows, vcol, dv, NORM)
    if add_prev:
        s2 = 0
        while s2 < seg:  # a run-time bound: a while loop (the interpreter cannot `range` over one)
            acc += _rows_of(PREV, (bh * n_seg + s2).to(tl.int64) * R, rows, vcol, dv, NORM)
            s2 += 1
    return acc


@triton.jit
def _rows_of(X, base, rows, vcol, dv, NORM: tl.constexpr):
    if NORM:  # a compile-time branch: the two shapes never meet
        x = tl.load(X + base + rows)
    else:
        x = _state(X, base, rows, vcol, dv)
    return x
