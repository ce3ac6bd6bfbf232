"""Follow-ups of the audits: `oal diagnose` names a layer whose attention is non-finite, the processes of a launch
agree on `--seeds` before any seed runs, the diagnostics' calibrating parts key their methods' construction versions,
`oal convert --model` names --model, a directory made stage by stage loads its base model in the dtype its kernels
record, and an unknown method name gets one message (with a close match) wherever it is given."""

from __future__ import annotations

import json

import pytest
import torch
from _runs import make_run, random_methods
from _tiny import save_tiny_llama, tiny_model
from test_calibration_audit import _Gathered, _LaunchOfTwo  # a launch of two, faked
from typer.testing import CliRunner

from oal.calibration.data import CalibConfig
from oal.cli import load_commands
from oal.errors import InputError

VOCAB = 61
GROUPING = dict(tail_fraction=0.25, min_support=0.5, min_ratio=1.2, min_groups=2, n_bootstrap=20)
CALIB = CalibConfig.preset("tiny", max_steps=2, val_every=1, patience=1)
OVERFLOW = "model: layer 1's attention is non-finite (NaN or inf) on "


def _cli(*args):
    res = CliRunner().invoke(load_commands(), [str(a) for a in args])
    return res, " ".join(res.output.replace("│", " ").split())  # rich wraps long lines in a box


def _blocks(seed: int = 1, vocab: int = VOCAB):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n, length: torch.randint(0, vocab, (n, length), generator=g)  # noqa: E731
    return {"grouping": mk(6, 16), "calib_train": mk(2, 16), "calib_val": mk(1, 16), "fidelity": mk(2, 16)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("base") / "model")


# ------------------------------------------------------------------------------- 1. diagnose: non-finite attention


def _overflowing_model():
    """The tiny GQA model in float16 (weights finite) whose layer 1 keys overflow in KV head 0 (as
    tests/test_calibration_audit.py builds it)."""
    model = tiny_model("qwen2", VOCAB).half()
    attn = model.model.layers[1].self_attn
    with torch.no_grad():
        attn.k_proj.weight[:8] = 0.0
        attn.k_proj.bias[:8] = 6e4
    return model


@pytest.mark.parametrize("parts", [("offset",), ("budget",)])
def test_diagnose_names_the_layer_whose_attention_overflows(tmp_path, parts):
    """Its own captures failed as "q: non-finite values (NaN or inf) in the captured attention tensors" (or
    "q, k: non-finite values"), naming no layer; the analysis and the calibration named it."""
    from oal.diagnostics import diagnose
    from oal.diagnostics.offset_part import OffsetSettings

    offset = OffsetSettings(cfg=CALIB, grouping=GROUPING, seed=0, layer=1, stds=[0.0])
    with pytest.raises(ValueError) as info:
        diagnose(_overflowing_model(), _blocks(), [0, 1, 2], tmp_path, parts=parts, offset=offset, calib_cfg=CALIB,
                 grouping=GROUPING, budget_head=(1, 0), budgets=(1,))
    message = str(info.value)
    assert message.startswith(OVERFLOW + "the grouping prompts: k in KV head 0;"), message
    assert "--dtype float32" in message and "\n" not in message


@pytest.mark.parametrize("capture", ["sequences", "layers"])
def test_diagnose_captures_check_each_layer(capture):
    """Table 1's capture (after the groups) kept the non-finite tensors; the calibrating parts' failed unnamed."""
    from oal.diagnostics import fidelity_table

    blocks = _blocks()["fidelity"]
    with pytest.raises(ValueError) as info:
        if capture == "sequences":
            fidelity_table.capture_sequences(_overflowing_model(), blocks, [0, 1, 2])
        else:
            fidelity_table.capture_layers(_overflowing_model(), blocks, [0, 1, 2], "the calibration training blocks")
    where = "the held-out fidelity blocks" if capture == "sequences" else "the calibration training blocks"
    assert str(info.value).startswith(f"{OVERFLOW}{where}: k in KV head 0;"), str(info.value)


# ------------------------------------------------------------------------------- 2. a launch's seed lists


