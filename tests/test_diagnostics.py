"""Table 1 (retained-error ratio, controls, Eq. 8-15), budget and tables on synthetic data."""

import math

import pytest
import torch

from oal.diagnostics.retained_error import (
    RetainedErrorConfig,
    SequenceQKV,
    gaussian_control,
    gaussian_groups,
    hybrid_output,
    matched_controls,
    p_value,
    retained_error,
)
from oal.methods import build_method, repeat_kv

BASELINES = ("performer", "spectraformer", "dijiang", "taylorshift")
D = 16


def _seq(n, hq=4, hkv=2, seed=0, outliers=(3, 11), boost=5.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, hq, n, D, generator=g, dtype=torch.float64) * 0.6
    k = torch.randn(1, hkv, n, D, generator=g, dtype=torch.float64) * 0.6
    q[..., list(outliers)] *= boost
    k[..., list(outliers)] *= boost
    v = torch.randn(1, hkv, n, 6, generator=g, dtype=torch.float64)
    return SequenceQKV(q, k, v)


def _groups(hq=4, outliers=(3, 11)):
    g = torch.zeros(hq, D, dtype=torch.long)
    g[:, outliers[0]] = 1
    g[:, outliers[1]] = 2
    return g


def _softmax_at(q, k, v, pos):
    rep = q.shape[1] // k.shape[1]
    s = q[:, :, pos] @ repeat_kv(k, rep).transpose(-1, -2) / math.sqrt(D)
    s = s.masked_fill(torch.arange(k.shape[2])[None, :] > pos[:, None], -math.inf)
    return torch.softmax(s, -1) @ repeat_kv(v, rep)


@pytest.mark.parametrize("name", BASELINES)
def test_hybrid_extremes(name):
    m = build_method(name, 4, 2, D, seed=1, layer_idx=0).double()
    s = _seq(23, seed=2)
    pos = torch.tensor([0, 4, 9, 22])
    masks = torch.stack([torch.ones(4, D, dtype=torch.bool), torch.zeros(4, D, dtype=torch.bool)])
    y = hybrid_output(m, s.q, s.k, s.v, pos, masks)
    # all dims approximated: the method on the full head (its own dense reference at those positions)
    torch.testing.assert_close(y[0:1], m.reference(s.q, s.k, s.v)[:, :, pos], rtol=1e-10, atol=1e-12)
    # no dims approximated: exact softmax (kernel of zero inputs is constant for every method)
    torch.testing.assert_close(y[1:2], _softmax_at(s.q, s.k, s.v, pos), rtol=1e-10, atol=1e-12)


def test_hybrid_kernel_is_product_eq10():
    # one head, a literal Eq. 10 product built from the method's own dense kernel on masked inputs
    m = build_method("dijiang", 1, 1, D, seed=0).double()
    s = _seq(9, hq=1, hkv=1, seed=3)
    mask = torch.zeros(1, D, dtype=torch.bool)
    mask[0, [1, 3, 4]] = True
    pos = torch.arange(9)
    y = hybrid_output(m, s.q, s.k, s.v, pos, mask[None])
    mf = mask.double()
    approx = m.dense_kernel(s.q * mf, s.k * mf)[0, 0]
    exact = torch.exp((s.q * (1 - mf))[0, 0] @ (s.k * (1 - mf))[0, 0].T / math.sqrt(D))
    w = (approx * exact).tril()
    torch.testing.assert_close(y[0, 0], (w @ s.v[0, 0]) / w.sum(-1, keepdim=True), rtol=1e-10, atol=1e-12)


def test_matched_controls_and_p_value():
    g = _groups()
    g[2, 5] = 1  # head 2 has |S| = 3
    ctrl = matched_controls(g, 7, torch.Generator().manual_seed(0))
    assert ctrl.shape == (7, 4, D)
    assert ctrl.sum(-1).tolist() == [[2, 2, 3, 2]] * 7
    assert not (ctrl & (g != 0)).any()  # drawn from the bulk only
    assert p_value(0.5, [0.1, 0.2, 0.6]) == pytest.approx(2 / 4)
    assert p_value(0.5, [0.1] * 999) == pytest.approx(1 / 1000)
    with pytest.raises(ValueError, match="bulk"):
        matched_controls(torch.ones(1, 4, dtype=torch.long), 1, torch.Generator())


