"""The dense kernel on a tile of query-key pairs (paper Eq. 7), shared by the chunked kernels' intra-chunk term
(`kernels.py`) and the parallel kernels (`parallel.py`): kappa = eps + sum_m z_m^2 with
z_m = L[0, m] + scale (q * w_m) . k, one score dot per column m of L.

`zs` multiplies every z (the parallel kernels' overflow rescaling: q arrives times zs, so L[0, m] is scaled here;
kappa / zs^2 leaves the output unchanged). The chunked kernels' inputs come rescaled and pass 1.0.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _intra_z(q, k, WS, L0, zs, h, m, g1, BD: tl.constexpr, DOT_DT: tl.constexpr, ACC_DT: tl.constexpr,
             PREC: tl.constexpr):
    """z_m(i, j) = L[0, m] + scale sum_r q_ir L[g(r)+1, m] k_jr for one chunk, [C, C] (Eq. 7, one column of L),
    times zs (q holds its share already)."""
    w = tl.load(WS + (h * g1 + m) * BD + tl.arange(0, BD))
    qw = (q.to(ACC_DT) * w[None, :]).to(DOT_DT)
    return tl.dot(qw, tl.trans(k), input_precision=PREC, out_dtype=ACC_DT) + tl.load(L0 + h * g1 + m) * zs


@triton.jit
def _kappa_dk(q, k, dkap, dk, causal, WS, L0, eps, zs, h, g1, GMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              BD: tl.constexpr, DOT_DT: tl.constexpr, ACC_DT: tl.constexpr, PREC: tl.constexpr):
    """kappa of a [BM, BN] tile on its causal triangle, and dk += sum_m dz_m^T (q * w_m) with dz_m = 2 z_m dkap
    (dkap already zero off the triangle): the key side of the intra-chunk (or parallel) backward, per query head.
    eps and q come with the overflow multiplier (zs^2, zs) applied."""
    dcol = tl.arange(0, BD)
    kap = tl.zeros([BM, BN], ACC_DT) + eps
    dkap2 = 2.0 * dkap  # the factor 2 of dz_m, once rather than in every column's loop (exact)
    for m in range(GMAX):
        if m < g1:
            z = _intra_z(q, k, WS, L0, zs, h, m, g1, BD, DOT_DT, ACC_DT, PREC)
            kap += z * z
            qw = (q.to(ACC_DT) * tl.load(WS + (h * g1 + m) * BD + dcol)[None, :]).to(DOT_DT)
            dk = tl.dot(tl.trans((z * dkap2).to(DOT_DT)), qw, dk, input_precision=PREC, out_dtype=ACC_DT)
    return tl.where(causal, kap, 0.0), dk
