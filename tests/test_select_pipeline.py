"""`oal run --layers auto:K`, `oal select-layers` and `oal evaluate --passkey` on a tiny random Qwen2 run directory:
exactly K layers converted and listed, kernels of the chosen layers only, the comparison at the paper's K, resume
after a kill, and passkey numbers for softmax and every method before and after adaptation."""

import json

import pytest
import torch
from test_pipeline import _plan, make_assets
from typer.testing import CliRunner

from oal.calibration.kernels import load_kernels
from oal.pipeline.config import RunConfig
from oal.pipeline.runs import run_seed, run_selection

K = 2


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    # 4 layers (the paper's rule converts 1-2); 512 positions hold the passkey prompt in byte tokens
    return make_assets(tmp_path_factory.mktemp("assets"), n_layers=4, max_positions=512, seed=1)


def _cfg(assets, **kw):
    kw.setdefault("select", {"k": K, "by": "fidelity"})
    return RunConfig(model=str(assets / "model"), data=str(assets / "corpus.txt"), plan=_plan(), zeroshot_tasks=[],
                     grouping={"n_bootstrap": 50}, calib={"max_steps": 6, "val_every": 3, "patience": 10},
                     adapt={"steps": 3, "val_every": 3, "ckpt_every": 1}, **kw)


@pytest.fixture(scope="module")
def auto_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("auto")
    return out, run_seed(_cfg(assets), out, progress=False)


def test_auto_converts_exactly_k_layers(auto_run):
    out, metrics = auto_run
    saved = json.loads((out / "metrics.json").read_text())
    sel = saved["selection"]
    assert len(saved["converted_layers"]) == K and saved["converted_layers"] == sel["chosen"]
    assert sel["candidates"] == [0, 1, 2, 3] and sel["paper_layers"] == [1, 2]
    # the chosen layers are the K best by the recorded criterion
    scores = {int(i): v for i, v in sel["scores"]["fidelity"].items()}
    assert sel["chosen"] == sorted(sorted(scores, key=lambda i: (scores[i], i))[:K])
    assert set(sel["scores"]["probe"]) == {"0", "1", "2", "3"}
    assert [p["k"] for p in sel["curves"]["criterion"]] == [1, 2, 3, 4]
    assert [p["layers"] for p in sel["curves"]["paper"]] == [[1], [1, 2]]
    # where a run keeps its kernels: the chosen layers only; every candidate under candidates/
    for m, sub in (("oal", ""), ("global", "kernels/global")):
        chosen, _ = load_kernels(out / sub)
        every, _ = load_kernels(out / "candidates" / sub)
        assert sorted(chosen) == sel["chosen"] and sorted(every) == [0, 1, 2, 3], m
        for i in sel["chosen"]:
            for (name, a), b in zip(chosen[i].state_dict().items(), every[i].state_dict().values(), strict=True):
                assert torch.equal(a, b), (m, i, name)
    # fidelity and perplexity describe the converted layers
    assert sorted(int(i) for i in saved["fidelity"]["oal"]["per_layer"]) == sel["chosen"]
    assert saved["perplexity"]["oal"] > 1 and saved["perplexity_no_adapt"]["oal"] > 1
    comp = sel["comparison"]
    assert comp["fidelity_top2"]["ppl"] == saved["perplexity"]["oal"]  # the converted arm itself
    assert comp["paper_range"]["layers"] == [1, 2] and comp["paper_range"]["ppl"] > 1
    report = (out / "report.md").read_text()
    assert "## Layer selection" in report and (out / "figures" / "layer_selection.png").stat().st_size > 0


def test_auto_resumes_after_a_kill(assets, auto_run, tmp_path):
    out = tmp_path / "killed"
    assert run_seed(_cfg(assets), out, progress=False, stop_after="select") == {}
    assert json.loads((out / "selection.json").read_text())["chosen"] == auto_run[1]["converted_layers"]
    resumed = run_seed(_cfg(assets), out, progress=False)
    drop = ("elapsed_s",)
    assert {k: v for k, v in resumed.items() if k not in drop} == \
        {k: v for k, v in auto_run[1].items() if k not in drop}


def test_force_deletes_the_selection_too(auto_run, tmp_path):
    """`--force` left selection.json and candidates/ (the report reads candidates/calibration.json)."""
    import shutil

    from oal.rundir.claim import clear_run
    from oal.rundir.lock import LOCK_FILE

    out = tmp_path / "run"
    shutil.copytree(auto_run[0], out)
    assert {"selection.json", "candidates"} <= {p.name for p in out.iterdir()}
    clear_run(out)
    assert [p.name for p in out.iterdir() if p.name != LOCK_FILE] == []