@pytest.mark.parametrize("name", ["performer", "taylorshift"])
def test_outlier_dims_retain_error(name):
    # planted high-contribution dims: approximating only them retains much more error than random bulk dims
    data = {0: [_seq(40, seed=s) for s in range(2)], 1: [_seq(40, seed=10 + s) for s in range(2)]}
    groups = {0: _groups(), 1: _groups()}
    cfg = RetainedErrorConfig(queries=12, seeds=(0, 1), n_controls=19, control_batch=8)
    res = retained_error(name, data, groups, cfg)
    assert res["method"] == name and res["n_controls"] == 19 and len(res["controls"]) == 19
    assert res["seeds"] == ([0, 1] if name == "performer" else [0])
    assert 0 < res["R_S"] and res["subset_fraction"] == pytest.approx(2 / D)
    assert res["R_S"] > max(res["controls"]) and res["p_value"] == pytest.approx(1 / 20)
    manual = sum(x["R_S"] for x in res["per_layer"].values()) / 2  # equal sequences per layer
    assert res["R_S"] == pytest.approx(manual)


def test_seed_averaging_before_ratio():
    # R_S = mean_seeds(E_S) / mean_seeds(E_full), not the mean of per-seed ratios
    data = {0: [_seq(20, seed=4)]}
    groups = {0: _groups()}
    cfg = RetainedErrorConfig(queries=6, seeds=(0, 1), n_controls=0)
    both = retained_error("performer", data, groups, cfg)
    per = [retained_error("performer", data, groups, RetainedErrorConfig(queries=6, seeds=(s,), n_controls=0))
           for s in (0, 1)]
    e_s = sum(p["per_layer"][0]["E_S"] for p in per) / 2
    e_f = sum(p["per_layer"][0]["E_full"] for p in per) / 2
    assert both["R_S"] == pytest.approx(e_s / e_f, rel=1e-9)


def test_gaussian_control_runs_same_protocol():
    cfg = RetainedErrorConfig.preset("tiny")
    g = gaussian_groups(4, D, cfg, torch.Generator().manual_seed(0))
    assert g.shape == (4, D) and int(g.max(dim=-1).values.min()) >= 1  # at least two groups per head
    data = {0: [_seq(30, seed=5)]}
    res = gaussian_control("dijiang", data, cfg)
    assert res["n_controls"] == 0 and res["p_value"] is None and res["R_S"] > 0


def test_config_presets():
    assert RetainedErrorConfig.preset("paper").n_controls == 1000
    with pytest.raises(ValueError, match="preset"):
        RetainedErrorConfig.preset("nope")
    with pytest.raises(ValueError, match="dtype"):
        RetainedErrorConfig(dtype="float16")


# ----------------------------------------------------------------------------------------------- on a tiny model


def _tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(cfg).eval()


def _blocks():
    g = torch.Generator().manual_seed(1)
    mk = lambda n, length: torch.randint(0, 97, (n, length), generator=g)  # noqa: E731
    return {"grouping": mk(6, 24), "calib_train": mk(2, 32), "calib_val": mk(1, 32), "fidelity": mk(2, 32)}


def test_budget_coefficients():
    from oal.diagnostics import coefficients_per_head

    assert [coefficients_per_head(g) for g in (1, 2, 5)] == [3, 6, 21]


