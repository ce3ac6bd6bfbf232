"""`oal diagnose` against the paper: Table 1's subsets are App. B's groups whatever the run converted with, a part is
recomputed when any block it reads changes, the parts say which model they measured, an `oal run` directory keeps
its own group-budget figure, the budget figure's legend keeps off its points, and the offset part regroups with the
run's own procedure."""

import json

import pytest
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg

from oal.calibration.data import CalibConfig
from oal.diagnostics import diagnose
from oal.diagnostics.retained_error import RetainedErrorConfig

GROUPING = dict(tail_fraction=0.25, min_support=0.5, min_ratio=1.2, min_groups=2, n_bootstrap=20)
CALIB = CalibConfig.preset("tiny", max_steps=2, val_every=1, patience=1)


def _tiny_model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(cfg).eval()


def _blocks(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n, length: torch.randint(0, 97, (n, length), generator=g)  # noqa: E731
    return {"grouping": mk(6, 24), "calib_train": mk(2, 32), "calib_val": mk(1, 32), "fidelity": mk(2, 32)}


def test_budget_legend_keeps_off_the_points_and_names_both_curves(tmp_path, monkeypatch):
    """The legend sat in the upper right, where the coefficient curve ends (G = 8 of a run's 1, 2, 3, 4, 6, 8), and
    listed only the left axis's curve."""
    import oal.diagnostics.budget as budget

    figs = []
    real = budget.atomic_save_figure
    monkeypatch.setattr(budget, "atomic_save_figure", lambda fig, path, **kw: figs.append(fig) or real(fig, path, **kw))
    mse = [0.0548, 0.0548, 0.0552, 0.0552, 0.0538, 0.0527]  # the embedded default's layer 1 head 0
    res = {"layer": 1, "head": 0, "app_b_groups": 2,
           "points": [{"G": g, "coefficients": budget.coefficients_per_head(g), "heldout_mse": m}
                      for g, m in zip((1, 2, 3, 4, 6, 8), mse, strict=True)]}
    budget.plot_budget(res, tmp_path / "b.png")
    fig = figs[0]
    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent(canvas.get_renderer())
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("coefficients" in t for t in labels) and any("MSE" in t for t in labels)
    points = [line.get_transform().transform(xy) for a in fig.axes for line in a.get_lines()
              for xy in line.get_xydata() if line.get_marker() not in (None, "None", "")]
    assert len(points) == 12
    assert not any(legend.contains(x, y) for x, y in points)


def test_diagnose_keeps_the_run_directorys_own_budget_figure(tmp_path):
    """In an `oal run` directory the report embeds figures/group_budget.png beside the run's budget table (G = 1, 2,
    3, 4, 6, 8 with App. B's choice); diagnose's budget part drew over it, and Table 1's figure appeared, unlabelled,
    among the report's contribution-analysis figures."""
    (tmp_path / "config.json").write_text("{}")  # an `oal run` directory
    (tmp_path / "figures").mkdir()
    run_fig = tmp_path / "figures" / "group_budget.png"
    run_fig.write_bytes(b"the run's figure")
    res = diagnose(_tiny_model(), _blocks(), [1], tmp_path, parts=("budget", "table1"), calib_cfg=CALIB,
                   grouping=GROUPING, budget_head=(1, 0), budgets=(1, 2), table1_methods=("taylorshift",),
                   table1_cfg=RetainedErrorConfig.preset("tiny"))
    assert run_fig.read_bytes() == b"the run's figure"
    # Table 1's figure too: the report shows every other figures/*.png as its contribution analysis'
    assert sorted(p.name for p in (tmp_path / "figures").glob("*.png")) == ["group_budget.png"]
    for name in ("group_budget.png", "retained_error.png"):
        assert (tmp_path / "figures" / "diagnostics" / name).stat().st_size > 0
    assert res["budget"]["app_b_groups"] >= 2  # App. B's choice for the head, marked on the curve


@pytest.mark.parametrize("role", ["calib_train", "calib_val"])
def test_a_part_is_recomputed_when_its_calibration_blocks_change(tmp_path, role):
    """Table 2 and Fig. 2(b) calibrate on calib_train / calib_val, but their keys held neither: other calibration
    data (another plan or corpus under the same groups) was served the old numbers."""
    model = _tiny_model()
    kw = dict(parts=("budget", "table2"), table2_methods=("taylorshift",), calib_cfg=CALIB, grouping=GROUPING,
              budget_head=(1, 0), budgets=(1,))
    first = diagnose(model, _blocks(), [1], tmp_path, **kw)
    other = _blocks()
    other[role] = _blocks(seed=7)[role]
    again = diagnose(model, other, [1], tmp_path, **kw)
    for part in ("budget", "table2"):
        assert again[part]["settings_key"] != first[part]["settings_key"], part
    if role == "calib_val":  # the recomputed numbers are the new blocks'
        assert again["budget"]["points"][0]["val_mse"] != first["budget"]["points"][0]["val_mse"]


def test_parts_say_which_model_they_measured(tmp_path):
    model = _tiny_model()
    res = diagnose(model, _blocks(), [1], tmp_path, parts=("table2",), table2_methods=("taylorshift",),
                   calib_cfg=CALIB, grouping=GROUPING, model_name="tiny-qwen2")
    saved = json.loads((tmp_path / "diagnostics" / "table2.json").read_text())
    assert saved["model"] == res["table2"]["model"] == "tiny-qwen2" and len(saved["model_sha256"]) == 64
    md = (tmp_path / "diagnostics" / "table2.md").read_text()
    assert "`tiny-qwen2`" in md and "layers [1]" in md


def _budget_run_groups(model, out, budget: int) -> dict:
    """DIR/groups.json of a run that converted with `--grouping budget:G` (App. B's groups kept beside)."""
    from oal.analysis.runner import analyze

    analyze(model, None, _blocks()["grouping"], [1], out, figures=False, progress=False, budget=budget, **GROUPING)
    return json.loads((out / "groups.json").read_text())


def test_table1_subsets_are_app_b_groups_when_the_run_used_a_fixed_budget(tmp_path):
    """App. A.2: S_h is the union of the non-bulk groups of App. B's procedure. A run converted with
    `--grouping budget:G` records the budget's groups as the ones used, and Table 1 took those (its Gaussian control
    still grouped with App. B), so the two columns measured different subset rules."""
    model = _tiny_model()
    data = _budget_run_groups(model, tmp_path, budget=6)
    assert data["procedure"] == "budget:6"
    app_b = sum(sum(1 for g in h["app_b"]["groups"] if g) for h in data["heads"]["1"])
    used = sum(sum(1 for g in h["groups"] if g) for h in data["heads"]["1"])
    assert app_b != used  # the two rules pick different subsets here
    t1 = RetainedErrorConfig.preset("tiny", n_controls=2, seeds=(0,))
    res = diagnose(model, _blocks(), [1], tmp_path, parts=("table1",), table1_methods=("taylorshift",),
                   table1_cfg=t1, grouping=GROUPING)
    assert res["table1"]["high_contribution"]["taylorshift"]["subset_dims_total"] == app_b
    recorded = json.loads((tmp_path / "diagnostics" / "groups.json").read_text())
    assert recorded["procedure"] == "budget:6"


def test_offset_part_regroups_with_a_runs_fixed_budget(tmp_path):
    """A run converted with `--grouping budget:G` records {"budget": G} in its grouping settings; the offset part
    passed them to App. B's `stable_gap_groups`, which has no such argument (TypeError)."""
    from oal.diagnostics.offset_part import OffsetSettings

    settings = OffsetSettings(cfg=CALIB, grouping={**GROUPING, "budget": 3}, seed=0, layer=1, stds=[0.0])
    res = diagnose(_tiny_model(), _blocks(), [1], tmp_path, parts=("offset",), offset=settings)["offset"]
    assert [g["n_groups"] for g in res["rows"][0]["groups"]] == [3] * 4


def test_table2_windows_take_the_runs_window(tmp_path):
    """A run with `--window W --sinks S` measured its windowed arms at W; diagnose's Table 2 built them at the
    default window (64: on these 32-token blocks every key, i.e. exact softmax) whatever the run used."""
    from oal.diagnostics.run_inputs import read_run

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text(json.dumps({"config": {"model": "default", "window": 8, "sinks": 2},
                                                              "split_plan": {}}))
    options = read_run(tmp_path / "run")["options"]
    assert options == {"window": 8, "sinks": 2}
    model = _tiny_model()
    kw = dict(parts=("table2",), table2_methods=("swa",), calib_cfg=CALIB, grouping=GROUPING)
    default = diagnose(model, _blocks(), [1], tmp_path / "a", **kw)["table2"]["fidelity"]["swa"]
    run = diagnose(model, _blocks(), [1], tmp_path / "b", method_options=options, **kw)["table2"]["fidelity"]["swa"]
    assert default["mse"] < 1e-12 < run["mse"]
