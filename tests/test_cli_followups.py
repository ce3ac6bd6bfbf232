"""Follow-ups on the command line and the diagnostics: a bool is not a seed, `oal run` resumes a run whose softmax arm
`oal adapt` added, `oal diagnose` checks its outputs and refuses the options its parts do not read before the model
loads, a run's recorded dtype must be a float dtype, and the help says each option's default."""

from __future__ import annotations

import errno
import json

import pytest
import torch
from _runs import make_run
from _tiny import save_tiny_llama
from typer.testing import CliRunner

from oal.cli import load_commands
from oal.errors import InputError


def _cli(*args):
    res = CliRunner().invoke(load_commands(), [str(a) for a in args])
    return res, " ".join(res.output.replace("│", " ").split())  # rich wraps long lines in a box


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("base") / "model")


# ------------------------------------------------------------------------------------------------------ seeds


@pytest.mark.parametrize("seeds", [True, [True, 2], (False,), 1.5, None])
def test_a_bool_or_a_float_is_not_a_seed(seeds):
    """parse_seeds(True) was [1] (a run of seed 1, recorded as true); 1.5 and None were TypeErrors."""
    from oal.pipeline.config import parse_seeds

    with pytest.raises(ValueError, match="^seeds: expected integers"):
        parse_seeds(seeds)
    assert parse_seeds([4, 5]) == [4, 5] and parse_seeds("7") == [7]


@pytest.mark.parametrize("seed", [True, -1, "42", 2**32, 1.5])
def test_run_config_refuses_a_seed_no_generator_takes(seed):
    """RunConfig(seed=True) ran as seed 1 and recorded true; the API's `run(cfg, out)` takes cfg.seed as it is."""
    from oal.pipeline.config import RunConfig

    with pytest.raises(InputError, match="expected an integer in") as exc:
        RunConfig(seed=seed)
    assert exc.value.param == "--seeds"
    assert RunConfig(seed=0).seed == 0


# ------------------------------------------------------------------------------------- oal run after oal adapt


def test_run_resumes_after_adapt_added_the_softmax_arm(tmp_path, caplog):
    """`oal adapt --method softmax` on a run without a softmax arm appends softmax to the run's methods; `oal run`
    with the run's own options was then refused as another configuration (methods, adapt_overrides), with --force,
    which deletes the run, as the only way on. It now keeps the arm and resumes, adapting nothing again."""
    from test_pipeline import _cfg, make_assets

    from oal.pipeline.runs import adapt_arm, run

    assets = make_assets(tmp_path / "assets", n_layers=2)
    cfg = _cfg(assets, layers=[1], methods=["oal"])
    out = tmp_path / "run"
    run(cfg, out, progress=False)
    adapted = adapt_arm(out, "softmax", steps=2, progress=False)
    with caplog.at_level("INFO", logger="oal"):
        again = run(cfg, out, progress=False)
    assert "keeping the softmax arm `oal adapt --method softmax` added" in caplog.text
    assert json.loads((out / "config.json").read_text())["config"]["methods"] == ["oal", "softmax"]
    assert again["perplexity"] == adapted["perplexity"] and again["adapt"] == adapted["adapt"]
    with pytest.raises(InputError) as exc:  # the run's methods list softmax already: named once
        adapt_arm(out, "sofmax", progress=False)
    listed = exc.value.message.split(" (did you mean")[0]  # the suggestion names it again
    assert listed.count("softmax") == 1 and exc.value.param == "--method"


# ------------------------------------------------------------------------------------------ oal diagnose --out


def test_diagnose_checks_its_outputs_before_the_model_loads(tmp_path, monkeypatch):
    """A file where diagnose writes its figures failed after the part's minutes of calibration ("[Errno 17] File
    exists: 'X/figures'"); now before the model loads (here one that does not exist), naming --out."""
    out = tmp_path / "d"
    out.mkdir()
    (out / "figures").write_text("")
    res, text = _cli("diagnose", "--out", out, "--model", tmp_path / "no-model", "--parts", "budget")
    assert res.exit_code == 2 and "Invalid value for '--out'" in text and f"{out / 'figures'} is not a folder" in text
    (out / "figures").unlink()
    import oal.diagnostics.runner as runner

    def refuse(*args, dir=None, **kwargs):  # a read-only folder (the tests may run as root, whom no mode stops)
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(runner.tempfile, "TemporaryFile", refuse)
    res, text = _cli("diagnose", "--out", out, "--model", tmp_path / "no-model", "--parts", "table2")
    assert res.exit_code == 2 and f"Invalid value for '--out': cannot write in {out} (Permission denied)" in text