def test_diagnose_end_to_end_and_resume(tmp_path):
    import json

    from oal.calibration.data import CalibConfig
    from oal.diagnostics import diagnose

    model = _tiny_model()
    t1 = RetainedErrorConfig.preset("tiny")
    cc = CalibConfig.preset("tiny", max_steps=6, val_every=3, patience=3)
    grouping = dict(tail_fraction=0.25, min_support=0.5, min_ratio=1.2, min_groups=2, n_bootstrap=20)
    kw = dict(table1_methods=("performer", "taylorshift"), table1_cfg=t1, calib_cfg=cc, grouping=grouping,
              budget_head=(1, 3), budgets=(1, 2, 3))
    res = diagnose(model, _blocks(), [1, 2], tmp_path, **kw)
    t1res = res["table1"]["high_contribution"]
    assert set(t1res) == {"performer", "taylorshift"} and len(t1res["performer"]["controls"]) == 10
    assert set(res["table1"]["gaussian"]) == {"performer", "taylorshift"}
    pts = res["budget"]["points"]
    assert [p["G"] for p in pts] == [1, 2, 3] and [p["coefficients"] for p in pts] == [3, 6, 10]
    assert all(p["heldout_mse"] > 0 for p in pts)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert set(metrics["fidelity"]) == {"performer", "spectraformer", "dijiang", "taylorshift", "global", "oal", "swa",
                                        "global-swa", "oal-swa"}
    for r in metrics["fidelity"].values():
        assert r["mse"] > 0 and r["relmse"] > 0 and r["mse_post_o"] > 0
    md = (tmp_path / "diagnostics" / "table2.md").read_text()
    assert "| OAL |" in md and "| DiJiang |" in md
    assert (tmp_path / "figures" / "group_budget.png").stat().st_size > 0
    assert (tmp_path / "figures" / "retained_error.png").stat().st_size > 0
    assert "High-contrib." in (tmp_path / "diagnostics" / "table1.md").read_text()
    # App. A.1: the Gaussian control groups on as many prompts of the real grouping's length (6 x 24 here, where the
    # tiny preset says 8 x 16): only the distribution of q and k differs
    t1_config = json.loads((tmp_path / "diagnostics" / "table1.json").read_text())["config"]
    assert (t1_config["gaussian_prompts"], t1_config["gaussian_prompt_len"]) == (6, 24)
    # second call: every part is found done (same settings) and nothing is recomputed
    stamps = {p: (tmp_path / "diagnostics" / p).stat().st_mtime_ns for p in ("table1.json", "budget.json",
                                                                               "table2.json")}
    again = diagnose(model, _blocks(), [1, 2], tmp_path, **kw)
    assert again["table2"]["fidelity"] == res["table2"]["fidelity"]
    assert stamps == {p: (tmp_path / "diagnostics" / p).stat().st_mtime_ns for p in stamps}


def test_diagnose_recomputes_a_part_after_a_method_construction_change(tmp_path, monkeypatch):
    # a cached Table 2 made by an older DiJiang construction must not be served as the current one
    from oal.calibration.data import CalibConfig
    from oal.diagnostics import diagnose
    from oal.methods.dijiang import DiJiangMethod

    model = _tiny_model()
    cc = CalibConfig.preset("tiny", max_steps=2, val_every=1, patience=1)
    grouping = dict(tail_fraction=0.25, min_support=0.5, min_ratio=1.2, min_groups=2, n_bootstrap=20)
    kw = dict(parts=("table2",), table2_methods=("dijiang", "taylorshift"), calib_cfg=cc, grouping=grouping)
    first = diagnose(model, _blocks(), [1], tmp_path, **kw)
    path = tmp_path / "diagnostics" / "table2.json"
    stamp = path.stat().st_mtime_ns
    diagnose(model, _blocks(), [1], tmp_path, **kw)
    assert path.stat().st_mtime_ns == stamp  # same construction: found done
    monkeypatch.setattr(DiJiangMethod, "version", DiJiangMethod.version + 1)
    again = diagnose(model, _blocks(), [1], tmp_path, **kw)
    assert path.stat().st_mtime_ns != stamp and again["table2"]["settings_key"] != first["table2"]["settings_key"]


def test_an_edited_or_foreign_part_is_computed_again(tmp_path):
    """A part's key alone let an edited result file be served (its table and figure redrawn from the edited
    numbers), and a part computed on another model was reused: its content hash and the model's fingerprint in its
    key make both count as not done."""
    import json

    from oal.calibration.data import CalibConfig
    from oal.diagnostics import diagnose

    model = _tiny_model()
    cc = CalibConfig.preset("tiny", max_steps=2, val_every=1, patience=1)
    grouping = dict(tail_fraction=0.25, min_support=0.5, min_ratio=1.2, min_groups=2, n_bootstrap=20)
    kw = dict(parts=("table2",), table2_methods=("taylorshift",), calib_cfg=cc, grouping=grouping)
    first = diagnose(model, _blocks(), [1], tmp_path, **kw)["table2"]
    path = tmp_path / "diagnostics" / "table2.json"
    data = json.loads(path.read_text())
    data["fidelity"]["taylorshift"]["relmse"] = 0.001
    path.write_text(json.dumps(data))
    again = diagnose(model, _blocks(), [1], tmp_path, **kw)["table2"]
    assert again["fidelity"]["taylorshift"]["relmse"] == first["fidelity"]["taylorshift"]["relmse"] != 0.001
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    other = diagnose(model, _blocks(), [1], tmp_path, **kw)["table2"]
    assert other["settings_key"] != first["settings_key"]