def test_select_layers_command_then_run_continues(assets, auto_run, tmp_path):
    from oal.cli import load_commands

    out = tmp_path / "sel"
    args = ["select-layers", "--out", str(out), "--k", str(K), "--model", str(assets / "model"), "--data",
            str(assets / "corpus.txt"), "--no-progress"]
    res = CliRunner().invoke(load_commands(), [*args, "--by", "nonsense"])
    assert res.exit_code == 2 and "--by" in res.output
    sel = run_selection(_cfg(assets), out, progress=False)
    assert sel["chosen"] == auto_run[1]["converted_layers"]
    assert not (out / "metrics.json").exists()  # the selection only; `oal run` continues from it
    metrics = run_seed(_cfg(assets), out, progress=False)
    assert metrics["converted_layers"] == sel["chosen"]


def test_auto_k_larger_than_the_model_is_refused(assets, tmp_path):
    from oal.errors import InputError

    with pytest.raises(InputError, match="auto:K with K <= 4"):
        run_seed(_cfg(assets, select={"k": 5}), tmp_path / "big", progress=False)
    with pytest.raises(ValueError, match="select"):
        _cfg(assets, select={"k": 1, "by": "vibes"})


def test_passkey_on_a_run_directory(auto_run, tmp_path, monkeypatch):
    import shutil

    import oal.evaluate.passkey as passkey
    from oal.pipeline.evaluate_passkey import evaluate_passkey_run

    out = tmp_path / "run"
    shutil.copytree(auto_run[0], out)
    settings = {"lengths": [300, 400], "depths": [0.0, 1.0], "trials": 1}
    calls = []
    real = passkey.evaluate_passkey

    def counted(*a, **kw):
        calls.append(kw["description"])
        if len(calls) == 3:
            raise KeyboardInterrupt  # killed during the third arm
        return real(*a, **kw)

    monkeypatch.setattr(passkey, "evaluate_passkey", counted)
    with pytest.raises(KeyboardInterrupt):
        evaluate_passkey_run(out, ["softmax", "oal", "global"], progress=False, **settings)
    monkeypatch.setattr(passkey, "evaluate_passkey", lambda *a, **kw: calls.append(kw["description"]) or real(*a, **kw))
    res = evaluate_passkey_run(out, ["softmax", "oal", "global"], progress=False, **settings)
    # the two finished arms were not measured again
    assert calls[3:] == ["passkey:oal (no_adapt)", "passkey:oal (adapted)", "passkey:global (no_adapt)",
                         "passkey:global (adapted)"]
    saved = json.loads((out / "metrics.json").read_text())["passkey"]
    for m in ("softmax", "oal", "global"):
        assert set(saved[m]) == {"no_adapt", "adapted"}, m
        for r in saved[m].values():
            assert r["lengths"] == [300, 400] and set(r["accuracy"]["300"]) == {"0", "1"}
            assert 0.0 <= r["mean"] <= 1.0
    assert saved == json.loads(json.dumps(res))
    report = (out / "report.md").read_text()
    assert "## Passkey retrieval" in report and (out / "figures" / "passkey.png").stat().st_size > 0
    calls.clear()  # another decoding (plain greedy since 2026-12-07): every arm is measured again
    monkeypatch.setattr(passkey, "DECODING_VERSION", passkey.DECODING_VERSION + 1)
    evaluate_passkey_run(out, ["softmax"], progress=False, **settings)
    assert calls == ["passkey:softmax (no_adapt)", "passkey:softmax (adapted)"]


def test_passkey_command(auto_run, tmp_path):
    import shutil

    from oal.cli import load_commands

    out = tmp_path / "run"
    shutil.copytree(auto_run[0], out)
    app = load_commands()
    res = CliRunner().invoke(app, ["evaluate", "--out", str(out), "--passkey", "--lengths", "300", "--depths",
                                   "0.5", "--trials", "1", "--no-adapter"])
    assert res.exit_code == 0, res.output
    saved = json.loads((out / "metrics.json").read_text())["passkey"]
    assert set(saved) == {"oal", "global", "softmax"} and all(set(v) == {"no_adapt"} for v in saved.values())
    bad = CliRunner().invoke(app, ["evaluate", "--out", str(out), "--passkey", "--lengths", "3x"])
    assert bad.exit_code == 2 and "--lengths" in bad.output
    short = CliRunner().invoke(app, ["evaluate", "--out", str(out), "--passkey", "--lengths", "40"])
    assert short.exit_code == 2 and "cannot hold" in short.output