def test_diagnose_api_checks_its_outputs_before_any_part_runs(tmp_path, base):
    """`diagnose()` (also `benchmarks.budget table2`'s) calibrated Table 2 and Fig. 2(b) first, then failed on the
    figure or on metrics.json."""
    from oal.calibration.data import CalibConfig
    from oal.diagnostics.runner import diagnose
    from oal.models.registry import load_model

    model, _, _ = load_model(str(base))
    gen = torch.Generator().manual_seed(0)
    blocks = {r: torch.randint(0, 200, (2, 32), generator=gen) for r in ("grouping", "calib_train", "calib_val",
                                                                         "fidelity")}
    kw = dict(calib_cfg=CalibConfig(max_steps=2, val_every=1, patience=2), budgets=(1, 2),
              grouping={"n_bootstrap": 10, "tail_fraction": 0.25, "min_support": 0.9, "min_ratio": 1.5,
                        "min_groups": 2})
    for name, parts in (("figures", ["budget"]), ("metrics.json", ["table2"])):
        out = tmp_path / name.replace(".", "_")
        (out / name).mkdir(parents=True) if name == "metrics.json" else (out.mkdir(), (out / name).write_text(""))
        with pytest.raises(InputError) as exc:
            diagnose(model, blocks, [1], out, parts=parts, table2_methods=["global"], **kw)
        assert exc.value.param == "--out" and name in exc.value.message
        assert not (out / "diagnostics").exists()  # nothing ran


def test_diagnose_refuses_options_its_parts_do_not_read(tmp_path):
    """`--steps 50 --parts table2` calibrated Table 2 with its own budget, and said nothing (--steps is the offset
    part's); --data on an `oal run` directory was ignored for the run's corpus. Refused before the model loads."""
    out, model = tmp_path / "d", tmp_path / "no-model"
    for parts, option, value in (("table2", "--steps", "50"), ("budget,table2", "--controls", "5"),
                                 ("table1", "--head", "1:0"), ("offset", "--methods", "oal"),
                                 ("offset", "--max-budget", "4"), ("table2", "--sequences", "2"),
                                 ("offset", "--paper", None)):
        res, text = _cli("diagnose", "--out", out, "--model", model, "--parts", parts, option,
                         *(() if value is None else (value,)))
        assert res.exit_code == 2 and f"Invalid value for {option}: applies only to --parts" in text, text
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"config": {"model": "default"}, "split_plan": {}}))
    res, text = _cli("diagnose", "--out", run_dir, "--model", model, "--data", "builtin")
    assert res.exit_code == 2 and "Invalid value for --data: applies only to an --out that is not an `oal run`" \
        in text, text
    assert not out.exists()


# ------------------------------------------------------------------------------------------------ a run's dtype


def test_a_recorded_dtype_that_is_no_float_dtype_names_config_json(tmp_path, base):
    """config.json's dtype "int8" loaded the base model in int8, also under --dtype float32 (a wider dtype loads
    the run's and casts), and the error blamed the base model."""
    from oal.artefact.arms import load_converted

    run = make_run(tmp_path, base, {"oal": False}, dtype="int8")
    for dtype in (None, torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match="config.json: config.dtype: expected one of float32"):
            load_converted(run, "oal", dtype=dtype)
    res, text = _cli("convert", "--out", run, "--dtype", "float32", "--device", "cpu")
    assert res.exit_code == 2 and f"{run / 'config.json'}: config.dtype" in text


