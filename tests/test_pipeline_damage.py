"""A damaged JSON record of a run directory (valid JSON of the wrong shape: `[1]` for an object) is one line naming
the file, never a traceback: the commands that read config.json, the report's readers, the passkey cache, and what
`oal diagnose` takes from a run."""

import json
import shutil

import pytest
from test_pipeline import _cfg, make_assets
from typer.testing import CliRunner

from oal.pipeline.config import parse_methods
from oal.pipeline.runs import run_seed


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    # 512 positions hold a passkey prompt in byte tokens
    assets = make_assets(tmp_path_factory.mktemp("assets"), n_layers=2, max_positions=512)
    out = tmp_path_factory.mktemp("run")
    run_seed(_cfg(assets, methods=parse_methods("oal,softmax"), layers=[1]), out, progress=False)
    return assets, out


@pytest.fixture
def damaged(finished, tmp_path):
    """A copy of the finished run with `name` replaced by `[1]`."""

    def make(name: str):
        out = tmp_path / "run"
        shutil.copytree(finished[1], out)
        (out / name).write_text("[1]")
        return out

    return make


def _one_line_error(res, name: str) -> None:
    assert res.exit_code == 2, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines[-1].startswith("Error:") and name in lines[-1] and "Traceback" not in res.output, res.output


@pytest.mark.parametrize("args", [["evaluate"], ["evaluate", "--passkey", "--lengths", "300", "--trials", "1"],
                                  ["evaluate", "--zeroshot"], ["adapt", "--method", "oal"],
                                  ["export", "--method", "oal", "--to", "EXPORT"], ["generate", "hello"]])
def test_a_damaged_config_is_one_line_for_every_command(damaged, args, tmp_path):
    """`oal evaluate` without --methods read the run's methods from config.json: AttributeError on `[1]`."""
    from oal.cli import load_commands

    out = damaged("config.json")
    args = [str(tmp_path / "export") if a == "EXPORT" else a for a in args]
    res = CliRunner().invoke(load_commands(), [*args, "--out", str(out)])
    _one_line_error(res, "config.json")


def test_rerunning_over_a_damaged_config_is_refused(finished, damaged):
    from oal.errors import InputError

    out = damaged("config.json")
    with pytest.raises(InputError, match="config.json.*--force"):
        run_seed(_cfg(finished[0], methods=parse_methods("oal,softmax"), layers=[1]), out, progress=False)


@pytest.mark.parametrize("name", ["analysis.json", "calibration.json", "regime.json", "budget.json",
                                  "adapter/oal/adapt.json"])
def test_the_report_names_a_damaged_file(damaged, name):
    """The report read each of these as an object (`.get`, `[...]`): AttributeError or TypeError on `[1]`."""
    from oal.pipeline.report import write_report

    out = damaged(name)
    with pytest.raises(ValueError, match=f"{name}: expected a JSON object.*--force"):
        write_report(out)


def test_a_damaged_analysis_is_a_changed_stage_output(finished, damaged):
    """analysis.json (which the report reads) was not among the analyze stage's recorded outputs: `oal evaluate`
    measured first and failed at the report, and a rerun kept the damaged file."""
    from oal.pipeline.publish import check_publishable

    out = damaged("analysis.json")
    with pytest.raises(ValueError, match="analysis.json"):
        check_publishable(out)
    run_seed(_cfg(finished[0], methods=parse_methods("oal,softmax"), layers=[1]), out, progress=False)
    assert isinstance(json.loads((out / "analysis.json").read_text()), dict)
    check_publishable(out)


def test_a_damaged_passkey_result_is_measured_again(finished, tmp_path, caplog):
    from oal.pipeline.evaluate_passkey import evaluate_passkey_run

    out = tmp_path / "run"
    shutil.copytree(finished[1], out)
    kept = out / ".oal" / "passkey" / "softmax_no_adapt.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("[1]")
    res = evaluate_passkey_run(out, ["softmax"], lengths=[300], depths=[0.5], trials=1, adapter=False,
                               progress=False)
    assert 0.0 <= res["softmax"]["no_adapt"]["mean"] <= 1.0
    assert "softmax_no_adapt.json" in caplog.text and "measuring it again" in caplog.text
    assert isinstance(json.loads(kept.read_text()), dict)


def test_what_diagnose_reads_from_a_damaged_run(tmp_path):
    """`oal diagnose --out RUN` took a config.json of `[1]` for no run at all (and ran on the defaults for minutes),
    and raised AttributeError on a selection.json of `[1]`; the offset part did on analysis.json."""
    from oal.diagnostics.offset_part import representative_layer
    from oal.diagnostics.run_inputs import read_run

    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(ValueError, match="config.json.*--force"):
        read_run(tmp_path)
    config = {"config": {"model": "m"}, "split_plan": {}, "converted_layers": {"k": 2, "by": "probe"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "selection.json").write_text("[1]")
    with pytest.raises(ValueError, match="selection.json"):
        read_run(tmp_path)
    (tmp_path / "analysis.json").write_text("[1]")
    with pytest.raises(ValueError, match="analysis.json"):
        representative_layer(tmp_path, [0, 1])


def test_selection_records_are_checked(tmp_path):
    """selection.json's "chosen", "method" and the comparison's fields, read as given (`sel["chosen"]`)."""
    from oal.pipeline.records import selection_record

    path = tmp_path / "selection.json"
    good = {"chosen": [1], "candidates": [0, 1], "paper_layers": [1], "paper_k": 1, "method": "oal", "by": "probe",
            "order": {"probe": [1, 0]}}
    path.write_text(json.dumps(good))
    assert selection_record(path) == good
    for bad in ([1], {**good, "chosen": "1"}, {**good, "method": 3}, {**good, "order": {}}, {**good, "paper_k": None}):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match="selection.json.*--force"):
            selection_record(path)