def test_run_processes_given_other_seed_lists_are_refused_up_front(monkeypatch, tmp_path):
    """Process 0 `--seeds 42,43`, process 1 `--seeds 42`: process 1 ran seed 42 in DIR itself while process 0 ran
    DIR/seed-42, and the launch failed only at seed 43 ("lost contact"). Now every process refuses at once, naming
    --seeds, before a model is loaded (this one does not exist) or anything is written."""
    import oal.pipeline.runs as runs
    from oal.pipeline.config import RunConfig

    cfg = RunConfig(model=str(tmp_path / "no-model"), device="cpu", zeroshot_tasks=[])
    one = _LaunchOfTwo()
    monkeypatch.setattr(runs, "ranks", lambda *a, **k: one)
    with pytest.raises(_Gathered):
        runs.run(cfg, tmp_path / "out", "42", progress=False)
    assert one.sent == [{"seeds": [42]}]
    monkeypatch.setattr(runs, "ranks", lambda *a, **k: _LaunchOfTwo(one.sent[0]))
    with pytest.raises(InputError) as info:
        runs.run(cfg, tmp_path / "out", "42,43", progress=False)
    assert info.value.message.startswith("the processes of this launch differ in seeds (process 0: [42, 43], "
                                         "process 1: [42])"), info.value.message
    assert info.value.param == "--seeds"
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ------------------------------------------------------------------------------- 3. construction versions in keys


@pytest.mark.parametrize("part", ["budget", "offset"])
def test_calibrating_parts_are_recomputed_for_a_new_construction(tmp_path, monkeypatch, part):
    """The budget (and offset) parts calibrate global and OAL, but their keys held no construction version: after
    a version bump (the same tensors compute another function) the old result was served."""
    from oal.diagnostics import diagnose
    from oal.diagnostics.offset_part import OffsetSettings
    from oal.methods import get_method

    model = tiny_model("qwen2", VOCAB)
    kw = dict(parts=(part,), calib_cfg=CALIB, grouping=GROUPING, budget_head=(1, 0), budgets=(1, 2),
              offset=OffsetSettings(cfg=CALIB, grouping=GROUPING, seed=0, layer=1, stds=[0.0]))
    first = diagnose(model, _blocks(), [1], tmp_path, **kw)[part]
    again = diagnose(model, _blocks(), [1], tmp_path, **kw)[part]
    assert again["settings_key"] == first["settings_key"]  # version-1 keys as they were: the result is reused
    monkeypatch.setattr(get_method("oal"), "version", get_method("oal").version + 1)
    bumped = diagnose(model, _blocks(), [1], tmp_path, **kw)[part]
    assert bumped["settings_key"] != first["settings_key"]
    saved = json.loads((tmp_path / "diagnostics" / f"{part}.json").read_text())
    assert saved["settings_key"] == bumped["settings_key"]


# ------------------------------------------------------------------------------- 4. convert --model


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, base):
    return make_run(tmp_path_factory.mktemp("run"), base, {"oal": False})


@pytest.mark.parametrize("command", ["convert", "export"])
def test_a_broken_model_folder_is_a_model_error(run_dir, tmp_path, command):
    """`oal convert --out RUN --model BROKEN` said "Error: base_model: ..." (`oal.load`'s argument), and `oal
    export` blamed --out."""
    broken = tmp_path / "broken"
    broken.mkdir()
    extra = ["--to", tmp_path / "exported"] if command == "export" else ["--device", "cpu"]
    res, text = _cli(command, "--out", run_dir, "--model", broken, *extra)
    assert res.exit_code == 2, res.output
    assert f"Error: Invalid value for --model: {broken} is not a Hugging Face model folder" in text.replace("'", ""), \
        text
    assert "base_model" not in text


# ------------------------------------------------------------------------------- 5. a stage-by-stage run's dtype


