"""The stage commands with one another: `oal select-layers` records what `oal run` records (the same options
continue the run), `oal export` takes the run's adapter only where it has one, the hints and the option an error
names are the ones to change, `oal evaluate` records the dtype it measured in, and Ctrl-C under a launch prints its
line once per machine, not once per process."""

from __future__ import annotations

import json

import pytest
import torch
from _runs import make_run
from _tiny import save_tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from oal.cli import load_commands


def _cli(*args):
    res = CliRunner().invoke(load_commands(), [str(a) for a in args])
    return res, " ".join(res.output.replace("│", " ").replace("'", "").split())  # rich wraps long lines in a box


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("base") / "model")


def test_select_layers_records_the_options_of_the_run_that_continues(tmp_path, monkeypatch):
    """`oal select-layers` had no --steps (nor --val-every, --grouping, --window, --sinks, ...), so the `oal run
    --layers auto:K --steps 1` that continues it was refused: config.adapt.steps differed."""
    import oal.pipeline.runs as runs

    seen = {}

    def capture(name):
        def stop(cfg, out, *args, **kwargs):
            seen[name] = cfg.to_dict()
            raise SystemExit(0)
        return stop

    monkeypatch.setattr(runs, "run_selection", capture("select-layers"))
    monkeypatch.setattr(runs, "run", capture("run"))
    shared = ["--out", tmp_path / "run", "--methods", "oal,swa,softmax", "--steps", "1", "--val-every", "1",
              "--grouping", "budget:2", "--window", "8", "--sinks", "2", "--batch-size", "2", "--grad-accum", "2",
              "--lora-dropout", "0", "--dtype", "bfloat16", "--no-progress"]
    res, text = _cli("select-layers", "--k", "2", "--by", "fidelity", *shared)
    assert res.exit_code == 0 and "select-layers" in seen, res.output
    res, text = _cli("run", "--layers", "auto:2", "--select-by", "fidelity", "--tasks", "none", *shared)
    assert res.exit_code == 0 and "run" in seen, res.output
    # what claim_run_dir compares, less the evaluation keys (zero-shot tasks), which a resumed run may change
    identity = [{k: v for k, v in cfg.items() if not k.startswith("zeroshot")} for cfg in seen.values()]
    assert identity[0] == identity[1]
    assert identity[0]["adapt"]["steps"] == 1 and identity[0]["window"] == 8


def test_select_layers_refuses_window_without_a_sliding_window_method(tmp_path):
    res, text = _cli("select-layers", "--out", tmp_path / "run", "--k", "1", "--window", "64")
    assert res.exit_code == 2 and "--window" in text and "sliding-window methods" in text, res.output
    assert not (tmp_path / "run").exists()


def test_export_takes_the_adapter_only_where_the_run_has_one(base, tmp_path):
    """`oal export` of a run without adaptation (`oal analyze` + `oal calibrate`) was refused unless --no-adapter;
    `oal convert` and `oal generate` take the adapter only where the run has one, and so does export now."""
    run = make_run(tmp_path, base, {"oal": True, "global": False})
    res, text = _cli("export", "--out", run, "--method", "global", "--to", tmp_path / "global")
    assert res.exit_code == 0 and "calibrated kernels only (the run has no adapter for it)" in text, res.output
    res, text = _cli("export", "--out", run, "--method", "oal", "--to", tmp_path / "oal")
    assert res.exit_code == 0 and "LoRA adapter (merged)" in text, res.output
    def adapter(method):
        return json.loads((tmp_path / method / "oal.json").read_text())["source"]["adapter"]

    assert adapter("global") is None and adapter("oal")["merged"]
    res, text = _cli("export", "--out", run, "--method", "global", "--adapter", "--to", tmp_path / "strict")
    assert res.exit_code == 2 and "Invalid value for --adapter" in text and "oal_adapter.json" in text, res.output
    assert not (tmp_path / "strict").exists()


def test_softmax_without_an_adapter_names_no_kernels(base, tmp_path):
    """`--adapter` on a run with no softmax arm suggested --no-adapter "for the calibrated kernels alone": softmax
    has no kernels."""
    from oal.artefact.arms import load_arm
    from oal.errors import InputError
    from oal.models.registry import load_model

    run = make_run(tmp_path, base, {"oal": False})
    _, _, prov = load_model(str(base))
    record = {"model": str(base), "state_dict_sha256": prov["state_dict_sha256"], "dtype": prov["dtype"],
              "sha256": prov["sha256"]}
    (run / "config.json").write_text(json.dumps({"config": {"dtype": "float32"}, "model": record}))
    with pytest.raises(InputError) as err:
        load_arm(run, "softmax", True)
    assert err.value.param == "--adapter" and "pass --no-adapter for the base model alone" in err.value.message
    assert "kernels" not in err.value.message.partition("pass --no-adapter")[2]


