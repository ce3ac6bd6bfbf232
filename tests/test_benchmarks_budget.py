"""benchmarks.budget: the budget plan, the `run` wiring, Table 2 with its block record, and `collect` reading only
verified records of real (tiny) run directories."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _tiny import save_tiny_llama
from test_pipeline import _cfg, assets  # noqa: F401  (the tiny model + corpus fixture of `oal run`)

from benchmarks import budget
from oal.data.splits import SplitPlan, default_plan
from oal.pipeline.runs import run_seed
from oal.rundir.files import load_json

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_run(assets, tmp_path_factory):  # noqa: F811
    """oal, global and softmax adapted 4 updates (validation every 2) on the tiny model."""
    out = tmp_path_factory.mktemp("budget") / "run"
    metrics = run_seed(_cfg(assets), out, progress=False)
    return out, metrics


@pytest.fixture(scope="module")
def tiny_table2(tmp_path_factory):
    """`benchmarks.budget table2` of three methods on a tiny byte-level Llama, 2 fidelity blocks of 64 tokens."""
    root = tmp_path_factory.mktemp("table2")
    model = save_tiny_llama(root / "model")
    out = root / "t2"
    assert budget.main(["table2", "--out", str(out), "--model", str(model), "--fidelity-len", "64",
                        "--fidelity-blocks", "2", "--layers", "1,2", "--methods", "oal,global,dijiang"]) == 0
    return out


def _collect(tmp_path, *args):
    out = tmp_path / "study.json"
    code = budget.main(["collect", "--json", str(out), *args])
    return code, (load_json(out) if code == 0 else None)


def test_preset_lengths_give_the_preset_plan():
    plan = budget.budget_plan(adapt_blocks=256)
    want = default_plan("smollm2-135m").to_dict()
    assert {r: plan[r] for r in want if r != "notes"} == {r: want[r] for r in want if r != "notes"}


def test_long_blocks_follow_calibration_and_stay_disjoint():
    plan = budget.budget_plan(adapt_len=2048, eval_len=2048, fidelity_len=2048, test_blocks=0)
    SplitPlan.from_dict(plan)  # checks every role disjoint from the others
    calib_end = 20 * 512  # the preset's calibration validation ends at 512-block 19
    assert plan["fidelity"]["block_len"] == 2048 and plan["fidelity"]["indices"][0] * 2048 == calib_end
    fid_end = (plan["fidelity"]["indices"][-1] + 1) * 2048
    assert plan["adapt_train"]["indices"] == [fid_end // 2048] and plan["adapt_train"]["through_end"]
    assert plan["test"]["through_end"] and plan["val"]["indices"] == list(range(8))
    assert plan["calib_train"] == default_plan("smollm2-135m").to_dict()["calib_train"]  # the preset's calibration
    long = budget.budget_plan(calib_len=2048, fidelity_len=2048)  # calibrated at the length it is measured at
    SplitPlan.from_dict(long)
    assert long["calib_train"]["block_len"] == long["calib_val"]["block_len"] == 2048
    assert long["calib_train"]["indices"] == list(range(3, 11)) and long["calib_val"]["indices"] == [11, 12]
    assert long["fidelity"]["indices"][0] == 13  # 40 grouping prompts of 128 tokens end at token 5120 = 2.5 x 2048


def test_run_hands_the_pipeline_the_budget_plan(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr("oal.pipeline.runs.run", lambda cfg, out, seeds, **kw: seen.update(cfg=cfg, seeds=seeds))
    assert budget.main(["run", "--out", str(tmp_path / "r"), "--adapt-len", "512", "--steps", "8", "--val-every",
                        "4", "--seeds", "1,2", "--methods", "oal,softmax", "--layers", "5,15"]) == 0
    cfg = seen["cfg"]
    assert cfg.plan == budget.budget_plan(adapt_len=512) and cfg.layers == [5, 15] and seen["seeds"] == [1, 2]
    assert cfg.adapt["steps"] == 8 and cfg.adapt["val_every"] == 4 and cfg.methods == ["oal", "softmax"]
    assert cfg.zeroshot_tasks == []


@pytest.mark.parametrize("argv, needle", [
    (["run", "--out", "x", "--adapt-len", "1"], "--adapt-len"),
    (["run", "--out", "x", "--steps", "0"], "--steps"),
    (["run", "--out", "x", "--methods", "nope"], "methods"),
    (["table2", "--out", "x", "--device", "tpu"], "--device"),
    (["collect", "--runs", "/nonexistent/run"], "--runs"),
    (["collect", "--runs", "x", "--bogus"], "unrecognized"),
])
def test_bad_arguments_are_one_line_errors(argv, needle):
    done = subprocess.run([sys.executable, "-m", "benchmarks.budget", *argv], capture_output=True, text=True,
                          cwd=ROOT)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and needle in lines[0], done.stderr


def test_collect_reads_the_runs_records(tiny_run, tmp_path):
    run, metrics = tiny_run
    code, data = _collect(tmp_path, "--runs", str(run), "--device", "test machine")
    assert code == 0
    assert set(data) >= {"frozen", "curves", "test_ppl", "tokens_per_update", "device"}
    assert data["device"] == "test machine" and data["tokens_per_update"] == 64  # _plan's 64-token blocks, batch 1
    for m in ("oal", "global", "softmax"):
        res = load_json(run / "adapter" / m / "adapt.json")
        assert data["curves"][m] == [[v["step"], pytest.approx(math.exp(v["val_nll"]))] for v in res["validation"]]
        assert [s for s, _ in data["curves"][m]] == [2, 4]
        assert data["test_ppl"][m] == pytest.approx(metrics["perplexity"][m])
        assert data["arms"][m]["test_ppl_calibrated"] == pytest.approx(metrics["perplexity_no_adapt"][m])
    ppl = metrics["perplexity"]
    gap = (ppl["oal"] - ppl["softmax"]) / (ppl["global"] - ppl["softmax"])
    assert data["gap_ratio"]["test"]["oal"] == pytest.approx(gap)
    assert data["goals"]["gap_ratio"]["value"] == pytest.approx(gap)
    assert data["goals"]["gap_ratio"]["met"] == (gap <= 0.85)
    keys = ("relmse", "relmse_post_o", "mse", "mse_post_o")
    assert data["frozen"] == {m: {k: pytest.approx(v[k]) for k in keys}
                              for m, v in metrics["fidelity"].items()}  # no Table 2 given: the run's own
    assert (tmp_path / "study.png").stat().st_size > 0


def test_collect_refuses_an_edited_record(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run[0], run)
    path = run / "adapter" / "global" / "adapt.json"
    res = json.loads(path.read_text())
    res["validation"][0]["val_nll"] = 0.1  # a better number typed in
    path.write_text(json.dumps(res))
    code, _ = _collect(tmp_path, "--runs", str(run))
    assert code == 2


def test_collect_takes_named_arms_and_refuses_duplicates(tiny_run, tmp_path, capsys):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_run[0], copy)  # content-addressed records verify in a copy
    code, _ = _collect(tmp_path, "--runs", str(tiny_run[0]), str(copy))
    assert code == 2 and "in both" in capsys.readouterr().err
    code, data = _collect(tmp_path, "--runs", f"{tiny_run[0]}:oal", f"{copy}:global,softmax")
    assert code == 0 and sorted(data["curves"]) == ["global", "oal", "softmax"]
    assert data["arms"]["oal"]["run_dirs"] == [str(tiny_run[0])] and data["arms"]["global"]["run_dirs"] == [str(copy)]


def test_collect_keeps_each_budget(tiny_run, tmp_path):
    from oal.pipeline.runs import adapt_arm

    short = tmp_path / "short"
    shutil.copytree(tiny_run[0], short)
    for m in ("oal", "global", "softmax"):  # the same arms with 2 updates instead of 4: a smaller budget
        metrics = adapt_arm(short, m, steps=2, progress=False)
    code, data = _collect(tmp_path, "--runs", str(tiny_run[0]), str(short))
    assert code == 0 and sorted(data["budgets"]) == ["2", "4"] and data["updates"] == 4
    assert data["test_ppl"] == data["budgets"]["4"]["test_ppl"]  # the schema's keys: the largest budget
    ppl = metrics["perplexity"]
    assert data["budgets"]["2"]["test_ppl"] == {m: pytest.approx(v) for m, v in ppl.items() if m in data["test_ppl"]}
    gap = (ppl["oal"] - ppl["softmax"]) / (ppl["global"] - ppl["softmax"])
    assert data["gap_ratio_by_budget"]["2"]["oal"] == pytest.approx(gap)
    assert data["goals"]["gap_ratio"]["updates"] == 4


def test_table2_records_its_blocks_and_collect_reads_them(tiny_run, tiny_table2, tmp_path):
    code, data = _collect(tmp_path, "--runs", str(tiny_run[0]), "--table2", str(tiny_table2))
    assert code == 0
    table = data["frozen_tables"][0]
    assert table["blocks"] == [2, 64] and table["calib_blocks"] == [8, 512] and table["layers"] == [1, 2]
    t2 = load_json(tiny_table2 / "diagnostics" / "table2.json")
    assert data["frozen"] == {m: {k: pytest.approx(r[k]) for k in ("relmse", "relmse_post_o", "mse", "mse_post_o")}
                              for m, r in t2["fidelity"].items()}
    best = min(("global", "dijiang"), key=lambda m: t2["fidelity"][m]["relmse"])
    ratio = t2["fidelity"]["oal"]["relmse"] / t2["fidelity"][best]["relmse"]
    goal = data["goals"]["frozen_ratio"]
    assert goal["value"] == pytest.approx(ratio) and goal["best_other"] == best
    assert goal["met"] is False  # three of the five other methods measured: the goal is not shown


def test_collect_refuses_an_edited_table2(tiny_run, tiny_table2, tmp_path):
    t2 = tmp_path / "t2"
    shutil.copytree(tiny_table2, t2)
    path = t2 / "diagnostics" / "table2.json"
    data = json.loads(path.read_text())
    data["layers"] = [0]
    path.write_text(json.dumps(data))
    code, _ = _collect(tmp_path, "--runs", str(tiny_run[0]), "--table2", str(t2))
    assert code == 2