def test_cli_diagnose_rejects_bad_options(tmp_path):
    from typer.testing import CliRunner

    from oal.cli import load_commands

    app = load_commands()

    runner = CliRunner()
    res = runner.invoke(app, ["diagnose", "--out", str(tmp_path), "--parts", "table9"])
    assert res.exit_code != 0 and "--parts" in res.output
    res = runner.invoke(app, ["diagnose", "--out", str(tmp_path), "--methods", "flash"])
    assert res.exit_code != 0 and "--methods" in res.output


def test_table1_on_embedded_model():
    from oal.diagnostics import capture_sequences
    from oal.models.registry import load_model

    model, _, _ = load_model("default")
    ids = torch.randint(3, 259, (1, 48), generator=torch.Generator().manual_seed(0))
    data = capture_sequences(model, ids, [1])
    hq, d = model.config.num_attention_heads, 64
    groups = {1: torch.zeros(hq, d, dtype=torch.long)}
    groups[1][:, :3] = 1  # any non-empty subset: the protocol must give finite, positive ratios on real q/k
    cfg = RetainedErrorConfig(queries=8, seeds=(0,), n_controls=3)
    for name in BASELINES:
        res = retained_error(name, data, groups, cfg)
        assert math.isfinite(res["R_S"]) and res["R_S"] > 0 and res["per_layer"][1]["E_full"] > 0


def test_table2s_fidelity_bar_follows_a_quiet_console(tmp_path, monkeypatch):
    """`oal -q diagnose` (a quiet console): Table 2's fidelity pass showed its progress bar anyway; and with
    `oal --no-progress` (a console that is not quiet) too."""
    from rich.console import Console

    import oal.diagnostics.runner as runner
    from oal.calibration.data import CalibConfig

    seen = []
    real = runner.run_table2
    monkeypatch.setattr(runner, "run_table2", lambda *a, **kw: seen.append(kw["progress"]) or real(*a, **kw))
    cc = CalibConfig.preset("tiny", max_steps=2, val_every=1, patience=1)
    grouping = dict(tail_fraction=0.25, min_support=0.5, min_ratio=1.2, min_groups=2, n_bootstrap=20)
    for quiet in (True, False):
        runner.diagnose(_tiny_model(), _blocks(), [1], tmp_path / str(quiet), parts=("table2",),
                        table2_methods=("taylorshift",), calib_cfg=cc, grouping=grouping,
                        console=Console(stderr=True, quiet=quiet))
    assert seen == [False, None]  # not quiet: the process default (`oal --no-progress` turns it off)


def test_table1_progress_counts_its_real_work():
    """Each method's progress moves per batch of subsets, in `work_units`: the real data's 2 + B subsets per seed,
    the Gaussian control's 2 (the bar counted a (layer, sequence) pair as one step, so the cheap control looked
    like half the work)."""
    from oal.diagnostics.retained_error import work_units

    data = {0: [_seq(30, seed=s) for s in range(2)], 1: [_seq(30, seed=7)]}
    groups = {0: _groups(), 1: _groups()}
    cfg = RetainedErrorConfig(queries=6, seeds=(0, 1), n_controls=9, control_batch=4)
    for name, seeds in (("performer", 2), ("taylorshift", 1)):
        steps = []
        retained_error(name, data, groups, cfg, progress=steps.append)
        assert sum(steps) == work_units(name, 3, cfg) == 3 * seeds * 11 and len(steps) == 3 * seeds * 3
        steps.clear()
        gaussian_control(name, data, cfg, progress=steps.append)
        assert sum(steps) == work_units(name, 3, cfg, controls=False) == 3 * seeds * 2


def test_table1_has_one_bar_over_the_whole_part(tmp_path, monkeypatch):
    """`oal diagnose --parts table1` showed one bar per method, each counting (layer, sequence) pairs: no estimate of
    the part's time until its last method."""
    from rich.progress import Progress

    import oal.diagnostics.runner as runner

    bars = []

    def recording(*a, **kw):
        bars.append(Progress(disable=True))
        return bars[-1]

    monkeypatch.setattr(runner, "progress_bar", recording)
    grouping = dict(tail_fraction=0.25, min_support=0.5, min_ratio=1.2, min_groups=2, n_bootstrap=20)
    runner.diagnose(_tiny_model(), _blocks(), [1, 2], tmp_path, parts=("table1",),
                    table1_methods=("performer", "taylorshift"), table1_cfg=RetainedErrorConfig.preset("tiny"),
                    grouping=grouping)
    (bar,) = bars
    (task,) = bar.tasks
    assert task.total > 0 and task.completed == task.total and task.description.startswith("Table 1")
