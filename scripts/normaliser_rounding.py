"""How the chunked kernels' bf16 rounding of the normaliser affects the output, emulated in fp64 on the CPU.

The kernels' bf16 dots round the features and the stored per-chunk states; the numerator's readout is always such
a dot. Three ways to read the normaliser out (Eq. 6's denominator), each against the exact fp64 result:

- exact:   the unrounded features times the fp32 normaliser state, summed in fp32 registers (the kernels up to
           2026-12-05; still fp32 and fp64 inputs);
- dots:    the numerator's rounded features times the normaliser split in two bf16 columns (rounded, and what the
           rounding left), as `blocks._norm_cols` does for half inputs; the key scan's normaliser state summed
           from the rounded features too;
- hi only: the same with the rounded column alone (what one column would give);
- bf16 products: the dots, with the query features multiplied in bf16 as the output kernel does for half inputs
           (`function._prod_dt`): q_r q_t rounded, times the coefficient rounded, rounded.

Inputs are bf16-exact, the intra-chunk part is exact (it is the same in all three), the output is not rounded.

    PYTHONPATH=src python scripts/normaliser_rounding.py
"""

from __future__ import annotations

import torch

from oal.ops.kernel import coefficients

F64 = torch.float64
CASES = [(1024, 16, 3, 7, True), (1024, 16, 3, 1, False), (2048, 64, 5, 0, True), (2048, 64, 5, 2, False),
         (4096, 32, 4, 3, True)]  # n, d, G, seed, outlier dimension


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(F64)


def inputs(n: int, d: int, g: int, seed: int, outlier: bool):
    """q, k, v (bf16-exact), the full feature maps phi(q) (with the coefficients) and psi(k) (Eq. 5-6), and phi(q)
    as the output kernel forms it from bf16 products (before its last rounding, which the dots do)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n, d, dtype=F64, generator=gen) for _ in range(3))
    if outlier:  # a dimension 8x larger in q and k, as in pretrained heads
        q[:, 3] *= 8
        k[:, 3] *= 8
    q, k, v = bf16(q), bf16(k), bf16(v)
    groups = torch.randint(0, g, (1, d), generator=gen)
    groups[0, :g] = torch.arange(g)
    factor = torch.tril(0.5 * torch.randn(1, g + 1, g + 1, dtype=F64, generator=gen))
    factor.diagonal(dim1=1, dim2=2).abs_().add_(0.5)
    a, b, c = coefficients(factor, groups, 1e-4)
    scale = d**-0.5
    ones = torch.ones(n, 1, dtype=F64)
    psi = torch.cat([ones, k, (k[:, :, None] * k[:, None, :]).reshape(n, -1)], 1)
    phi = torch.cat([a * ones, q * b[0] * scale, (q[:, :, None] * q[:, None, :] * c[0] * scale**2).reshape(n, -1)], 1)
    quad16 = bf16(q[:, :, None] * q[:, None, :]) * bf16(c[0] * scale**2)
    phi16 = torch.cat([phi[:, : 1 + d], quad16.reshape(n, -1)], 1)
    return v, phi, psi, phi16


def output_errors(n: int, d: int, g: int, seed: int, outlier: bool, chunk: int = 64) -> dict[str, float]:
    v, phi, psi, phi16 = inputs(n, d, g, seed, outlier)
    kap = torch.tril(phi @ psi.T)
    exact = (kap @ v) / kap.sum(1, keepdim=True)
    errs = {}
    for way in ("exact", "dots", "hi only", "bf16 products"):
        feats = bf16(phi16 if way == "bf16 products" else phi)
        out = torch.empty_like(v)
        state = torch.zeros(psi.shape[1], d, dtype=torch.float32)
        norm = torch.zeros(psi.shape[1], dtype=torch.float32)
        for c0 in range(0, n, chunk):
            rows = slice(c0, min(n, c0 + chunk))
            intra = kap[rows, rows]
            num = intra @ v[rows] + feats[rows] @ bf16(state.to(F64))  # bf16 dot, bf16-stored state
            sn = norm.to(F64)
            if way == "exact":
                den = phi[rows] @ sn
            elif way == "hi only":
                den = feats[rows] @ bf16(sn)
            else:
                den = feats[rows] @ bf16(sn) + feats[rows] @ bf16(sn - bf16(sn))
            out[rows] = num / (intra.sum(1) + den)[:, None]
            state += (bf16(psi[rows]).T @ v[rows]).float()  # the scan: bf16 features, fp32 sums
            norm += (psi[rows] if way == "exact" else bf16(psi[rows])).sum(0).float()
        errs[way] = float((out - exact).norm() / exact.norm())
    return errs


def main() -> None:
    print(f"{'n':>5} {'d':>3} {'G':>2} {'outlier':>7} | relative error of the output: exact / dots / hi only / "
          "bf16 products")
    for n, d, g, seed, outlier in CASES:
        e = output_errors(n, d, g, seed, outlier)
        print(f"{n:5d} {d:3d} {g:2d} {outlier!s:>7} | {e['exact']:.3e} / {e['dots']:.3e} / {e['hi only']:.3e} / "
              f"{e['bf16 products']:.3e}")


if __name__ == "__main__":
    main()
