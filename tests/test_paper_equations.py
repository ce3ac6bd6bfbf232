"""The paper's equations, each written out naively here (Python loops, float64, odd sizes) and compared with the
library: Eq. 2 + App. B (Eq. 16-19) end to end with the fast path's own bootstrap draws (exact, no Monte Carlo
tolerance), Eq. 3/24 (dimension form = grouped form), Eq. 5-6 (the HD recurrence), Eq. 20 (the calibration
objective's outputs and validation MSE), Eq. 1 (normalised causal linear attention of the baselines) and App. C's
post-W_o metrics on a projection with a bias. The other tests compare fast paths with oracles written beside them;
these oracles are written from the paper alone."""

from __future__ import annotations

import math

import pytest
import torch

from oal.analysis import head_contributions, stable_gap_groups
from oal.analysis.grouping import bootstrap_weights, candidate_cuts
from oal.calibration.data import LayerData
from oal.calibration.fit import _fold
from oal.calibration.loss import _val_mse, sampled_dense_output
from oal.methods import build_method
from oal.methods.features import feature_attention
from oal.ops import oal_attention
from oal.ops.kernel import coefficients

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _fp32_exact(x):
    """Values a float32 parameter holds exactly (OALMethod keeps its factor in float32), so the naive float64
    formulas below see the same numbers."""
    return x.float().double()


# ------------------------------------------------------------------------------------- Eq. 2 and App. B (Eq. 16-19)


def _chi_eq2(q, k):
    """Eq. 2 for one prompt and head: the mean over causal pairs j <= i of |q_ir k_jr| / sqrt(d)."""
    n, d = q.shape
    out = [0.0] * d
    for i in range(n):
        for j in range(i + 1):
            for r in range(d):
                out[r] += abs(float(q[i, r]) * float(k[j, r])) / math.sqrt(d)
    pairs = n * (n + 1) / 2
    return torch.tensor([x / pairs for x in out], dtype=F64)


def _app_b(chi_pp, alpha, gamma, tau, g_min, draws, eps=1e-12):
    """App. B as written, with the replicate draws given: [(prompt indices of replicate b), ...]."""
    p, d = chi_pp.shape
    chi = [sum(float(chi_pp[i, r]) for i in range(p)) / p for r in range(d)]
    order = sorted(range(d), key=lambda r: chi[r])  # stable ascending
    m = math.ceil(alpha * d)
    cands = list(range(max(1, d - m), d))
    rho = {k: chi[order[k]] / max(chi[order[k - 1]], eps) for k in cands}  # Eq. 16 (pi is 1-based in the paper)
    support = {}
    for k in cands:
        hits = 0
        for draw in draws:
            chi_b = [sum(float(chi_pp[i, r]) for i in draw) / p for r in range(d)]  # multiplicities kept
            low = max(chi_b[order[t]] for t in range(k))  # L_k = pi_1..pi_k
            high = min(chi_b[order[t]] for t in range(k, d))  # U_k = pi_{k+1}..pi_d
            hits += high / max(low, eps) >= tau  # Eq. 17
        support[k] = hits / len(draws)  # Eq. 18
    natural = [k for k in cands if rho[k] >= tau and support[k] >= gamma]
    cuts = list(natural)
    rest = sorted((k for k in cands if k not in natural), key=lambda k: (-support[k], -rho[k]))  # stable: ties
    cuts += rest[: max(0, g_min - 1 - len(cuts))]
    cuts.sort()
    groups = torch.empty(d, dtype=torch.long)
    bounds = [0, *cuts, d]
    for g in range(len(bounds) - 1):  # Eq. 19
        for pos in range(bounds[g], bounds[g + 1]):
            groups[order[pos]] = g
    return groups, cuts, [support[k] for k in cands], [rho[k] for k in cands]


def _draws(p, n_boot, seed):
    """The fast path's replicates as index lists: bootstrap_weights are multiplicities / P."""
    counts = (bootstrap_weights(p, n_boot, seed) * p).round().long()
    return [[i for i in range(p) for _ in range(int(counts[b, i]))] for b in range(n_boot)]