def test_evaluate_records_the_dtype_it_measured_in(base, tmp_path):
    """`oal evaluate --dtype float32` on a bfloat16 run replaced metrics.json["fidelity"] with float32 numbers and
    no word of the dtype. (A bfloat16 checkpoint: its kernels verify in either dtype.)"""
    half = tmp_path / "half"
    AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).save_pretrained(half)
    AutoTokenizer.from_pretrained(base).save_pretrained(half)
    run = make_run(tmp_path, half, {"oal": False, "global": False})
    res, _ = _cli("evaluate", "--out", run, "--methods", "oal,global", "--blocks", "1", "--no-progress")
    assert res.exit_code == 0, res.output
    res, _ = _cli("evaluate", "--out", run, "--methods", "oal", "--blocks", "1", "--dtype", "bfloat16",
                  "--no-progress")
    assert res.exit_code == 0, res.output
    fid = json.loads((run / "metrics.json").read_text())["fidelity"]
    assert fid["oal"]["dtype"] == "bfloat16" and fid["global"]["dtype"] == "float32"


def test_report_names_the_dtype_of_evaluated_fidelity():
    from oal.pipeline.report_sections import fidelity_section

    row = {"mse": 0.1, "relmse": 0.2, "mse_post_o": 0.3, "relmse_post_o": 0.4}
    text = "\n".join(fidelity_section({"fidelity": {"oal": {**row, "dtype": "float32"}, "global": row}}))
    assert "Base model dtype of the rows measured by `oal evaluate`: OAL float32." in text
    assert "dtype" not in "\n".join(fidelity_section({"fidelity": {"oal": row}}))


def test_calibrate_in_another_dtype_than_the_groups_names_dtype(base, tmp_path):
    """`oal calibrate --dtype bfloat16` on groups captured in float32: the error line began `base_model:`."""
    out = tmp_path / "run"
    res, _ = _cli("analyze", "--out", out, "--model", base, "--layers", "1", "--n-bootstrap", "5", "--heldout", "0",
                  "--no-figures", "--no-progress", "--device", "cpu")
    assert res.exit_code == 0, res.output
    res, text = _cli("calibrate", "--out", out, "--model", base, "--dtype", "bfloat16", "--max-steps", "1",
                     "--no-progress", "--device", "cpu")
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert res.exit_code == 2 and len(errors) == 1, res.output
    assert errors[0].startswith("Error: Invalid value for '--dtype':") and "--dtype float32" in text, res.output
    assert not (out / "kernels.json").exists()


@pytest.mark.parametrize("rank, local_rank, printed", [("0", "0", True), ("1", "1", False), ("2", "0", True)])
def test_ctrl_c_under_a_launch_prints_once_per_machine(monkeypatch, rank, local_rank, printed):
    """Every process of a launch gets the Ctrl-C and each printed the line; now the processes that print bad input
    (`oal.launch.reports_error`: the main one, and the first of each machine) do."""
    import importlib

    import oal.launch as launch

    def interrupted(level):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("oal.cli.app"), "setup_logging", interrupted)
    monkeypatch.setattr(launch, "_RANKS", {"this": object()})  # after the group formed
    for name, value in (("RANK", rank), ("LOCAL_RANK", local_rank), ("WORLD_SIZE", "4")):
        monkeypatch.setenv(name, value)
    res, _ = _cli("demo", "--length", "8")
    assert res.exit_code == 130, res.output
    assert res.output.count("Interrupted.") == int(printed), res.output


def test_convert_in_another_dtype_than_the_kernels_names_dtype(base, tmp_path):
    """`oal convert --dtype bfloat16` on kernels calibrated in float32: the line began `base_model:`, naming the
    model the user had not given (the base-model check knows that the dtype is at fault)."""
    out = tmp_path / "run"
    for args in (("analyze", "--n-bootstrap", "5", "--heldout", "0", "--no-figures"),
                 ("calibrate", "--max-steps", "1")):
        res, _ = _cli(*args, "--out", out, "--model", base, "--layers", "1", "--no-progress", "--device", "cpu")
        assert res.exit_code == 0, res.output
    res, text = _cli("convert", "--out", out, "--dtype", "bfloat16", "--device", "cpu")
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert res.exit_code == 2 and len(errors) == 1, res.output
    assert errors[0].startswith("Error: Invalid value for '--dtype':") and "--dtype float32" in text, res.output
