"""Per-query offsets (oal.analysis.offset) against explicit pairs, and the planted-offset experiment
(oal.diagnostics.offset, `oal diagnose --parts offset`) on a tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from oal.analysis.offset import (
    ISOLATED_OFFSET_STD,
    OffsetAccumulator,
    group_offsets,
    offset_moments,
    offset_moments_reference,
    offset_summary,
    offset_verdict,
)
from oal.calibration.data import CalibConfig, LayerData
from oal.diagnostics.offset import offset_experiment, offset_plan, plant_offset, slowest_rope_pair, softmax_reference
from oal.models.capture import Captured

SCALE = 8.0  # q/k projection weights x SCALE: attention logits of order one
GROUPING = dict(tail_fraction=0.25, min_support=0.9, min_ratio=1.5, min_groups=2, n_bootstrap=200)


def _qk(b=2, hq=6, hkv=3, n=11, d=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, n, d, generator=g, dtype=torch.float64),
            torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("causal", [True, False])
def test_moments_match_explicit_pairs(causal):
    q, k = _qk()
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[0, 8:] = False  # right padding
    mask[1, :2] = False  # left padding
    for chunk in (1, 4, 64):
        fast = offset_moments(q, k, mask, causal=causal, query_chunk=chunk)
        ref = offset_moments_reference(q, k, mask, causal=causal)
        for key in ref:
            torch.testing.assert_close(fast[key], ref[key], rtol=1e-12, atol=1e-12)


def test_group_statistics_are_the_variances_of_the_group_scores():
    # the definitions, literally: per query the mean over its keys, variances over all causal pairs
    q, k = _qk(b=2, hq=4, hkv=2, n=9, d=6, seed=3)
    q[..., 5] = q[..., 5] * 3 + 4  # a large, nearly per-query-constant dimension
    k[..., 5] = 0.05 * k[..., 5] + 1.5
    groups = torch.tensor([[0, 0, 1, 0, 0, 2]] * 4)
    stats = group_offsets(offset_moments(q, k), groups)["heads"]
    scale = 6**-0.5
    for h in range(4):
        kv = h // 2
        s_pairs, m_pairs = {g: [] for g in (-1, 0, 1, 2)}, {g: [] for g in (-1, 0, 1, 2)}
        m_dims = []
        for b in range(2):
            for i in range(9):
                x = q[b, h, i] * k[b, kv, : i + 1] * scale  # [i+1, d]
                m_dims += [x.mean(0)] * (i + 1)
                for g in (-1, 0, 1, 2):
                    s = x.sum(1) if g < 0 else x[:, groups[h] == g].sum(1)
                    s_pairs[g] += s.tolist()
                    m_pairs[g] += [float(s.mean())] * (i + 1)  # each pair carries its query's mean
        m_r = torch.stack(m_dims)  # [pairs, d]: per-dimension per-query means
        m_r = m_r - m_r.mean(0)
        carry = (m_r * m_r.sum(1, keepdim=True)).mean(0) / m_r.sum(1).var(unbiased=False)  # Cov(m_r, m) / Var(m)
        var = {g: torch.tensor(v, dtype=torch.float64).var(unbiased=False) for g, v in s_pairs.items()}
        bet = {g: torch.tensor(v, dtype=torch.float64).var(unbiased=False) for g, v in m_pairs.items()}
        assert stats[h]["offset_share"] == pytest.approx(float(bet[-1] / var[-1]), rel=1e-10)
        assert stats[h]["offset_std"] == pytest.approx(math.sqrt(bet[-1]), rel=1e-10)
        for row in stats[h]["groups"]:
            assert row["share"] == pytest.approx(float(bet[row["group"]] / var[row["group"]]), rel=1e-10)
            assert row["offset_std"] == pytest.approx(math.sqrt(bet[row["group"]]), rel=1e-10)
        assert float(carry.sum()) == pytest.approx(1.0) and stats[h]["carrying_dims"] == carry.topk(5).indices.tolist()
        torch.testing.assert_close(torch.tensor(stats[h]["carrying_share"], dtype=torch.float64), carry.topk(5).values)
        assert stats[h]["carrying_dims"][0] == 5
        assert stats[h]["isolated_offset_std"] == pytest.approx(math.sqrt(bet[2]), rel=1e-10)  # group 2 = dim 5


def test_accumulator_and_verdict():
    q, k = _qk(b=1, hq=4, hkv=2, n=12, d=8, seed=5)
    acc = OffsetAccumulator(query_chunk=5)
    for _ in range(2):  # two batches of one layer add up
        acc(Captured(3, q, k, k, q, None, 8**-0.5))
    both = offset_moments(torch.cat([q, q]), torch.cat([k, k]))
    torch.testing.assert_close(acc.layers[3]["s2"], both["s2"])
    summary = offset_summary(acc.layers, {3: torch.zeros(4, 8, dtype=torch.long)})
    assert not summary["verdict"]["has_offset_structure"] and "does NOT" in summary["verdict"]["text"]
    row = {"heads": [{"isolated_offset_std": x, "offset_share": 0.5} for x in (2.0, 1.5, 0.2, 3.0)]}
    v = offset_verdict({"1": row})
    assert v["has_offset_structure"] and v["heads"] == {"1": [0, 1, 3]} and v["n_with_offset"] == 3
    row = {"heads": [{"isolated_offset_std": x, "offset_share": 0.5} for x in (ISOLATED_OFFSET_STD, 0, 0, 0)]}
    assert not offset_verdict({"1": row})["has_offset_structure"]


def test_planting_preserves_softmax_and_plants_the_requested_offset():
    q, k = _qk(b=3, hq=4, hkv=2, n=37, d=10, seed=7)
    v = torch.randn(3, 2, 37, 5, dtype=torch.float64)
    dims = (4, 9)
    plan = offset_plan(q, k, dims, 3.0)
    pq, pk = plant_offset(q, k, dims, plan)
    # exactly function-preserving (float64 rounding only)
    assert float((softmax_reference(pq, pk, v) - softmax_reference(q, k, v)).abs().max()) < 1e-12
    # the change of every logit is a per-query constant, and its std (RMS over each KV head's query heads) is 3
    rep = 2
    delta = (pq @ pk.repeat_interleave(rep, 1).transpose(-1, -2) - q @ k.repeat_interleave(rep, 1).transpose(-1, -2))
    delta = delta / math.sqrt(10)
    torch.testing.assert_close(delta, delta[..., :1].expand_as(delta), rtol=0, atol=1e-10)
    per_head = delta[..., 0].transpose(0, 1).reshape(4, -1).std(1, unbiased=False)
    torch.testing.assert_close(per_head.view(2, 2).square().mean(1).sqrt(), torch.full((2,), 3.0, dtype=torch.float64))
    # dims other than the pair untouched; offset 0 is the identity
    keep = [r for r in range(10) if r not in dims]
    assert torch.equal(pq[..., keep], q[..., keep]) and torch.equal(pk[..., keep], k[..., keep])
    q0, k0 = plant_offset(q, k, dims, offset_plan(q, k, dims, 0.0))
    assert torch.equal(q0, q) and torch.equal(k0, k)
    with pytest.raises(ValueError, match="offset_std"):
        offset_plan(q, k, dims, -1.0)


def _tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=128)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # logits of order one, as in a trained model (random init leaves attention uniform)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(SCALE)
            layer.self_attn.k_proj.weight.mul_(SCALE)
    return model


def _blocks():
    g = torch.Generator().manual_seed(1)
    mk = lambda n, length: torch.randint(0, 97, (n, length), generator=g)  # noqa: E731
    return {"grouping": mk(16, 32), "calib_train": mk(4, 64), "calib_val": mk(2, 64), "fidelity": mk(4, 64)}


def test_slowest_rope_pair():
    model = _tiny_model()
    assert slowest_rope_pair(model) == (7, 15)  # inv_freq falls with the index: the last pair of rotate_half


def test_tiny_model_oal_beats_global_on_planted_offsets_only(tmp_path, monkeypatch):
    from oal.diagnostics import diagnose
    from oal.diagnostics.offset_part import OffsetSettings

    model = _tiny_model()
    cfg = CalibConfig(max_steps=100, val_every=25, patience=100, seed=0)  # measured: ratio 0.999 at 0, 0.472 at 6
    settings = OffsetSettings(cfg=cfg, grouping=GROUPING, seed=0, layer=1, stds=[0.0, 6.0])
    res = diagnose(model, _blocks(), [1], tmp_path, parts=["offset"], offset=settings)["offset"]
    rows = {r["offset_std"]: r for r in res["rows"]}
    assert res["complete"] and res["softmax_max_change"] < 1e-12 and res["softmax_max_change_captured_dtype"] < 1e-5
    assert 0.95 <= rows[0.0]["ratio"] <= 1.02  # no offset: OAL ties with global
    assert rows[6.0]["ratio"] <= 0.6  # planted offset: OAL's error at least 40% below global's
    assert rows[6.0]["global_relmse"] > 2 * rows[0.0]["global_relmse"]  # which the offset breaks
    assert all(g["isolated"] for g in rows[6.0]["groups"])  # App. B cut the planted dims out of the bulk
    assert min(rows[6.0]["isolated_offset_std"]) >= ISOLATED_OFFSET_STD
    assert max(rows[0.0]["isolated_offset_std"]) < ISOLATED_OFFSET_STD
    saved = json.loads((tmp_path / "diagnostics" / "offset.json").read_text())
    assert saved["rows"] == res["rows"] and saved["settings"]["dims"] == [7, 15]
    assert (tmp_path / "figures" / "offset" / "relmse.png").stat().st_size > 0
    assert "| 6 |" in (tmp_path / "diagnostics" / "offset.md").read_text()
    # the same settings again: found done, nothing recalibrated
    import oal.calibration.fit as fit

    orig = fit.calibrate_methods
    calls = []
    monkeypatch.setattr(fit, "calibrate_methods", lambda *a, **k: calls.append(1) or orig(*a, **k))
    stamp = (tmp_path / "diagnostics" / "offset.json").stat().st_mtime_ns
    diagnose(model, _blocks(), [1], tmp_path, parts=["offset"], offset=settings)
    assert calls == [] and (tmp_path / "diagnostics" / "offset.json").stat().st_mtime_ns == stamp
    # an interrupted result (as the part writes it after each row) resumes at the missing row only
    from oal.diagnostics.parts import write_part

    saved.update(complete=False, rows=saved["rows"][:1])
    write_part(tmp_path / "diagnostics" / "offset.json", saved)
    again = diagnose(model, _blocks(), [1], tmp_path, parts=["offset"], offset=settings)["offset"]
    assert calls == [1] and again["complete"] and again["rows"][1]["ratio"] == pytest.approx(rows[6.0]["ratio"])
    # the same file edited by hand is not trusted: every row is computed again
    edited = json.loads((tmp_path / "diagnostics" / "offset.json").read_text())
    edited.update(complete=False, rows=edited["rows"][:1])
    (tmp_path / "diagnostics" / "offset.json").write_text(json.dumps(edited))
    diagnose(model, _blocks(), [1], tmp_path, parts=["offset"], offset=settings)
    assert calls == [1, 1, 1]


def test_experiment_refuses_padded_data():
    q, k = _qk(b=1, hq=2, hkv=1, n=8, d=4)
    data = LayerData(q, k, k, q, mask=torch.ones(1, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="unpadded"):
        offset_experiment(data, data, data, data, layer=0, dims=(1, 3), grouping_params=GROUPING, cfg=CalibConfig(),
                          seed=0)


def test_cli_offset_options(tmp_path):
    from _tiny import save_tiny_llama
    from typer.testing import CliRunner

    from oal.cli import load_commands

    runner, model = CliRunner(), str(save_tiny_llama(tmp_path / "model"))
    args = ["diagnose", "--out", str(tmp_path / "out"), "--model", model, "--parts", "offset"]
    res = runner.invoke(load_commands(), [*args, "--offsets", "1,2"])
    assert res.exit_code == 2 and "--offsets" in res.output and "including 0" in res.output
    res = runner.invoke(load_commands(), [*args, "--offsets", "0,1e308"])  # finite, yet far beyond float32's reach
    assert res.exit_code == 2 and "--offsets" in res.output and "[0, 1000]" in res.output, res.output
    res = runner.invoke(load_commands(), [*args, "--layer", "3"])  # 3 layers
    assert res.exit_code == 2 and "--layer" in res.output and "[0, 3)" in res.output


def test_report_shows_offsets_the_experiment_and_the_gain_per_layer(tmp_path):
    from test_report import _run_dir

    from oal.pipeline.report import figure_references, write_report
    from oal.rundir.files import atomic_write_json

    d = _run_dir(tmp_path, with_figures=False)
    metrics = json.loads((d / "metrics.json").read_text())
    for m, rel in (("oal", {"1": 0.30, "2": 0.45}), ("global", {"1": 0.40, "2": 0.46})):
        metrics["fidelity"][m]["per_layer"] = {k: {"relmse": v} for k, v in rel.items()}
    atomic_write_json(d / "metrics.json", metrics)
    q, k = _qk(b=1, hq=2, hkv=1, n=10, d=4, seed=2)
    groups = torch.tensor([[0, 0, 1, 1]] * 2)
    offset = offset_summary({1: offset_moments(q, k), 2: offset_moments(k, k)}, {1: groups, 2: groups})
    atomic_write_json(d / "analysis.json", {"offset": offset, "concentration": {
        "real_top5": [[0.9, 0.8], [0.7, 0.6]], "gaussian_top5": [[0.5, 0.5], [0.5, 0.5]]}})
    row = {"realised_offset_std": [3.0, 3.1], "oal_relmse": 0.2, "global_relmse": 0.4, "ratio": 0.5,
           "groups": [{"n_groups": 2, "isolated": True}] * 2, "softmax_max_change": 1e-15,
           "softmax_max_change_captured_dtype": 1e-7, "isolated_offset_share": [0.6, 0.7]}
    atomic_write_json(d / "diagnostics" / "offset.json", {"settings": {
        "layer": 1, "dims": [1, 3], "cfg": {"max_steps": 40}, "seed": 0}, "softmax_max_change": 1e-15,
        "rows": [{**row, "offset_std": 0.0, "ratio": 1.0, "isolated_offset_share": [0, 0]},
                 {**row, "offset_std": 3.0}]})
    text = write_report(d).read_text()
    assert "## Per-query offsets" in text and offset["verdict"]["text"] in text
    assert "| 3 | 3.05 | 0.2000 | 0.4000 | 0.500 | 2, 2 | 2 of 2 |" in text  # the experiment's row
    share = sum(h["isolated_offset_share"] for h in offset["layers"]["1"]["heads"]) / 2
    assert f"| 1 | {100 * share:.2f}% | +25.0% |" in text  # layer 1: 1 - 0.30 / 0.40
    assert "figures/offset/gain.png" in figure_references(text)
    assert (d / "figures" / "offset" / "gain.png").stat().st_size > 0