def test_eq2_and_appendix_b_end_to_end_with_the_same_draws():
    """Prompts of different lengths (right-padded in one batch), GQA, d = 7: chi per prompt is the mean over that
    prompt's own causal pairs (Eq. 2), prompts weigh equally, and App. B's groups, supports and ratios equal the
    naive procedure's exactly when both use the same replicate draws."""
    gen = _gen(0)
    lengths, hq, hkv, d = [5, 9, 3, 7, 8], 4, 2, 7
    n, p = max(lengths), len(lengths)
    scale = torch.exp(1.5 * torch.randn(d, generator=gen, dtype=F64))  # a few outlier dims
    q = torch.randn(p, hq, n, d, generator=gen, dtype=F64) * scale
    k = torch.randn(p, hkv, n, d, generator=gen, dtype=F64) * scale.flip(0)
    mask = torch.zeros(p, n, dtype=torch.long)
    for b, m in enumerate(lengths):
        mask[b, :m] = 1
        q[b, :, m:], k[b, :, m:] = 1e3, -1e3  # padding holds garbage that must not count
    chi = head_contributions(q, k, mask)  # [P, Hq, d]
    naive_chi = torch.stack([torch.stack([_chi_eq2(q[b, h, : lengths[b]], k[b, h // 2, : lengths[b]])
                                          for h in range(hq)]) for b in range(p)])
    torch.testing.assert_close(chi, naive_chi, rtol=1e-12, atol=0)
    settings = dict(tail_fraction=0.5, min_support=0.5, min_ratio=1.3, min_groups=3, n_bootstrap=41, seed=5)
    res = stable_gap_groups(chi.transpose(0, 1), **settings)  # [Hq, P, d]: every head on its own
    draws = _draws(p, 41, 5)
    for h in range(hq):
        groups, cuts, support, rho = _app_b(naive_chi[:, h], 0.5, 0.5, 1.3, 3, draws)
        assert res[h].cuts == cuts and torch.equal(res[h].groups, groups)
        assert res[h].support.tolist() == support
        torch.testing.assert_close(res[h].ratios, torch.tensor(rho, dtype=F64), rtol=1e-14, atol=0)


@pytest.mark.parametrize("seed", range(12))
def test_appendix_b_matches_the_naive_procedure_exactly(seed):
    """Random P, d (odd and even), alpha, gamma, tau, G_min, including zero scores (the eps of Eq. 16-17) and
    exact ties: the same draws give the same supports to the last bit and the same cuts (natural and fallback)."""
    gen = _gen(seed)
    p, d = int(torch.randint(1, 8, (1,), generator=gen)), int(torch.randint(2, 20, (1,), generator=gen))
    base = torch.exp(2 * torch.randn(d, generator=gen, dtype=F64))
    chi = base * torch.exp(0.4 * torch.randn(p, d, generator=gen, dtype=F64))
    if seed % 3 == 0:
        chi[:, 0] = 0.0
    if seed % 4 == 1 and d > 3:
        chi[:, -1] = chi[:, -2]  # an exact tie: the stable sort keeps index order
    alpha = (0.25, 0.5, 1.0, 0.3)[seed % 4]
    gamma, tau = (0.9, 0.5, 0.0, 1.0)[seed % 4], (1.5, 1.2, 2.0)[seed % 3]
    g_min = min(1 + seed % 3, len(candidate_cuts(d, alpha)) + 1)
    res = stable_gap_groups(chi, tail_fraction=alpha, min_support=gamma, min_ratio=tau, min_groups=g_min,
                            n_bootstrap=29, seed=seed)
    groups, cuts, support, rho = _app_b(chi, alpha, gamma, tau, g_min, _draws(p, 29, seed))
    assert res.cuts == cuts and torch.equal(res.groups, groups)
    assert res.support.tolist() == support
    torch.testing.assert_close(res.ratios, torch.tensor(rho, dtype=F64), rtol=1e-14, atol=0)


# ------------------------------------------------------------------------------------- Eq. 3, 5-7, 24: the kernel


def _kappa_eq7(q, k, groups, lower, eps):
    """eps + s_bar^T L L^T s_bar with s_bar = [1, s_1..s_G], s_g = sum_{r in g} q_r k_r / sqrt(d)."""
    d = q.shape[0]
    s_bar = torch.zeros(lower.shape[0], dtype=F64)
    s_bar[0] = 1.0
    for r in range(d):
        s_bar[1 + int(groups[r])] += q[r] * k[r] / math.sqrt(d)
    return eps + s_bar @ lower @ lower.T @ s_bar


def test_eq3_dimension_form_equals_eq7_group_form():
    """Section 4.3's mapping a = eps + M00, b_r = 2 M_0g(r), C_rt = M_g(r)g(t) puts Eq. 7 in Eq. 3's form:
    a + sum_r b_r x_r + sum_{r,t} C_rt x_r x_t with x_r = q_r k_r / sqrt(d) (Eq. 24), for a grouping that leaves
    an id unused and a non-triangular factor (its upper triangle must be ignored)."""
    gen = _gen(1)
    d, g, eps = 7, 4, 0.03
    groups = torch.tensor([[2, 0, 0, 3, 0, 2, 0]])  # id 1 unused
    factor = torch.randn(1, g + 1, g + 1, generator=gen, dtype=F64)
    a, b, c = coefficients(factor, groups, eps)
    lower = torch.tril(factor[0])
    for _ in range(5):
        q, k = torch.randn(d, generator=gen, dtype=F64), torch.randn(d, generator=gen, dtype=F64)
        x = q * k / math.sqrt(d)
        dim_form = a[0] + sum(b[0, r] * x[r] for r in range(d)) + sum(
            c[0, r, t] * x[r] * x[t] for r in range(d) for t in range(d))
        want = _kappa_eq7(q, k, groups[0], lower, eps)
        assert float(dim_form) == pytest.approx(float(want), rel=1e-12)
        assert float(want) >= eps  # Sec. 4.3: kappa >= eps > 0


def _hd_recurrence(q, k, v, groups, factor, eps):
    """Algorithm 1 / Eq. 5-6 with explicit states H0, H1_r, H2_rt per query head, token by token."""
    bsz, hq, n, d = q.shape
    rep, dv = hq // k.shape[1], v.shape[-1]
    out = torch.zeros(bsz, hq, n, dv, dtype=F64)
    for h in range(hq):
        lower = torch.tril(factor[h])
        m = lower @ lower.T
        gid = [int(x) + 1 for x in groups[h]]
        a = eps + m[0, 0]
        for b in range(bsz):
            h0 = torch.zeros(dv + 1, dtype=F64)
            h1 = torch.zeros(d, dv + 1, dtype=F64)
            h2 = torch.zeros(d, d, dv + 1, dtype=F64)
            for i in range(n):
                kv = h // rep
                u = torch.cat([v[b, kv, i], torch.ones(1, dtype=F64)])
                h0 += u
                for r in range(d):
                    h1[r] += k[b, kv, i, r] * u
                    for t in range(d):
                        h2[r, t] += k[b, kv, i, r] * k[b, kv, i, t] * u
                ut = a * h0
                for r in range(d):
                    ut = ut + 2 * m[0, gid[r]] * q[b, h, i, r] * h1[r] / math.sqrt(d)
                    for t in range(d):
                        ut = ut + m[gid[r], gid[t]] * q[b, h, i, r] * q[b, h, i, t] * h2[r, t] / d
                out[b, h, i] = ut[:dv] / ut[dv]
    return out


def test_eq5_eq6_hd_recurrence_by_hand():
    """OALMethod's output (every backend, and prefill + continuation from the state) equals Algorithm 1's token
    loop over H0, H1, H2 (Eq. 5-6) with GQA, d = 5, dv = 3, an unused group id and a non-triangular factor."""
    gen = _gen(2)
    b, hq, hkv, n, d, dv, g, eps = 2, 6, 2, 11, 5, 3, 3, 1e-3
    q = torch.randn(b, hq, n, d, generator=gen, dtype=F64)
    k = torch.randn(b, hkv, n, d, generator=gen, dtype=F64)
    v = torch.randn(b, hkv, n, dv, generator=gen, dtype=F64)
    groups = torch.randint(0, g - 1, (hq, d), generator=gen)  # id g - 1 unused
    factor = _fp32_exact(torch.randn(hq, g + 1, g + 1, generator=gen, dtype=F64))
    want = _hd_recurrence(q, k, v, groups, factor, eps)
    method = build_method("oal", hq, hkv, d, groups=groups, factor=factor, eps=eps).double()
    with torch.no_grad():
        torch.testing.assert_close(method(q, k, v), want, rtol=0, atol=1e-12)
        for backend in ("reference", "recurrent", "chunked"):
            got = oal_attention(q, k, v, groups, factor, eps=eps, backend=backend, chunk_size=4)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-12, msg=backend)
        first, state = method(q[:, :, :6], k[:, :, :6], v[:, :, :6], output_final_state=True)
        rest = method(q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], initial_state=state)
        torch.testing.assert_close(torch.cat([first, rest], dim=2), want, rtol=0, atol=1e-12)
        dense = method.dense_kernel(q, k)
        for h, i, j in ((0, 3, 1), (5, 10, 10), (3, 7, 0)):
            kap = _kappa_eq7(q[1, h, i], k[1, h // 3, j], groups[h], torch.tril(factor[h]), eps)
            assert float(dense[1, h, i, j]) == pytest.approx(float(kap), rel=1e-12)


# ------------------------------------------------------------------------------------- Eq. 20: calibration outputs


def _oal_outputs(q, k, v, groups, factor, eps, *, causal=True, key_mask=None):
    """Normalised OAL output per head and position, keys j <= i (or every real key), from Eq. 7 pair by pair."""
    bsz, hq, n, d = q.shape
    rep, dv = hq // k.shape[1], v.shape[-1]
    out = torch.zeros(bsz, hq, n, dv, dtype=F64)
    for h in range(hq):
        lower = torch.tril(factor[h])
        for b in range(bsz):
            for i in range(n):
                num, den = torch.zeros(dv, dtype=F64), 0.0
                for j in range(n):
                    if (causal and j > i) or (key_mask is not None and not key_mask[b, j]):
                        continue
                    kap = _kappa_eq7(q[b, h, i], k[b, h // rep, j], groups[h], lower, eps)
                    num, den = num + kap * v[b, h // rep, j], den + kap
                out[b, h, i] = num / den
    return out


@pytest.mark.parametrize("n", [4, 13])  # 4: the dense validation path; 13: the method's linear-time forward
def test_eq20_outputs_and_validation_mse_of_stacked_initialisations(n):
    """Eq. 20 compares the normalised output y_i(L; x) with softmax's per head: the sampled outputs and the per-head
    validation MSE (mean over positions and output dims) of two stacked initialisations equal the naive values of
    each initialisation on its own, causal and (encoders) non-causal with padded keys."""
    gen = _gen(3)
    s, hq, hkv, d, dv, g, eps = 2, 4, 2, 5, 3, 2, 1e-3
    q = torch.randn(s, hq, n, d, generator=gen, dtype=F64)
    k = torch.randn(s, hkv, n, d, generator=gen, dtype=F64)
    v = torch.randn(s, hkv, n, dv, generator=gen, dtype=F64)
    target = torch.randn(s, hq, n, dv, generator=gen, dtype=F64)
    groups = torch.randint(0, g, (hq, d), generator=gen)
    factors = [_fp32_exact(torch.randn(hq, g + 1, g + 1, generator=gen, dtype=F64)) for _ in range(2)]
    folded = _fold([build_method("oal", hq, hkv, d, groups=groups, factor=f, eps=eps).double() for f in factors])
    with torch.no_grad():
        naive = [_oal_outputs(q, k, v, groups, f, eps) for f in factors]
        want = torch.cat([(y - target).square().mean(dim=(0, 2, 3)) for y in naive])
        torch.testing.assert_close(_val_mse(folded, LayerData(q, k, v, target), 2), want, rtol=1e-12, atol=0)
        pos = torch.tensor([0, 2, n - 1])
        got = sampled_dense_output(folded, q[1:], k[1:], v[1:], pos, 2)
        torch.testing.assert_close(got, torch.cat([y[1:, :, pos] for y in naive], dim=1), rtol=0, atol=1e-13)
        real = torch.ones(s, n, dtype=torch.bool)
        real[1, -2:] = False
        naive = [_oal_outputs(q, k, v, groups, f, eps, causal=False, key_mask=real) for f in factors]
        w = real[:, None, :, None].to(F64)
        want = torch.cat([((y - target).square() * w).sum(dim=(0, 2, 3)) / (real.sum() * dv) for y in naive])
        got = _val_mse(folded, LayerData(q, k, v, target, mask=real, causal=False), 2)
        torch.testing.assert_close(got, want, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------------- Eq. 1: the baselines' attention


@pytest.mark.parametrize("log_keys", [False, True])
@pytest.mark.parametrize("per_query_keys", [False, True])
def test_eq1_normalised_causal_linear_attention(log_keys, per_query_keys):
    """y_i = phi(q_i)^T sum_{j<=i} v_j phi(k_j)^T / phi(q_i)^T sum_{j<=i} phi(k_j), summed pair by pair, against the
    chunked evaluation (chunks that do not divide N), GQA key features shared per KV head or given per query head,
    key log-features, and a continuation from the carried state."""
    gen = _gen(4 + 2 * log_keys + per_query_keys)
    b, hq, hkv, n, m, dv = 2, 6, 2, 11, 5, 3
    fq = torch.rand(b, hq, n, m, generator=gen, dtype=F64) + 0.1
    hk = hq if per_query_keys else hkv
    fk = torch.randn(b, hk, n, m, generator=gen, dtype=F64) * (4.0 if log_keys else 1.0)
    v = torch.randn(b, hkv, n, dv, generator=gen, dtype=F64)
    pos_k = fk.exp() if log_keys else fk.abs() + 0.1
    raw = fk if log_keys else pos_k
    want = torch.zeros(b, hq, n, dv, dtype=F64)
    for bi in range(b):
        for h in range(hq):
            kh = h if per_query_keys else h // (hq // hkv)
            for i in range(n):
                w = [float(fq[bi, h, i] @ pos_k[bi, kh, j]) for j in range(i + 1)]
                want[bi, h, i] = sum(wj * v[bi, h // (hq // hkv), j] for j, wj in enumerate(w)) / sum(w)
    got = feature_attention(fq, raw, v, log_keys=log_keys, chunk_size=4)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    first, state = feature_attention(fq[:, :, :7], raw[:, :, :7], v[:, :, :7], log_keys=log_keys, chunk_size=3,
                                     output_final_state=True)
    rest = feature_attention(fq[:, :, 7:], raw[:, :, 7:], v[:, :, 7:], log_keys=log_keys, chunk_size=3,
                             initial_state=state)
    torch.testing.assert_close(torch.cat([first, rest], dim=2), want, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------- App. C: Eq. 21-22 after W_o


def test_eq21_22_after_w_o_use_the_projection_without_its_bias():
    """App. C applies W_o (a matrix) to the concatenated heads. On a model whose o_proj has a bias the library
    applies the weight alone (docs/guides/evaluation.md): the error is the same either way, and the RelMSE
    normaliser ||Y_b W_o^T||^2 leaves the bias out. Written out per sequence, every layer in one Y_b."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from oal.evaluate.fidelity import fidelity
    from oal.models.capture import attention_module, capture

    torch.manual_seed(0)
    hq, hkv, d = 4, 2, 6
    cfg = LlamaConfig(vocab_size=37, hidden_size=hq * d, intermediate_size=40, num_hidden_layers=2,
                      num_attention_heads=hq, num_key_value_heads=hkv, max_position_embeddings=32,
                      attention_bias=True)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for i in (0, 1):
            attn = attention_module(model, i)
            attn.o_proj.bias.normal_(0.0, 3.0)  # large: it would dominate the normaliser
            attn.q_proj.weight.mul_(10.0)  # logits of order 1, where Taylor's kernel is visibly not exp
            attn.k_proj.weight.mul_(10.0)
    blocks = torch.randint(0, 37, (3, 9), generator=_gen(6))
    methods = {"global": {i: build_method("global", hq, hkv, d) for i in (0, 1)}}
    res = fidelity(model, blocks, methods, batch_size=2)["global"]
    got = []
    with torch.no_grad():
        capture(model, blocks, [0, 1], got.append)
    err, energy = torch.zeros(3, dtype=F64), torch.zeros(3, dtype=F64)
    for c in got:
        with torch.no_grad():
            y = methods["global"][c.layer](c.q, c.k, c.v)
        w = attention_module(model, c.layer).o_proj.weight.detach().double()
        for b in range(3):
            ex = c.out[b].double().transpose(0, 1).reshape(9, hq * d) @ w.T
            ap = y[b].double().transpose(0, 1).reshape(9, hq * d) @ w.T
            err[b] += (ap - ex).square().sum()
            energy[b] += ex.square().sum()
    assert res["relmse_post_o"] > 1e-4
    assert res["relmse_post_o"] == pytest.approx(float((err / energy).mean()), rel=1e-5)
    assert res["mse_post_o"] == pytest.approx(float((err / (2 * 9 * hq * d)).mean()), rel=1e-5)
