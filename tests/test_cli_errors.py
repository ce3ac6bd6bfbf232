"""Bad input that a command-line audit found answered with a traceback, a misleading line or nothing (2026-12-06):
each is now one line naming the option (or the argument, in Python), before any work where the value alone decides."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from typer.testing import CliRunner

import oal
from oal.cli import load_commands
from oal.errors import InputError
from oal.models.registry import DEFAULT_MODEL_DIR, load_model


def _run(*args):
    res = CliRunner().invoke(load_commands(), [str(a) for a in args])
    return res, " ".join(res.output.replace("│", " ").replace("'", "").split())  # rich wraps long lines in a box


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from _runs import make_run
    from _tiny import save_tiny_llama

    root = tmp_path_factory.mktemp("run")
    return make_run(root, save_tiny_llama(root / "base"), {"oal": False})


@pytest.mark.parametrize("args, option, words", [
    (["--depths", "7"], "--depths", "applies only to --passkey"),
    (["--task-file", "piqa=/nonexistent.jsonl"], "--task-file", "applies only to --zeroshot"),
    (["--passkey", "--blocks", "2"], "--blocks", "applies only to fidelity"),
    (["--zeroshot", "--tasks", "none"], "--tasks", "nothing for --zeroshot to evaluate"),
])
def test_evaluate_refuses_options_of_another_mode(run_dir, args, option, words):
    """They were ignored without a word (exit 0), and --tasks none exited 1 printing nothing."""
    res, text = _run("evaluate", "--out", run_dir, *args)
    assert res.exit_code == 2 and f"Invalid value for {option}" in text and words in text, res.output


@pytest.mark.parametrize("args, option, words", [
    (["run", "--select-by", "fidelity"], "--select-by", "applies only to --layers auto:K"),
    (["run", "--layers", "1-2", "--select-by", "probe"], "--select-by", "applies only to --layers auto:K"),
    (["run", "--passkey-depths", "0.5"], "--passkey-depths", "applies only to --passkey"),
    (["run", "--passkey-trials", "2"], "--passkey-trials", "applies only to --passkey"),
    (["run", "--window", "32"], "--window", "applies to the sliding-window methods"),
    (["run", "--methods", "oal", "--sinks", "2"], "--sinks", "applies to the sliding-window methods"),
    (["calibrate", "--methods", "oal,global", "--window", "32"], "--window", "applies only to the sliding-window"),
    # the default preset reads the builtin corpus: a WikiText folder (even a missing one) went unread, unremarked
    (["run", "--data-dir", "."], "--data-dir", "holds WikiText for the paper presets"),
    (["run", "--data-dir", "/no/such/oal-folder"], "--data-dir", "no such folder"),
])
def test_an_option_that_would_be_ignored_is_refused(tmp_path, args, option, words):
    """They were accepted and ignored (a dead-code audit found them); --window on a run without a window method
    also bound the run's configuration, so a rerun with another value was refused for a setting that changed
    nothing. Refused before any work: nothing is created."""
    out = tmp_path / "out"
    res, text = _run(*args, "--out", out)
    assert res.exit_code == 2 and f"Invalid value for {option}" in text and words in text, res.output
    assert not out.exists()


@pytest.mark.parametrize("text, words", [(b"tiny text.\n", "need at least"),
                                         (b"text\xff\xfe", "is not UTF-8 text")])
def test_a_data_error_names_the_file_once_and_no_library_argument(tmp_path, text, words):
    """'--data: notes.bin: name_or_path: notes.bin is not UTF-8' named the file twice and a library argument the
    user never typed; a too small file said how many blocks it lacked, not how much text it needs."""
    data = tmp_path / "notes.txt"
    data.write_bytes(text)
    res, line = _run("run", "--out", tmp_path / "out", "--data", data, "--tasks", "none")
    assert res.exit_code == 2 and words in line, res.output
    assert "name_or_path" not in line and "indices:" not in line and line.count(str(data)) == 1


def test_window_options_apply_with_a_window_method():
    from oal.pipeline.config import RunConfig

    assert RunConfig(methods=["oal", "oal-swa"], window=32, sinks=2).method_options() == {"window": 32, "sinks": 2}
    with pytest.raises(InputError, match="sliding-window methods") as exc:
        RunConfig(methods=["oal", "global"], sinks=2)
    assert exc.value.param == "--sinks"


def test_evaluate_checks_the_preset_before_loading_a_model(tmp_path):
    from oal.pipeline.evaluate_fidelity import evaluate_fidelity

    with pytest.raises(InputError, match="preset: expected one of") as info:
        evaluate_fidelity(tmp_path, ["oal"], preset="nope")
    assert info.value.param == "--preset"


def test_adapt_names_an_unknown_method_and_gives_advice_that_works(tmp_path):
    """`oal adapt --method performer` advised `oal run --out SAME --methods ...,performer`, which that run refuses
    (another configuration); an unknown name got the same advice."""
    from oal.pipeline.runs import _arm_config

    (tmp_path / "config.json").write_text(json.dumps({"config": {"methods": ["oal", "global", "softmax"]}}))
    with pytest.raises(InputError, match="unknown method 'nope'"):
        _arm_config(tmp_path, "nope", None, {})
    with pytest.raises(InputError, match=r"oal run --out NEW_DIR --methods oal,global,softmax,performer` \(or add "
                                         r"--force"):
        _arm_config(tmp_path, "performer", None, {})


def test_select_layers_names_its_own_option():
    res, text = _run("select-layers", "--out", "unused", "--k", "99", "--model", "default")
    assert res.exit_code == 2 and "Invalid value for --k: expected K <= " in text and "got 99" in text, res.output


@pytest.mark.parametrize("command", [["evaluate"], ["export", "--to", "unused"], ["convert"]])
def test_a_folder_without_kernels_is_an_out_error(tmp_path, command):
    """It was blamed on --method ("the run did not calibrate 'oal' ..."), which no other method would have mended."""
    res, text = _run(*command, "--out", tmp_path)
    assert res.exit_code == 2 and f"Invalid value for --out: {tmp_path} holds no calibrated kernels" in text, text


def test_export_names_an_uncalibrated_method_once(run_dir):
    """It printed "Invalid value for --method: method: the run did not calibrate ..." (the argument named twice)."""
    res, text = _run("export", "--out", run_dir, "--method", "performer", "--to", run_dir / "unused")
    assert res.exit_code == 2 and "Invalid value for --method: the run did not calibrate performer" in text, text


def test_analyze_refuses_a_long_len_past_the_models_positions(tmp_path):
    """It ran past the positions (and at 2**20 tokens for minutes, silently)."""
    positions = json.loads((DEFAULT_MODEL_DIR / "config.json").read_text())["max_position_embeddings"]
    res, text = _run("analyze", "--out", tmp_path / "a", "--long-len", positions + 1, "--no-figures")
    assert res.exit_code == 2 and f"exceed the models {positions} positions" in text, res.output
    assert not (tmp_path / "a").exists()


def test_demo_counts_the_kernels_state_in_its_memory_check():
    """d = 1024 with 64 KV heads needs a 138 GB state: a traceback from the allocator before."""
    res, text = _run("demo", "--length", "2", "--heads", "64", "--kv-heads", "64", "--head-dim", "1024",
                     "--n-groups", "1")
    assert res.exit_code == 2 and "Invalid value for --length" in text and "--head-dim" in text, res.output


def test_a_model_folder_without_its_tokenizer_is_refused(tmp_path):
    """transformers builds an empty tokenizer from no files; every text then had no tokens, and the error blamed
    --data."""
    folder = tmp_path / "notok"
    shutil.copytree(DEFAULT_MODEL_DIR, folder)
    for f in folder.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(ValueError, match="no usable tokenizer"):
        load_model(str(folder))


def test_linearize_checks_its_numbers_before_any_work():
    model, tok, _ = load_model("default")
    for kwargs, match in (({"block_len": 0}, "block_len: expected an integer >= 1"),
                          ({"seed": -1}, "seed: expected an integer >= 0"),
                          ({"calib": {"nope": 1}}, "calib: .*nope")):
        with pytest.raises(ValueError, match=match):
            oal.linearize(model, tok, "builtin", layers=[1], progress=False, **kwargs)


def test_load_of_a_file_names_the_argument(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="directory: .* is not a folder"):
        oal.load(tmp_path / "f")


def test_a_factor_of_the_wrong_size_is_named_in_the_groups_error():
    from oal.ops import oal_attention

    q = k = v = torch.randn(1, 2, 5, 4)
    groups = torch.tensor([[0, 1, 2, 2]] * 2)
    with pytest.raises(ValueError, match=r"groups: ids must lie in \[0, G=1\) \(G from factor's shape"):
        oal_attention(q, k, v, groups, torch.eye(2).expand(2, 2, 2))


def test_a_group_budget_beyond_the_head_dim_is_refused(tmp_path):
    """budget:999 was capped at the head dim without a word (demo refuses --n-groups above --head-dim)."""
    res, text = _run("analyze", "--out", tmp_path / "a", "--grouping", "budget:999", "--layers", "0", "--no-figures")
    assert res.exit_code == 2 and "a budget of 999 groups exceeds the" in text, res.output


def test_ctrl_c_says_so_in_one_line(monkeypatch):
    """typer turned it into exit code 130 in silence, the last line on screen a progress bar."""
    import importlib

    def interrupted(level):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("oal.cli.app"), "setup_logging", interrupted)
    res, text = _run("demo", "--length", "8")
    assert res.exit_code == 130 and text.startswith("Interrupted. Nothing half-written is left"), res.output
    assert "Traceback" not in res.output


def test_ctrl_c_while_the_commands_load_says_so_in_one_line(monkeypatch, capsys):
    """A Ctrl-C in the first second (the commands import torch before `app` can catch it) printed a traceback."""
    import importlib

    import oal.cli as cli

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib, "import_module", interrupted)
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 130
    assert capsys.readouterr().err.startswith("Interrupted. Nothing half-written is left")


def test_a_directory_in_place_of_a_kernels_file_is_named(tmp_path):
    """It said "directory: expected kernels.json and kernels.safetensors in DIR", naming neither as the fault."""
    from oal.calibration.kernels import load_kernels

    (tmp_path / "kernels.json").write_text("{}")
    (tmp_path / "kernels.safetensors").mkdir()
    with pytest.raises(ValueError, match=r"kernels.safetensors: is a directory, not a file"):
        load_kernels(tmp_path)
    with pytest.raises(ValueError, match=r"kernels.json: is missing"):
        load_kernels(tmp_path / "kernels.safetensors")


def test_export_names_no_merge_once(monkeypatch, tmp_path):
    """The library's 'merge: ...' under --no-merge read "Invalid value for --no-merge: merge: the softmax arm"."""
    import oal.pipeline.publish as publish

    def refuse(*args, **kwargs):
        raise ValueError("merge: the softmax arm is written as a plain transformers model")

    monkeypatch.setattr(publish, "export_run", refuse)
    res, text = _run("export", "--out", tmp_path, "--method", "softmax", "--no-merge", "--to", tmp_path / "e")
    assert res.exit_code == 2 and "Invalid value for --no-merge: the softmax arm" in text, res.output