def test_a_stage_by_stage_directory_loads_its_base_model_in_the_recorded_dtype(base, tmp_path):
    """No config.json (`oal analyze` + `oal calibrate`): "the run's dtype" was float32, so kernels calibrated on
    the bfloat16 model were loaded on a float32 one (which its hashes, taken in bfloat16, let through)."""
    from oal.artefact.arms import load_converted
    from oal.calibration.kernels import kernel_dir, save_kernels
    from oal.models.registry import load_model

    _, _, provenance = load_model(str(base), dtype=torch.bfloat16)
    run = tmp_path / "run"
    save_kernels(random_methods("oal", 4, 2, 8, seed=0), kernel_dir(run, "oal"), base_model=str(base),
                 provenance=provenance)
    assert not (run / "config.json").exists()
    mdl, _, _ = load_converted(run, "oal", False)
    assert mdl.model.embed_tokens.weight.dtype == torch.bfloat16
    wide, _, _ = load_converted(run, "oal", False, dtype=torch.float32)  # the recorded weights, cast
    assert torch.equal(wide.model.embed_tokens.weight, mdl.model.embed_tokens.weight.float())
    # oal evaluate's fidelity asked load_converted for float32 outright there, and recorded float32
    from oal.pipeline.evaluate_fidelity import evaluate_fidelity

    res = evaluate_fidelity(run, ["oal"], blocks=1, progress=False)
    assert res["fidelity"]["oal"]["dtype"] == "bfloat16"


# ------------------------------------------------------------------------------- 6. unknown method names


def test_unknown_method_names_get_one_message_with_a_close_match(tmp_path):
    """Three formats: "method: unknown 'x'; expected one of a, b", "unknown method 'x'; expected one of a (this
    run's)" and `oal calibrate`'s Python lists "unknown ['x']; expected some of ['oal', ...]"."""
    from oal.methods import get_method, method_names
    from oal.pipeline.runs import _arm_config

    names = ", ".join(method_names())
    with pytest.raises(ValueError) as info:
        get_method("oall")
    assert str(info.value) == f"method: unknown method 'oall'; expected one of {names} (did you mean 'oal'?)"

    res, text = _cli("calibrate", "--out", tmp_path / "c", "--methods", "oal,performr")
    assert res.exit_code == 2
    assert (f"Error: Invalid value for --methods: unknown method 'performr'; expected some of {names} (did you "
            "mean 'performer'?)") in text, text
    assert "[" not in text

    (tmp_path / "config.json").write_text(json.dumps({"config": {"methods": ["oal", "global"]}}))
    with pytest.raises(InputError) as info:
        _arm_config(tmp_path, "globl", None, {})
    assert info.value.message == ("unknown method 'globl'; expected one of oal, global, softmax (this run's arms) "
                                  "(did you mean 'global'?)")
    with pytest.raises(InputError) as info:
        _arm_config(tmp_path, "zzz", None, {})
    assert info.value.message == "unknown method 'zzz'; expected one of oal, global, softmax (this run's arms)"


def test_run_methods_suggest_a_close_match_too():
    """`oal run --methods` (errors.parse_names) was the one list of names without the close-match hint."""
    from oal.errors import parse_names
    from oal.methods import method_names

    with pytest.raises(ValueError, match=r"^methods: unknown method 'performr'; .* or 'all' \(did you mean "
                                         r"'performer'\?\)$"):
        parse_names("oal,performr", tuple(method_names()), "methods")
    with pytest.raises(ValueError, match=r"or 'all'$"):  # nothing close: no hint
        parse_names("zzzz", tuple(method_names()), "methods")


def test_a_refused_passkey_length_leaves_no_run_behind(tmp_path):
    """`oal run --passkey 100000` on a model of fewer positions wrote OUT/config.json before refusing the length, so
    the corrected command with other settings was refused as another configuration ("use --force")."""
    from test_pipeline import _cfg, make_assets

    from oal.pipeline.evaluate_passkey import passkey_check
    from oal.pipeline.runs import run

    out = tmp_path / "run"
    with pytest.raises(InputError, match="max_position_embeddings") as info:
        run(_cfg(make_assets(tmp_path / "assets"), layers=[1]), out, progress=False, check=passkey_check([100000]))
    assert info.value.param == "--passkey"
    assert not (out / "config.json").exists()
