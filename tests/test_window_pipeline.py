"""`oal run` / `oal adapt` with the sliding windows on the tiny model of test_pipeline (issue 29): --window and
--sinks recorded in config.json and in every kernel file, groups analysed for oal-swa alone, each arm calibrated,
adapted and measured, the report's names and settings; `oal adapt --window` recalibrates and drops the stale arms."""

import json
import math
import shutil

import pytest
import torch
from test_pipeline import _cfg, assets  # noqa: F401  (the tiny model + corpus fixture)
from typer.testing import CliRunner

from oal.pipeline.runs import run_seed

WINDOWS = ("swa", "oal-swa", "global-swa")


@pytest.fixture(scope="module")
def window_run(assets, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("window-run")
    cfg = _cfg(assets, methods=[*WINDOWS, "softmax"], window=16, sinks=2)  # blocks of 64 tokens: W < N
    return out, run_seed(cfg, out, progress=False)


def _init(out, method):
    return json.loads((out / "kernels" / method / "kernels.json").read_text())["layers"]["1"]["init"]


def test_every_window_arm_is_calibrated_adapted_and_measured(window_run):
    out, metrics = window_run
    assert (out / "groups.json").is_file()  # oal-swa needs the stable-gap groups even without an oal arm
    config = json.loads((out / "config.json").read_text())["config"]
    assert (config["window"], config["sinks"]) == (16, 2)
    assert set(metrics["perplexity"]) == set(metrics["perplexity_no_adapt"]) == {*WINDOWS, "softmax"}
    assert all(math.isfinite(p) for p in metrics["perplexity"].values())
    assert set(metrics["fidelity"]) == set(WINDOWS)
    assert _init(out, "swa") == {"window": 16, "sinks": 2}
    assert all(_init(out, m)["window"] == 16 and _init(out, m)["sinks"] == 2 for m in ("oal-swa", "global-swa"))
    calib = json.loads((out / "calibration.json").read_text())["methods"]
    assert {h["init"] for h in calib["oal-swa"]["1"]["heads"]} <= {"global_embedded", "taylor", "global_perturbed"}
    assert metrics["adapt"]["swa"]["n_kernel_params"] == 0  # LoRA only, like the softmax arm
    for m in ("oal-swa", "global-swa"):  # the kernel on the older keys adapts jointly with LoRA
        assert metrics["adapt"][m]["n_kernel_params"] > 0 and metrics["adapt"][m]["kernel_change"] > 0
    # a 16-key window over 64-token blocks is not softmax: the unadapted perplexities differ
    assert metrics["perplexity_no_adapt"]["swa"] != metrics["perplexity_no_adapt"]["softmax"]
    report = (out / "report.md").read_text()
    for name in ("| Sliding window (SWA) |", "| Window + OAL (hybrid) |", "| Window + learned global |"):
        assert name in report
    assert "the last W = 16 keys and the first S = 2 keys (sinks) exact" in report


def test_cli_adapt_with_another_window_recalibrates(window_run, tmp_path):
    from oal.cli import load_commands

    out, metrics = window_run
    shutil.copytree(out, tmp_path / "run")
    res = CliRunner().invoke(load_commands(), ["adapt", "--out", str(tmp_path / "run"), "--method", "swa",
                                               "--window", "8", "--steps", "2", "--no-progress"])
    assert res.exit_code == 0, res.output
    config = json.loads((tmp_path / "run" / "config.json").read_text())["config"]
    assert (config["window"], config["sinks"]) == (8, 2)
    assert _init(tmp_path / "run", "swa") == {"window": 8, "sinks": 2}
    assert _init(tmp_path / "run", "oal-swa")["window"] == 8  # the whole run's windows changed, so it recalibrated
    new = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert set(new["perplexity"]) == {"swa", "softmax"}  # the other window arms were made with W = 16: not reported
    assert new["perplexity"]["softmax"] == metrics["perplexity"]["softmax"]
    assert new["perplexity_no_adapt"]["swa"] != metrics["perplexity_no_adapt"]["swa"]


def test_cli_convert_export_generate_and_evaluate_a_window_arm(window_run, tmp_path):
    """The later stages on the run's own arms through the CLI: `oal convert --export` of the hybrid (reloaded by
    oal.load with the run's window and the adapted model's logits), `oal generate` with swa, `oal evaluate` of the
    three windows' fidelity."""
    import oal
    from oal.artefact.arms import load_converted
    from oal.cli import load_commands
    from oal.models.attention import converted_methods

    out, _ = window_run
    shutil.copytree(out, tmp_path / "run")
    run = tmp_path / "run"

    def cli(*args):
        return CliRunner(env={"COLUMNS": "200"}).invoke(load_commands(), [str(x) for x in args])

    res = cli("convert", "--out", run, "--method", "oal-swa", "--export", tmp_path / "export")
    assert res.exit_code == 0, res.output
    assert "oal-swa" in res.output and "adapted" in res.output
    reloaded, (adapted, _, _) = oal.load(tmp_path / "export"), load_converted(run, "oal-swa")
    got = converted_methods(reloaded)
    assert got and all(m.name == "oal-swa" and m.window == 16 for m in got.values())
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        assert (reloaded(ids).logits - adapted(ids).logits).abs().max() < 1e-4  # merged LoRA only rounds

    res = cli("generate", "the cat", "--out", run, "--method", "swa", "--max-new-tokens", "4")
    assert res.exit_code == 0 and "\nthe cat" in "\n" + res.output, res.output  # after the log line
    res = cli("evaluate", "--out", run, "--methods", ",".join(WINDOWS), "--blocks", "1", "--no-adapter")
    assert res.exit_code == 0, res.output
    fid = json.loads((run / "metrics.json").read_text())["fidelity"]
    for m in WINDOWS:
        assert fid[m]["relmse"] > 0 and math.isfinite(fid[m]["relmse"]), m


def test_cli_refuses_a_bad_window(tmp_path):
    from oal.cli import load_commands

    res = CliRunner().invoke(load_commands(), ["run", "--out", str(tmp_path), "--methods", "swa", "--window", "0"])
    assert res.exit_code == 2 and "--window" in res.output
    res = CliRunner().invoke(load_commands(), ["run", "--help"], env={"COLUMNS": "200"})
    assert "--window" in res.output and "--sinks" in res.output


@pytest.mark.parametrize(("window", "sinks", "option"), [(64, 0, "--window"), (100, 4, "--window"), (62, 2, "--sinks")])
def test_a_window_that_covers_every_block_is_refused(assets, tmp_path, window, sinks, option):  # noqa: F811
    """The run's blocks have 64 tokens: a window of 64 (or window + sinks of 64) makes the window arms plain softmax."""
    from oal.errors import InputError

    with pytest.raises(InputError, match="would be plain softmax") as exc:
        run_seed(_cfg(assets, methods=["swa", "oal-swa"], window=window, sinks=sinks), tmp_path / "run",
                 progress=False)
    assert exc.value.param == option and not (tmp_path / "run" / "config.json").exists()


def test_encoder_runs_refuse_the_windows(tmp_path):
    from _tiny_encoders import save_tiny_encoder

    from oal.cli import load_commands

    save_tiny_encoder(tmp_path / "bert", ["alpha", "beta", "gamma"])
    (tmp_path / "corpus.txt").write_text("alpha beta gamma.\n\nbeta gamma alpha.")
    res = CliRunner(env={"COLUMNS": "400"}).invoke(load_commands(), [
        "run", "--model", str(tmp_path / "bert"), "--data", str(tmp_path / "corpus.txt"), "--methods", "oal,oal-swa",
        "--out", str(tmp_path / "run")])
    assert res.exit_code == 2 and "Error" in res.output and "the sliding windows" in res.output
    assert not (tmp_path / "run" / "config.json").exists()