def test_an_option_the_command_lacks_is_not_named():
    """oal run --passkey reaches the passkey check that names '--lengths' (oal evaluate's option): the line said
    "Invalid value for '--lengths'" on a command without it."""
    from oal.cli.failures import bad_input_message

    exc = InputError("4096 + 8 generated tokens exceed the model's 2048 positions", "--lengths", "lengths")
    assert bad_input_message(exc, ["--out", "--passkey"]) == exc.message
    assert bad_input_message(exc, ["--out", "--lengths"]).startswith("Invalid value for '--lengths': 4096")
    assert bad_input_message(InputError("bad", "--method"), ["--methods"]) == "Invalid value for '--methods': bad"


def test_generate_blames_max_new_tokens_when_it_alone_exceeds_the_positions(run_dir):
    """Any request past the positions was blamed on PROMPT, though no shorter prompt would have fitted."""
    res, text = _run("generate", "Hi", "--out", run_dir, "--max-new-tokens", 600)  # the tiny llama has 512
    assert res.exit_code == 2 and "Invalid value for --max-new-tokens" in text and "512 positions" in text, text
    res, text = _run("generate", "Hi " * 300, "--out", run_dir, "--max-new-tokens", 300)
    assert res.exit_code == 2 and "Invalid value for PROMPT" in text, text