def test_evaluate_zeroshot_limit_names_the_option(tmp_path, base):
    """`oal evaluate --zeroshot --limit 0` said 'limit: ...', the library's argument; `oal run` names --limit."""
    run = make_run(tmp_path, base, {"oal": False})
    for command in (("evaluate", "--out", run, "--zeroshot"), ("run", "--out", tmp_path / "x")):
        res, text = _cli(*command, "--limit", "0")
        assert res.exit_code == 2 and "Invalid value for '--limit': expected a positive number of examples" in text


# ---------------------------------------------------------------------------------------------------- --help


def _params(command: str) -> dict:
    from typer.main import get_command

    group = get_command(load_commands())
    cmd = group.get_command(None, command)
    return {p.name: p for p in cmd.params}


def test_adapt_help_says_an_option_left_out_keeps_the_runs_setting():
    """`oal adapt --help` said --batch-size defaults to 1, --lora-dropout to 0.05, --window to 64: each one left out
    keeps the run's (the shared options' help is `oal run`'s)."""
    params = _params("adapt")
    for name in ("steps", "batch_size", "grad_accum", "lora_dropout", "window", "sinks"):
        assert "(default: the run's" in params[name].help, name
        assert params[name].default is None  # what the help says: nothing given, nothing changed


def test_calibrate_help_names_its_budgets_and_files_them_as_calibration():
    """--val-every of `oal calibrate` (calibration's validation interval) was listed under "Adaptation (LoRA and
    kernels)", and --max-steps, --val-every and --patience said '(override)' without a default."""
    from oal.calibration.data import CalibConfig

    params = _params("calibrate")
    assert {params[n].rich_help_panel for n in ("max_steps", "val_every", "patience")} == {"Calibration budgets"}
    default, paper = CalibConfig.preset("default"), CalibConfig.preset("paper")
    for name in ("max_steps", "val_every", "patience"):
        assert f"default {getattr(default, name)}, --paper {getattr(paper, name)}" in params[name].help, name
    assert _params("run")["val_every"].rich_help_panel.startswith("Adaptation")  # still adaptation's there


@pytest.mark.parametrize("command", ["demo", "fetch"])
def test_a_dtype_without_a_base_model_is_not_called_the_base_models(command):
    """`oal demo --dtype` (the random q, k, v) and `oal fetch --dtype` (the dequantised weights) said "Base model
    dtype ... (kernels, LoRA and calibration stay float32)"."""
    help_text = _params(command)["dtype"].help
    assert "Base model" not in help_text and "LoRA" not in help_text
    res, text = _cli(command, *(("smollm2-135m",) if command == "fetch" else ()), "--dtype", "float8")
    assert res.exit_code == 2 and "Invalid value for --dtype: expected one of float32" in text


def test_diagnose_refuses_a_group_budget_above_the_head_dim_before_any_part_runs(tmp_path, base):
    """`--max-budget 100` on a model of head dim 64 calibrated budgets 1 to 64 (after Table 1, with the default
    parts) and then failed with 'n_groups: expected an int in [1, 64], got 65'."""
    from oal.calibration.data import CalibConfig
    from oal.diagnostics.runner import diagnose
    from oal.models.registry import load_model

    model, _, _ = load_model(str(base))
    dim = model.config.hidden_size // model.config.num_attention_heads
    gen = torch.Generator().manual_seed(0)
    blocks = {r: torch.randint(0, 200, (2, 32), generator=gen) for r in ("grouping", "calib_train", "calib_val",
                                                                         "fidelity")}
    with pytest.raises(InputError) as exc:
        diagnose(model, blocks, [1], tmp_path / "d", parts=["table2", "budget"], table2_methods=["global"],
                 budgets=(1, 2, dim + 1), calib_cfg=CalibConfig(max_steps=2, val_every=1, patience=2),
                 grouping={"n_bootstrap": 10, "tail_fraction": 0.25, "min_support": 0.9, "min_ratio": 1.5,
                           "min_groups": 2})
    assert exc.value.param == "--max-budget" and f"[1, {dim}]" in exc.value.message
    assert not (tmp_path / "d" / "diagnostics" / "table2.json").exists()  # refused before Table 2 ran
