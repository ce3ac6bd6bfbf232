"""Audit of zero-shot scoring and lm-eval on an export, as a user meets them: offline messages say how to fetch the
data, lm-eval's hf options that would end in a traceback are one line, and `oal evaluate --zeroshot` on some
methods never puts numbers of different data under one column."""

from __future__ import annotations

import json
import shutil

import pytest
from test_pipeline import assets  # noqa: F401  (the tiny model + corpus fixture)
from test_zeroshot_pipeline import LIMIT, TASK_FILES, _offline, zs_run  # noqa: F401
from typer.testing import CliRunner

from oal.cli import load_commands
from oal.data.zeroshot import SOURCES, skip_lines
from oal.evaluate.zeroshot import load_tasks


def test_offline_skip_names_the_hf_download_command(tmp_path, monkeypatch):
    """Offline with nothing cached, a skipped task said what was missing but not how to fetch it; now the record
    and the printed lines carry the `hf download` command of its pinned file (as WikiText's error does)."""
    _offline(monkeypatch, tmp_path)
    _, skipped = load_tasks(["piqa", "arc_easy"])
    for task in ("piqa", "arc_easy"):
        spec = SOURCES[task]
        command = (f"hf download {spec.dataset_id} --repo-type dataset --revision {spec.revision} "
                   f"--include '{spec.file}'")
        assert command in skipped[task]
        assert sum(line.strip() == command for line in skip_lines(skipped)) == 1


def test_lm_eval_offline_dataset_error_says_how_to_get_the_data(tmp_path, monkeypatch, capsys):
    """lm-eval's stock tasks read their data with `datasets`; offline without it cached, the one line named the
    dataset only. It now says to run the command once with the hub reachable or to give local files."""
    import datasets
    from lm_eval import __main__ as lm_main

    from oal import lm_eval as entry

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(lm_main, "cli_evaluate",
                        lambda: datasets.load_dataset("baber/piqa", cache_dir=str(tmp_path / "datasets")))
    with pytest.raises(SystemExit) as exc:
        entry.main(["--model", "hf", "--model_args", "pretrained=x", "--tasks", "x", "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert "baber/piqa" in err and "where the hub is reachable" in err and "--include_path" in err


@pytest.mark.parametrize("argv, words", [
    (["--model_args", "dtype=float32"], ["--model_args", "pretrained="]),
    (["--model_args", "pretrained=x,dtype=float33"], ["dtype=float33", "not a torch dtype"]),
    (["--model_args", "pretrained=x", "--device", "cuda:99"], ["--device cuda:99", "GPU"]),
    (["--model_args", "pretrained=x", "--device", "gpu"], ["--device gpu", "not a torch device"]),
])
def test_hf_options_that_lm_eval_meets_with_a_traceback_are_one_line(argv, words, capsys):
    """Each of these ended in lm-eval's TypeError, AttributeError or AssertionError traceback (checked before any
    model loads: lm-eval itself is never reached)."""
    from oal import lm_eval as entry

    with pytest.raises(SystemExit) as exc:
        entry.main(["--model", "hf", "--tasks", "piqa", *argv])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err.startswith("Error:") and len(err.splitlines()) == 1, err
    assert all(w in err for w in words), err


def test_space_separated_model_args_are_read_as_lm_eval_reads_them(tmp_path):
    """lm-eval takes `--model_args k=v k2=v2` (several words); the checks read every word, so a `pretrained=` after
    another key is seen (not "name the model") and a missing folder there is still refused."""
    from oal.lm_eval import _check_pretrained

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"model_type": "llama"}))
    _check_pretrained(["--model", "hf", "--model_args", "dtype=float32", f"pretrained={base}", "--tasks", "piqa"])
    with pytest.raises(ValueError, match="no such folder"):
        _check_pretrained(["--model_args", "dtype=float32", f"pretrained={tmp_path / 'gone'}", "--tasks", "piqa"])


def test_scoring_some_methods_on_other_data_is_refused(zs_run, tmp_path):  # noqa: F811
    """metrics.json keeps one data record per task and the report one column: `oal evaluate --zeroshot --methods
    softmax --limit 3` on a run whose oal was scored on 4 examples wrote softmax's 3-example numbers beside oal's 4,
    and zeroshot_data said every method had the 3. It is refused (nothing written); the same data is scored."""
    out, metrics = zs_run
    run = tmp_path / "run"
    shutil.copytree(out, run)
    before = (run / "metrics.json").read_text()
    files = ["--task-file", f"piqa={TASK_FILES['piqa']}"]  # a file of a task outside --tasks is refused
    app, wide = load_commands(), CliRunner(env={"COLUMNS": "400"})
    args = ["evaluate", "--out", str(run), "--zeroshot", "--tasks", "piqa", "--methods", "softmax", *files]
    res = wide.invoke(app, [*args, "--limit", str(LIMIT - 1)])
    assert res.exit_code == 2 and "Invalid value for '--methods'" in res.output and "oal" in res.output, res.output
    assert (run / "metrics.json").read_text() == before
    res = wide.invoke(app, [*args, "--limit", str(LIMIT)])
    assert res.exit_code == 0, res.output
    assert json.loads((run / "metrics.json").read_text())["zeroshot"] == metrics["zeroshot"]