@pytest.mark.parametrize("length, words", [(40, "cannot hold the passkey prompt"), (5000, "exceed the models 4096")])
def test_run_checks_its_passkey_lengths_before_the_run(tmp_path, length, words):
    """`oal run --passkey 40` (or a length past the model's positions) failed only after the whole run."""
    res, text = _run("run", "--out", tmp_path / "r", "--passkey", length, "--no-progress", "--tasks", "none")
    assert res.exit_code == 2 and "Invalid value for --passkey" in text and words in text, text
    assert not (tmp_path / "r" / "analysis.json").exists() and not (tmp_path / "r" / "kernels.json").exists()


def test_export_of_a_stage_by_stage_folder_does_not_suggest_oal_adapt(run_dir, tmp_path):
    """The hint named `oal adapt --out DIR`, which refuses a folder without `oal run`'s config.json."""
    res, text = _run("export", "--out", run_dir, "--method", "oal", "--adapter", "--to", tmp_path / "x")
    assert res.exit_code == 2 and "no adapter for oal" in text and "--no-adapter" in text, res.output
    assert "oal adapt" not in text and not (tmp_path / "x").exists()
    res, _ = _run("adapt", "--out", run_dir, "--method", "oal")
    assert res.exit_code == 2 and "config.json" in res.output, res.output  # why the hint would not have worked
