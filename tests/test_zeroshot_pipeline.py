"""The zeroshot:<method> stage of `oal run` and `oal evaluate --zeroshot` on the fixtures: metrics, report,
resume, agreement between the two, and the offline path (skipped with one line, reported as missing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_pipeline import _cfg, assets  # noqa: F401  (the tiny model + corpus fixture)
from typer.testing import CliRunner

from oal.cli import load_commands
from oal.evaluate.zeroshot import evaluate_tasks, load_tasks
from oal.pipeline.decoder import Run
from oal.pipeline.runs import run_seed
from oal.rundir.hashes import sha256_file

FIXTURES = Path(__file__).parent / "fixtures" / "zeroshot"
TASK_FILES = {t: str(FIXTURES / f"{t}.jsonl") for t in ("piqa", "hellaswag", "arc_easy")}
LIMIT = 4


def _zs_cfg(assets, **kw):  # noqa: F811
    return _cfg(assets, **{"methods": ["oal", "softmax"], "zeroshot_tasks": None, "zeroshot_files": TASK_FILES,
                           "zeroshot_limit": LIMIT, **kw})


@pytest.fixture(scope="module")
def zs_run(assets, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("zs_run")
    return out, run_seed(_zs_cfg(assets), out, progress=False)


def _offline(monkeypatch, tmp_path):
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))


def test_stage_writes_table3_columns(zs_run, assets):  # noqa: F811
    out, metrics = zs_run
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["zeroshot"] == metrics["zeroshot"]
    for m in ("oal", "softmax"):
        for t in TASK_FILES:
            row = saved["zeroshot"][m][t]
            assert set(row) == {"acc", "acc_norm", "acc_norm_lmeval", "n"} and row["n"] == LIMIT
            assert all(0 <= row[k] <= 100 for k in ("acc", "acc_norm", "acc_norm_lmeval"))
        assert f"zeroshot:{m}" in saved["elapsed_s"]
    for t, path in TASK_FILES.items():
        prov = saved["zeroshot_data"][t]
        assert prov["source"] == "task_file" and prov["sha256"] == sha256_file(path) and prov["limit"] == LIMIT
    assert "zeroshot_skipped" not in saved
    # the numbers are those of the selected adapted checkpoint rebuilt from the run's files
    r = Run(_zs_cfg(assets), out, progress=False)
    r.setup()
    from oal.adaptation.adapter import load_adapter

    sets, _ = load_tasks(None, task_files=TASK_FILES, limit=LIMIT)
    for m in ("oal", "softmax"):
        model = load_adapter(r.model_for(m), out / "adapter" / m)
        assert evaluate_tasks(model, r.tokenizer, sets) == saved["zeroshot"][m]
    text = (out / "report.md").read_text()
    assert "## Zero-shot accuracy (paper Table 3 columns" in text
    assert "| Method | PPL (LoRA) | PIQA | HellaSwag | ARC-E |" in text
    section = text[text.index("## Zero-shot accuracy"):]
    oal_row = next(line for line in section.splitlines() if line.startswith("| OAL | "))
    assert f"{saved['zeroshot']['oal']['piqa']['acc_norm']:.2f}" in oal_row
    assert "**Quick run**" in section and "unverified" in section and "acc_norm (lm-eval)" in section


def test_stage_resumes_and_reruns_only_on_change(zs_run, assets, tmp_path):  # noqa: F811
    import shutil

    out, metrics = zs_run
    out = shutil.copytree(out, tmp_path / "run")  # the shared run stays as `oal run` left it

    def stages(cfg):
        r = Run(cfg, out, progress=False)
        r.setup()
        r.zeroshot_sets()
        for step in (r.analyze, r.calibrate, r.fidelity):
            step()
        for m in cfg.methods:
            r.perplexity(m, adapted=False)
            r.adapt(m)
            r.perplexity(m, adapted=True)
            r.zeroshot(m)
        return r

    r = stages(_zs_cfg(assets))
    assert {"zeroshot:oal", "zeroshot:softmax"} <= set(r.skipped) and not r.ran
    assert r.metrics()["zeroshot"] == metrics["zeroshot"]
    r = stages(_zs_cfg(assets, zeroshot_limit=LIMIT - 1))  # other data: zero-shot only is redone
    assert set(r.ran) == {"zeroshot:oal", "zeroshot:softmax"}
    assert all(row["n"] == LIMIT - 1 for row in r.metrics()["zeroshot"]["oal"].values())
    import oal.pipeline.decoder as decoder

    decoder.SCORING_VERSION += 1  # another scorer (the tokenization of 2026-12-07): zero-shot only is redone
    try:
        r = stages(_zs_cfg(assets, zeroshot_limit=LIMIT - 1))
    finally:
        decoder.SCORING_VERSION -= 1
    assert set(r.ran) == {"zeroshot:oal", "zeroshot:softmax"}


def test_cli_evaluate_zeroshot_matches_the_stage(zs_run, tmp_path):
    import shutil

    out, metrics = zs_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    app = load_commands()
    args = ["evaluate", "--out", str(run), "--methods", "oal,softmax", "--zeroshot", "--limit", str(LIMIT)]
    res = CliRunner().invoke(app, args + [a for t, p in TASK_FILES.items() for a in ("--task-file", f"{t}={p}")])
    assert res.exit_code == 0, res.output
    assert json.loads((run / "metrics.json").read_text())["zeroshot"] == metrics["zeroshot"]
    wide = CliRunner(env={"COLUMNS": "400"})
    res = wide.invoke(app, args + ["--task-file", "piqa"])
    assert res.exit_code == 2 and "TASK=PATH" in res.output
    res = wide.invoke(app, args + ["--tasks", "piqa,mmlu"])
    assert res.exit_code == 2 and "unknown task 'mmlu'" in res.output
    res = wide.invoke(load_commands(), ["run", "--out", str(tmp_path / "x"), "--limit", "0"])
    assert res.exit_code == 2 and "Invalid value for '--limit': expected a positive number" in res.output
    res = wide.invoke(load_commands(), ["run", "--out", str(tmp_path / "x"), "--zeroshot-dir", str(tmp_path / "no")])
    assert res.exit_code == 2 and "Invalid value for '--zeroshot-dir': no such folder" in res.output
    res = wide.invoke(load_commands(), ["run", "--out", str(tmp_path / "x"), "--methods", " "])
    assert res.exit_code == 2 and "Invalid value for '--methods': expected a comma-separated" in res.output
    from oal.pipeline.config import RunConfig

    assert RunConfig.from_preset("default").zeroshot_limit == 100  # a quick run within the default budget
    assert RunConfig.from_preset("qwen2.5-0.5b").zeroshot_limit is None  # the paper presets: the full sets


def test_evaluate_scores_of_an_older_scorer_or_superseded_by_the_run_are_not_published(
        zs_run, assets, tmp_path, monkeypatch):  # noqa: F811
    """`oal evaluate --zeroshot` scores won over the run's own for ever: after a scorer change (SCORING_VERSION, the
    tokenization of 2026-12-07) and after `oal run` had scored the method again on other data."""
    import shutil

    import oal.pipeline.base as base
    from oal.pipeline.publish import republish

    out, metrics = zs_run
    run = shutil.copytree(out, tmp_path / "run")
    args = ["evaluate", "--out", str(run), "--methods", "oal,softmax", "--zeroshot", "--limit", str(LIMIT - 2)]
    res = CliRunner().invoke(load_commands(), args + [a for t, p in TASK_FILES.items()
                                                      for a in ("--task-file", f"{t}={p}")])
    assert res.exit_code == 0, res.output
    assert json.loads((run / "metrics.json").read_text())["zeroshot"]["oal"]["piqa"]["n"] == LIMIT - 2
    # a newer scorer: the records of the old one are left out, the run's own (rescored by its stage) stay
    monkeypatch.setitem(base.EVALUATION_VERSIONS, "zeroshot:", {"zeroshot_scoring": -1})
    assert republish(run)["zeroshot"] == metrics["zeroshot"]
    monkeypatch.undo()
    assert republish(run)["zeroshot"]["oal"]["piqa"]["n"] == LIMIT - 2
    # the run scores oal again on other data: its numbers, not the older evaluation's
    r = Run(_zs_cfg(assets, zeroshot_limit=LIMIT - 1), run, progress=False)
    r.setup()
    r.zeroshot("oal")
    published = republish(run)["zeroshot"]
    assert all(row["n"] == LIMIT - 1 for row in published["oal"].values())
    assert all(row["n"] == LIMIT - 2 for row in published["softmax"].values())  # not scored again: still evaluate's


def test_cli_evaluate_offline_without_data(zs_run, tmp_path, monkeypatch):
    _offline(monkeypatch, tmp_path)
    out, _ = zs_run
    run = tmp_path / "run"
    run.mkdir()
    res = CliRunner(env={"COLUMNS": "400"}).invoke(load_commands(), ["evaluate", "--out", str(run), "--methods",
                                                                    "softmax", "--zeroshot", "--tasks", "piqa"])
    assert res.exit_code == 1 and "Traceback" not in res.output
    assert "skip zero-shot piqa: no lighteval/piqa@41782e6b (offline" in res.output
    assert "--task-file TASK=" in res.output
    assert "piqa" in json.loads((run / "metrics.json").read_text())["zeroshot_skipped"]


def test_offline_run_skips_zeroshot_and_reports_missing_columns(assets, tmp_path, monkeypatch, capsys):  # noqa: F811
    _offline(monkeypatch, tmp_path)
    from rich.console import Console

    metrics = run_seed(_cfg(assets, methods=["softmax"], zeroshot_tasks=None), tmp_path / "run",
                       console=Console(width=400), progress=False)
    assert "zeroshot" not in metrics and set(metrics["zeroshot_skipped"]) == set(TASK_FILES)
    out = capsys.readouterr().out.splitlines()
    lines = [ln for ln in out if ln.startswith("skip zero-shot")]  # a short line each, how to provide them once
    assert len(lines) == 3 and all(len(ln) <= 80 and "--zeroshot-dir" not in ln for ln in lines)
    assert sum("--zeroshot-dir" in ln for ln in out) == 1
    assert all("--task-file " + t in metrics["zeroshot_skipped"][t] for t in TASK_FILES)  # the record keeps all
    text = (tmp_path / "run" / "report.md").read_text()
    assert "PIQA, HellaSwag and ARC-E columns are missing" in text and "offline" in text
    assert metrics["perplexity"]["softmax"] > 1  # the rest of the run is unaffected


def test_cli_evaluate_log_samples_writes_per_example_loglikelihoods(zs_run, tmp_path):
    import shutil

    from oal.artefact.arms import arm_inputs, load_arm
    from oal.evaluate.zeroshot import load_task, score_examples

    out, metrics = zs_run
    run = Path(shutil.copytree(out, tmp_path / "run"))
    args = ["evaluate", "--out", str(run), "--methods", "oal", "--zeroshot", "--limit", str(LIMIT), "--log-samples"]
    res = CliRunner().invoke(load_commands(), args + [a for t, p in TASK_FILES.items()
                                                      for a in ("--task-file", f"{t}={p}")])
    assert res.exit_code == 0, res.output
    saved = json.loads((run / "zeroshot_samples" / "oal.json").read_text())
    model, tok, info = load_arm(run, "oal")
    assert saved["method"] == "oal" and saved["inputs"] == arm_inputs(run, "oal", info["adapter"])
    assert set(saved["tasks"]) == set(TASK_FILES) and saved["data"]["piqa"]["sha256"] == sha256_file(TASK_FILES["piqa"])
    for task, records in saved["tasks"].items():
        examples, _ = load_task(task, task_file=TASK_FILES[task], limit=LIMIT)
        assert [r["doc_id"] for r in records] == list(range(LIMIT))
        assert [r["loglikelihoods"] for r in records] == [[ll for ll, _ in sc] for sc in score_examples(model, tok,
                                                                                                        examples)]
        assert [r["label"] for r in records] == [ex.label for ex in examples]
        row = metrics["zeroshot"]["oal"][task]  # the logged predictions give the recorded accuracies
        assert 100 * sum(r["pred"] == r["label"] for r in records) / LIMIT == pytest.approx(row["acc"])
        assert 100 * sum(r["pred_norm"] == r["label"] for r in records) / LIMIT == pytest.approx(row["acc_norm"])
    res = CliRunner(env={"COLUMNS": "400"}).invoke(load_commands(), ["evaluate", "--out", str(run), "--log-samples"])
    assert res.exit_code == 2 and "--log-samples" in res.output and "applies only to --zeroshot" in res.output
