"""Attention-regime diagnostics (oal.analysis.regime) against a literal per-query, per-pair loop."""

from __future__ import annotations

import math

import pytest
import torch

from oal.analysis.regime import (
    PEAKED_MAX_WEIGHT,
    VERTEX_EXCESS,
    RegimeAccumulator,
    attention_regime,
    regime_verdict,
)
from oal.methods import build_method
from oal.models.capture import Captured
from oal.ops.kernel import perturbed_factor, taylor_factor


def _captured(q, k, layer=1, mask=None):
    v = torch.zeros(k.shape[0], k.shape[1], k.shape[2], 3)
    out = torch.zeros(q.shape[0], q.shape[1], q.shape[2], 3)
    return Captured(layer, q, k, v, out, mask, 1 / math.sqrt(q.shape[-1]))


def _reference(q, k, method, min_keys):
    """Per (head): lists of max weight, eff keys, logits, beyond flags and weights, by explicit loops (Eq. 7)."""
    bsz, hq, n, d = q.shape
    rep = hq // k.shape[1]
    out = []
    for h in range(hq):
        mw, ek, beyond, pairs, kw, sw = [], [], 0, 0, [], []
        lo, hi = math.inf, -math.inf
        lower = torch.tril(method.factor[h].detach().double())
        groups = method.groups[h]
        g = lower.shape[0] - 1
        for b in range(bsz):
            for i in range(n):
                if i + 1 < min_keys:
                    continue
                s = torch.stack([q[b, h, i] @ k[b, h // rep, j] / math.sqrt(d) for j in range(i + 1)])
                p = torch.softmax(s, 0)
                mw.append(float(p.max()))
                ek.append(math.exp(float(-(p * p.log()).sum())))
                lo, hi = min(lo, float(s.min())), max(hi, float(s.max()))
                kap, flags = [], []
                for j in range(i + 1):
                    sg = torch.stack([(q[b, h, i] * k[b, h // rep, j] * (groups == gg)).sum() / math.sqrt(d)
                                      for gg in range(g)])
                    t = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
                    sbar = torch.cat([torch.ones(1, dtype=torch.float64), t * sg])
                    kappa = method.eps + (lower.T @ sbar).square().sum()  # Eq. 7 with M = L L^T
                    (slope,) = torch.autograd.grad(kappa, t)
                    kap.append(float(kappa.detach()))
                    flags.append(float(slope) * float(s[j]) < 0)  # kernel grows as the logit falls
                kap_t, fl = torch.tensor(kap, dtype=torch.float64), torch.tensor(flags)
                beyond += int(fl.sum())
                pairs += i + 1
                kw.append(float(kap_t[fl].sum() / kap_t.sum()))
                sw.append(float(p[fl].sum()))
        out.append(dict(max_weight=torch.tensor(mw, dtype=torch.float64).median().item(),
                        eff_keys=torch.tensor(ek, dtype=torch.float64).median().item(),
                        lo=lo, hi=hi, beyond=beyond / pairs, kw=sum(kw) / len(kw), sw=sum(sw) / len(sw)))
    return out


@pytest.mark.parametrize("n,chunk", [(13, 4), (21, 256)])
def test_regime_matches_literal_loop(n, chunk):
    gen = torch.Generator().manual_seed(0)
    d, hq, hkv = 8, 4, 2
    q = torch.randn(2, hq, n, d, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(2, hkv, n, d, generator=gen, dtype=torch.float64) * 2
    groups = torch.randint(0, 3, (hq, d), generator=gen)
    factor = perturbed_factor(taylor_factor(hq, 3), 0.5, generator=gen)
    factor[:, 0, 0] = -0.3  # a vertex inside the logit range for some heads
    method = build_method("oal", hq, hkv, d, groups=groups, factor=factor)
    acc = RegimeAccumulator(kernels={"oal": {1: method}}, min_keys=3, query_chunk=chunk, logit_row_stride=1)
    acc(_captured(q[:1], k[:1]))
    acc(_captured(q[1:], k[1:]))
    res = acc.summary()["layers"]["1"]
    ref = _reference(q, k, method, 3)
    for h in range(hq):
        assert res["max_weight"][h] == pytest.approx(ref[h]["max_weight"], rel=1e-9)
        assert res["eff_keys"][h] == pytest.approx(ref[h]["eff_keys"], rel=1e-9)
        assert res["logit_min"][h] == pytest.approx(ref[h]["lo"]) and res["logit_max"][h] == pytest.approx(ref[h]["hi"])
        ks = res["kernels"]["oal"]
        assert ks["beyond_vertex"][h] == pytest.approx(ref[h]["beyond"], rel=1e-9)
        assert ks["kernel_weight_beyond"][h] == pytest.approx(ref[h]["kw"], rel=1e-9)
        assert ks["softmax_weight_beyond"][h] == pytest.approx(ref[h]["sw"], rel=1e-9)
    assert 0 < sum(res["kernels"]["oal"]["beyond_vertex"]) < hq  # both cases occur


def test_global_vertex_is_minus_b_over_2c():
    # G = 1: beyond the vertex <=> s < -b / 2c (kappa = a + b s + c s^2 with c > 0)
    gen = torch.Generator().manual_seed(1)
    d = 8
    q = torch.randn(1, 1, 30, d, generator=gen, dtype=torch.float64) * 3
    k = torch.randn(1, 1, 30, d, generator=gen, dtype=torch.float64) * 3
    factor = torch.tensor([[[1.0, 0.0], [2.0, 1.0]]], dtype=torch.float64)  # M = [[1, 2], [2, 5]]: b = 4, c = 5
    method = build_method("global", 1, 1, d, factor=factor)
    acc = RegimeAccumulator(kernels={"global": {0: method}}, min_keys=1, logit_row_stride=1)
    acc(_captured(q, k, layer=0))
    s = (q[0, 0] @ k[0, 0].T / math.sqrt(d)).tril()
    causal = torch.ones(30, 30, dtype=torch.bool).tril()
    expected = float(((s < -4 / 10) & causal).sum()) / float(causal.sum())
    assert acc.summary()["layers"]["0"]["kernels"]["global"]["beyond_vertex"][0] == pytest.approx(expected)


def test_padding_mask_and_min_keys():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 2, 10, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(1, 1, 10, 4, generator=gen, dtype=torch.float64)
    mask = torch.tensor([[1] * 7 + [0] * 3])
    padded = RegimeAccumulator(min_keys=2, logit_row_stride=1)
    padded(_captured(q, k, mask=mask))
    plain = RegimeAccumulator(min_keys=2, logit_row_stride=1)
    plain(_captured(q[:, :, :7], k[:, :, :7]))
    a, b = padded.summary()["layers"]["1"], plain.summary()["layers"]["1"]
    for key in ("max_weight", "eff_keys", "logit_min", "logit_max", "logit_p50"):
        assert a[key] == pytest.approx(b[key])
    assert a["pairs"] == b["pairs"] == sum(range(2, 8))  # queries 1..6 (>= 2 causal keys each)


def test_verdict_text():
    peaked = {"1": {"max_weight": [0.9, 0.95, 0.6], "kernels": {}}}
    v = regime_verdict(peaked)
    assert v["outside_regime"] and "OUTSIDE" in v["text"] and v["peaked"]["1"] == [0, 1, 2]
    spread = {"1": {"max_weight": [0.1, 0.2, PEAKED_MAX_WEIGHT - 0.01],
                    "kernels": {"global": {"beyond_vertex": [0.5, 0.01, 0.3],  # share alone does not decide
                                           "kernel_weight_beyond": [0.2, 0.01, 0.4],
                                           "softmax_weight_beyond": [0.1, 0.0, 0.4 - VERTEX_EXCESS - 0.01]}}}}
    v = regime_verdict(spread)
    assert not v["outside_regime"] and v["outside"]["1"] == [2] and "1 of 3" in v["text"]
    assert "inside" in regime_verdict({"0": {"max_weight": [0.1], "kernels": {}}})["text"]


def test_attention_regime_on_a_model():
    from _tiny import tiny_model

    model = tiny_model("qwen2", 50)
    blocks = torch.randint(0, 50, (2, 24), generator=torch.Generator().manual_seed(0))
    res = attention_regime(model, blocks, [0, 2], min_keys=4)
    assert set(res["layers"]) == {"0", "2"} and res["settings"]["blocks"] == [2, 24]
    row = res["layers"]["0"]
    assert len(row["max_weight"]) == 6 and all(0 < w <= 1 for w in row["max_weight"])
    assert all(1 <= e <= 24 for e in row["eff_keys"])
    with pytest.raises(ValueError, match="blocks"):
        attention_regime(model, torch.zeros(0, 4, dtype=torch.long), [0])


def test_sampled_rows_score_only_those_rows():
    """max_rows: the statistics of the evenly spaced rows alone (O(N max_rows)); max_logits thins the quantile
    sample only. Checked against a direct computation on the same rows."""
    gen = torch.Generator().manual_seed(3)
    n, d, rows = 41, 8, 6
    q = torch.randn(1, 2, n, d, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64) * 2
    acc = RegimeAccumulator(min_keys=4, logit_row_stride=1, max_rows=rows, max_logits=7, query_chunk=4)
    acc(_captured(q, k))
    res = acc.summary()
    row = res["layers"]["1"]
    picked = torch.linspace(0, n - 1, rows, dtype=torch.float64).round().long().unique()
    picked = picked[picked + 1 >= 4]  # at least min_keys causal keys
    s = q[0] @ k[0].transpose(-1, -2) / math.sqrt(d)  # [2, n, n]
    for h in range(2):
        w = [torch.softmax(s[h, i, : i + 1], 0).max() for i in picked]
        assert row["max_weight"][h] == pytest.approx(float(torch.stack(w).median()), rel=1e-12)
        assert row["logit_max"][h] == pytest.approx(max(float(s[h, i, : i + 1].max()) for i in picked))
    assert row["pairs"] == int((picked + 1).sum())
    assert res["settings"]["max_rows"] == rows and res["settings"]["max_logits"] == 7
    assert len(acc.layers[1]["logits"]) == 1 and acc.layers[1]["logits"][0].shape == (2, 7)
    full = RegimeAccumulator(min_keys=4, logit_row_stride=1, max_rows=n)  # n rows: every row, as without max_rows
    full(_captured(q, k))
    exact = RegimeAccumulator(min_keys=4, logit_row_stride=1)
    exact(_captured(q, k))
    assert full.summary()["layers"] == exact.summary()["layers"]
    with pytest.raises(ValueError, match="max_rows"):
        RegimeAccumulator(max_rows=0)


def test_non_causal_captures_score_every_real_key():
    """Encoders (`Captured.causal=False`, e.g. `oal analyze` on a BERT-family model): softmax attends every real key,
    so each query's row is the softmax over all real keys, not over its causal prefix; padded keys stay out."""
    gen = torch.Generator().manual_seed(4)
    n, d = 9, 4
    q = torch.randn(1, 2, n, d, generator=gen, dtype=torch.float64) * 2
    k = torch.randn(1, 1, n, d, generator=gen, dtype=torch.float64) * 2
    mask = torch.tensor([[1] * 7 + [0] * 2])
    v, out = torch.zeros(1, 1, n, 3), torch.zeros(1, 2, n, 3)
    acc = RegimeAccumulator(min_keys=1, logit_row_stride=1)
    acc(Captured(1, q, k, v, out, mask, 1 / math.sqrt(d), causal=False))
    row = acc.summary()["layers"]["1"]
    s = q[0, :, :7] @ k[0, :, :7].transpose(-1, -2) / math.sqrt(d)  # [2, 7, 7]: every real query, every real key
    p = torch.softmax(s, -1)
    for h in range(2):
        assert row["max_weight"][h] == pytest.approx(float(p[h].amax(-1).median()), rel=1e-12)
        ent = -(p[h] * p[h].log()).sum(-1)
        assert row["eff_keys"][h] == pytest.approx(float(ent.exp().median()), rel=1e-12)
        assert row["logit_min"][h] == pytest.approx(float(s[h].min()))
        assert row["logit_max"][h] == pytest.approx(float(s[h].max()))
    assert row["pairs"] == 7 * 7