def test_the_comparison_adapts_a_baseline_from_its_initial_values(assets, tmp_path, monkeypatch):
    """`--layers auto:K` with a baseline: each compared layer set starts LoRA where the baseline's own arm does
    (App. F.1: DiJiang's theta at 0, not calibrated), after its frozen perplexity on the calibrated kernels. The
    comparison started from the calibrated values."""
    from oal.pipeline import decoder
    from oal.pipeline.config import parse_methods

    starts, real_adapt = {}, decoder.adapt

    def recording_adapt(model, *args, description="", **kwargs):
        starts[description] = [p.detach().clone() for n, p in model.named_parameters() if n.endswith("theta")]
        return real_adapt(model, *args, description=description, **kwargs)

    monkeypatch.setattr(decoder, "adapt", recording_adapt)
    run_seed(_cfg(assets, methods=parse_methods("dijiang")), tmp_path / "run", progress=False)
    compared = {d: t for d, t in starts.items() if d.startswith("adapt dijiang ")}
    assert compared and starts["adapt dijiang"]  # the arm itself, and at least one other layer set
    for description, thetas in [*compared.items(), ("adapt dijiang", starts["adapt dijiang"])]:
        assert thetas and all(torch.equal(t, torch.zeros_like(t)) for t in thetas), description


def test_another_k_or_criterion_reuses_the_calibration_and_scores(assets, auto_run, tmp_path, monkeypatch):
    """`oal select-layers --k 3` after a finished `--k 2` run was refused (another configuration), and `--force`
    recalibrated every layer. Now calibration and the scores are reused; what reads the chosen layers is redone."""
    import shutil

    from rich.console import Console

    from oal.pipeline import decoder
    from oal.pipeline.publish import check_publishable
    from oal.pipeline.runs import run

    out = tmp_path / "run"
    shutil.copytree(auto_run[0], out)
    scored = []
    monkeypatch.setattr(decoder, "calibrate_layers", lambda *a, **kw: pytest.fail("recalibrated"))
    monkeypatch.setattr(decoder, "score_layers", lambda *a, **kw: scored.append(1) or pytest.fail("rescored"),
                        raising=False)  # (older code scored inside select_layers)
    sel = run_selection(_cfg(assets, select={"k": 3, "by": "fidelity"}), out, progress=False)
    assert len(sel["chosen"]) == 3 and sel["k"] == 3 and scored == []
    assert sorted(load_kernels(out)[0]) == sel["chosen"]
    # metrics.json and report.md no longer quote the arms of the K = 2 kernels
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["converted_layers"] == sel["chosen"] and saved["selection"]["chosen"] == sel["chosen"]
    assert "oal" not in saved["perplexity"] and "softmax" in saved["perplexity"] and not saved["fidelity"]
    # `oal run` with another K and criterion continues: the chosen layers' stages redone, the rest reused
    adapted, real_adapt = [], decoder.adapt
    monkeypatch.setattr(decoder, "adapt", lambda *a, **kw: adapted.append(kw["description"]) or real_adapt(*a, **kw))
    metrics = run(_cfg(assets, select={"k": 3, "by": "probe"}), out, progress=False, console=Console(quiet=True),
                  results=Console(quiet=True))
    chosen = json.loads((out / "selection.json").read_text())["chosen"]
    assert metrics["converted_layers"] == chosen == sorted(metrics["selection"]["order"]["probe"][:3])
    assert sorted(int(i) for i in metrics["fidelity"]["oal"]["per_layer"]) == chosen
    assert metrics["perplexity"]["oal"] > 1 and set(metrics["selection"]["comparison"]) == {"probe_top2",
                                                                                            "paper_range"}
    # the paper's range was compared under K = 2 already: its adaptation is reused, the new top-2 is adapted
    assert sel["paper_layers"] != chosen and "adapt oal paper_range" not in adapted
    assert "adapt oal probe_top2" in adapted
    check_publishable(out)  # every record verifies: nothing describes the old selection's files
    assert json.loads((out / "config.json").read_text())["converted_layers"]["by"] == "probe"
