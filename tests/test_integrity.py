"""Trustworthy run directories (issue 15): provenance that binds, stage validity, one configuration per directory,
and a one-line error (exit code 2) for every bad input, with nothing in the run directory changed."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from _runs import timeless
from _tiny import save_tiny_model
from test_pipeline import _byte_tokenizer, _cfg, _plan
from transformers import Qwen2Config, Qwen2ForCausalLM
from typer.testing import CliRunner

import oal
from oal.cli import load_commands
from oal.errors import InputError
from oal.pipeline.runs import run, run_seed
from oal.rundir.lock import LOCK_FILE

CFG = dict(methods=["oal", "softmax"])


# ----------------------------------------------------------------------------------------------- fixtures, helpers


def _qwen_cfg(**kw):
    return Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, **kw)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tiny model and corpus of test_pipeline, plus an 'other' model of the same shapes (other weights)."""
    import random

    root = tmp_path_factory.mktemp("assets")
    save_tiny_model(root / "model", Qwen2ForCausalLM, _qwen_cfg(), _byte_tokenizer())
    save_tiny_model(root / "other", Qwen2ForCausalLM, _qwen_cfg(), _byte_tokenizer(), seed=1)
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "kernel", "query", "key", "value", "head", "group"]
    paragraphs = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 20))) + "." for _ in range(500)]
    (root / "corpus.txt").write_text("\n\n".join(paragraphs))
    return root


@pytest.fixture(scope="module")
def full_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    metrics = run_seed(_cfg(assets, **CFG), out, progress=False)
    return out, metrics


@pytest.fixture
def run_copy(full_run, tmp_path):
    """A private copy of the finished run (tests change it)."""
    out = tmp_path / "run"
    shutil.copytree(full_run[0], out)
    return out


def tree(path: Path) -> dict[str, str]:
    """SHA256 of every file below `path` (hidden ones included): 'nothing changed' means equal trees. The directory's
    lock file (empty; a command creates it before it may refuse) is not a result."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(path).rglob("*")) if p.is_file() and p.name != LOCK_FILE}


def cli(*args, env=None):
    return CliRunner(env=env).invoke(load_commands(), [str(a) for a in args])


def assert_bad_input(res, *needles):
    """Exit code 2, one line starting 'Error:' that contains every needle, and no traceback."""
    assert res.exit_code == 2, res.output
    lines = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(lines) == 1, res.output
    assert "Traceback" not in res.output and res.exception is None or isinstance(res.exception, SystemExit)
    for n in needles:
        assert n in lines[0], lines[0]


def _strip_time(m):
    return {k: v for k, v in m.items() if k != "elapsed_s"}


def _load_metrics(out):
    return json.loads((out / "metrics.json").read_text())


# ----------------------------------------------------------------------------------------------- oal run: bad input


@pytest.mark.parametrize("case", ["missing", "not_a_model", "unsupported", "pickle_only", "a_file"])
def test_run_bad_model(case, assets, run_copy, tmp_path):
    if case == "missing":
        model, needle = tmp_path / "nope" / "model", "no such model folder"
    elif case == "not_a_model":
        model, needle = tmp_path / "texts", "not a Hugging Face model folder"
        model.mkdir()
        (model / "a.txt").write_text("hello")
    elif case == "unsupported":
        from transformers import GPT2Config

        model, needle = tmp_path / "gpt2", "unsupported architecture"
        GPT2Config(n_layer=2, n_embd=32, n_head=2).save_pretrained(model)
    elif case == "pickle_only":
        model, needle = tmp_path / "pickled", "pickle weights only (pytorch_model.bin)"
        _qwen_cfg().save_pretrained(model)
        torch.save({"w": torch.zeros(2)}, model / "pytorch_model.bin")
    else:
        model, needle = assets / "corpus.txt", "is a file"
    before = tree(run_copy)
    res = cli("run", "--out", run_copy, "--model", model, "--data", assets / "corpus.txt", "--no-progress")
    assert_bad_input(res, "--model", needle)
    assert tree(run_copy) == before


def test_pickle_message_says_how_to_convert(tmp_path):
    from oal.models.registry import load_model

    _qwen_cfg().save_pretrained(tmp_path)
    torch.save({"w": torch.zeros(2)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(InputError, match="safetensors only.*save_pretrained") as info:
        load_model(tmp_path)
    assert info.value.param == "--model"


@pytest.mark.parametrize("layers, needle", [("99", "[0, 3)"), ("2-99", "[0, 3)"), ("3-1", "is empty"),
                                            ("", "expected 'all'")])
def test_run_bad_layers(layers, needle, assets, run_copy):
    before = tree(run_copy)
    res = cli("run", "--out", run_copy, "--model", assets / "model", "--data", assets / "corpus.txt", "--layers",
              layers, "--no-progress")
    assert_bad_input(res, "--layers", needle)
    assert tree(run_copy) == before


@pytest.mark.parametrize("case, needle", [("missing", "existing path"), ("empty", "empty train split"),
                                          ("binary", "not UTF-8"), ("nul", "binary"), ("small", "only")])
def test_run_bad_data(case, needle, assets, run_copy, tmp_path):
    data = tmp_path / f"{case}.txt"
    if case == "empty":
        data.write_text("")
    elif case == "binary":
        data.write_bytes(bytes(range(256)) * 4)
    elif case == "nul":
        data.write_bytes(b"text\x00" * 100)
    elif case == "small":
        data.write_text("alpha beta gamma.\n\ndelta.\n\nkernel.")
    before = tree(run_copy)
    res = cli("run", "--out", run_copy, "--model", assets / "model", "--data", data, "--no-progress")
    assert_bad_input(res, "--data", needle)
    assert tree(run_copy) == before


def test_run_out_is_a_file_or_below_one(assets, tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    for out, needle in ((f, "is an existing file"), (f / "x", "is a file")):
        res = cli("run", "--out", out, "--model", assets / "model", "--data", assets / "corpus.txt")
        assert_bad_input(res, "--out", needle)
    assert f.read_text() == "x"


@pytest.mark.parametrize("seeds", ["42,,43", "-1", "4x"])
def test_run_bad_seeds(seeds, run_copy):
    before = tree(run_copy)
    assert_bad_input(cli("run", "--out", run_copy, "--seeds", seeds), "seeds")
    assert tree(run_copy) == before


# ----------------------------------------------------------------------------------------------- other commands


def test_analyze_bad_input(assets, run_copy, tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    model = ("--model", assets / "model", "--data", assets / "corpus.txt")
    assert_bad_input(cli("analyze", "--out", f, *model), "--out", "existing file")
    out = tmp_path / "a"
    for opt, value, needle in (("--min-groups", 999, "at most"), ("--heldout", -1, "--heldout"),
                               ("--long-len", 0, "--long-len"), ("--batch-size", 0, "--batch-size")):
        assert_bad_input(cli("analyze", "--out", out, *model, "--layers", "1", opt, value), opt, needle)
    assert not out.exists()
    before = tree(run_copy)  # an `oal run` directory is not rewritten by a stage command
    assert_bad_input(cli("analyze", "--out", run_copy, *model), "--out", "`oal run` directory")
    assert_bad_input(cli("calibrate", "--out", run_copy, *model), "--out", "`oal run` directory")
    assert tree(run_copy) == before


def test_demo_refuses_more_groups_than_dimensions():
    assert_bad_input(cli("demo", "--head-dim", "2", "--n-groups", "5", "--length", "8"), "--n-groups", "at most")
    assert cli("demo", "--head-dim", "2", "--n-groups", "2", "--length", "8").exit_code == 0


def test_demo_diagnose_evaluate_bad_sizes(run_copy, tmp_path):
    for opt in ("--length", "--heads", "--kv-heads", "--head-dim", "--n-groups"):
        for v in ("0", "-3"):
            assert_bad_input(cli("demo", opt, v), opt)
    f = tmp_path / "file"
    f.write_text("x")
    assert_bad_input(cli("diagnose", "--out", f / "x"), "--out", "is a file")
    before = tree(run_copy)
    for v in ("0", "-1"):
        assert_bad_input(cli("evaluate", "--out", run_copy, "--blocks", v), "--blocks")
    assert tree(run_copy) == before


@pytest.mark.parametrize("name", ["kernels.json", ".oal/stages.json", "config.json", "groups.json"])
def test_corrupt_file_is_named(name, assets, run_copy):
    """A damaged JSON file of a run directory: every command reading it names it; nothing is written. (metrics.json
    is read by no command: see test_edited_metrics_are_never_republished.)"""
    (run_copy / name).write_text('{"truncated": ')
    before = tree(run_copy)
    if name == "kernels.json":
        res = cli("evaluate", "--out", run_copy)
    elif name == "groups.json":  # a stage-command directory (no run records) holding a damaged groups.json
        d = run_copy.parent / "stage_dir"
        d.mkdir()
        shutil.copy(run_copy / name, d / name)
        res = cli("calibrate", "--out", d, "--model", assets / "model", "--data", assets / "corpus.txt")
    else:
        res = cli("adapt", "--out", run_copy, "--method", "oal", "--no-progress")
    assert_bad_input(res, name.split("/")[-1])
    assert tree(run_copy) == before
    if name in (".oal/stages.json", "config.json"):  # `oal run` too
        with pytest.raises(InputError, match=name.split("/")[-1].replace(".", r"\.")):
            run_seed(_cfg(assets, **CFG), run_copy, progress=False)
        assert tree(run_copy) == before


@pytest.mark.parametrize("where", ["../outside.txt", "ABSOLUTE"])
def test_a_stage_record_naming_a_file_outside_the_run_is_refused_unread(run_copy, monkeypatch, where):
    """.oal/stages.json that records a path outside the run: one line naming the file, and nothing outside is read."""
    import oal.rundir.hashes as hashes

    outside = run_copy.parent / "outside.txt"
    outside.write_text("not the run's")
    name = str(outside) if where == "ABSOLUTE" else where
    path = run_copy / ".oal" / "stages.json"
    stages = json.loads(path.read_text())
    stages["calibrate"]["outputs"].append(name)
    stages["calibrate"]["sha256"][name] = "0" * 64
    path.write_text(json.dumps(stages))
    read = []
    real = hashes.sha256_file
    monkeypatch.setattr(hashes, "sha256_file", lambda p, *a, **k: read.append(Path(p).resolve()) or real(p, *a, **k))
    before = tree(run_copy)
    for res in (cli("evaluate", "--out", run_copy), cli("export", "--out", run_copy, "--to", run_copy.parent / "e")):
        assert_bad_input(res, "stages.json", "outside the run directory")
    assert outside.resolve() not in read and tree(run_copy) == before


def test_a_refused_command_leaves_no_out_folder(assets, tmp_path):
    out = tmp_path / "new" / "run"
    res = cli("run", "--out", out, "--model", assets / "model", "--data", assets / "corpus.txt", "--layers", "99")
    assert_bad_input(res, "--layers", "99")
    assert not (tmp_path / "new").exists()  # neither the folder nor the parent it would have needed


def test_corrupt_kernels_json_in_library(full_run, run_copy):
    (run_copy / "kernels.json").write_text("[1, 2")
    from oal.models.registry import load_model

    with pytest.raises(ValueError, match="kernels.json"):
        oal.load(run_copy, load_model(json.loads((full_run[0] / "kernels.json").read_text())
                                      ["base_model"]["name_or_path"])[0])


def test_generate_bad_prompts(run_copy):
    before = tree(run_copy)
    assert_bad_input(cli("generate", "abc\udcff", "--out", run_copy), "PROMPT", "UTF-8")
    res = cli("generate", "x" * 120, "--out", run_copy, "--max-new-tokens", "16")  # 120 + 16 > 128 positions
    assert_bad_input(res, "PROMPT", "max_position_embeddings")
    assert tree(run_copy) == before
    res = cli("generate", "alpha", "--out", run_copy, "--max-new-tokens", "4")
    assert res.exit_code == 0, res.output


def test_debug_shows_the_traceback(tmp_path):
    res = CliRunner().invoke(load_commands(), ["--debug", "run", "--out", str(tmp_path), "--seeds", "-1"])
    assert res.exit_code != 0 and isinstance(res.exception, ValueError) and "seeds" in str(res.exception)


# ----------------------------------------------------------------------------------------------- provenance binds


def test_kernels_record_the_real_model(full_run):
    meta = json.loads((full_run[0] / "kernels.json").read_text())["base_model"]
    assert meta["fingerprint"]["num_hidden_layers"] == 3 and meta["fingerprint"]["head_dim"] == 16
    assert len(meta["state_dict_sha256"]) == 64 and meta["dtype"] == "float32"
    assert "model.safetensors" in meta["hashes"]


def test_other_model_is_refused_everywhere(assets, run_copy):
    before = tree(run_copy)
    for cmd, name in ((["evaluate"], "base_model"), (["convert"], "'--model'"), (["generate", "alpha"], "'--model'")):
        res = cli(*cmd, "--out", run_copy, "--model", assets / "other")
        assert_bad_input(res, name, "differ")
    assert tree(run_copy) == before
    from oal.models.registry import load_model

    other = load_model(assets / "other")[0]
    with pytest.raises(ValueError, match=r"weights of .* differ from the base model recorded in"):
        oal.load(run_copy, other)
    right = load_model(assets / "model")[0]
    assert oal.load(run_copy, right) is right  # the model the kernels were calibrated on is accepted
    half = load_model(assets / "model", dtype=torch.bfloat16)[0]
    with pytest.raises(ValueError, match="dtype=float32"):  # a lossy copy is not the calibrated model
        oal.load(run_copy, half)


def _sharded_copy(src: Path, dst: Path, files_from: Path) -> Path:
    """`src`'s weights re-saved in 100 KB shards, with `files_from`'s config and tokenizer files copied beside."""
    Qwen2ForCausalLM.from_pretrained(src).save_pretrained(dst, max_shard_size="100KB")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(files_from / f, dst / f)
    return dst


def test_every_weight_file_must_match(assets, run_copy, tmp_path):
    """Sharded re-save of other weights + the copied config/tokenizer; an extra weight file; identical tensors
    re-saved in shards (the files differ, so it is not the recorded checkpoint)."""
    with pytest.raises(ValueError, match="differ"):
        oal.load(run_copy, str(_sharded_copy(assets / "other", tmp_path / "sharded", assets / "model")))
    extra = tmp_path / "extra"
    shutil.copytree(assets / "model", extra)
    shutil.copy(extra / "model.safetensors", extra / "model-extra.safetensors")
    with pytest.raises(ValueError, match=r"not recorded \['model-extra.safetensors'\]"):
        oal.load(run_copy, str(extra))
    with pytest.raises(ValueError, match=r"missing \['model.safetensors'\]"):
        oal.load(run_copy, str(_sharded_copy(assets / "model", tmp_path / "resaved", assets / "model")))


def test_adapter_is_checked(assets, run_copy):
    from safetensors.torch import load_file, save_file

    from oal.adaptation.adapter import load_adapter
    from oal.models.registry import load_model

    f = run_copy / "adapter" / "oal" / "adapter_model.safetensors"
    t = load_file(str(f))
    save_file({k: v * 50 if "lora_B" in k else v for k, v in t.items()}, str(f))  # LoRA-B scaled x50

    def model():
        return oal.load(run_copy, load_model(assets / "model")[0])

    with pytest.raises(ValueError, match=r"adapter_model.safetensors: SHA256 does not match"):
        load_adapter(model(), run_copy / "adapter" / "oal")
    f.write_bytes(f.read_bytes()[:100])  # truncated: still a clear error naming the file
    with pytest.raises(ValueError, match=r"adapter_model.safetensors: SHA256 does not match"):
        load_adapter(model(), run_copy / "adapter" / "oal")
    # an intact adapter on other kernels (the softmax arm's adapter on the converted model) is refused
    with pytest.raises(ValueError, match="trained on another model"):
        load_adapter(model(), run_copy / "adapter" / "softmax")


def test_adaptation_checkpoint_has_no_pickle_and_damage_restarts(tmp_path):
    from test_adapt import _Kill, _run

    def go(ckpt, kill=None):
        return _run(ckpt, kill, steps=5)

    _, ref = go(tmp_path / "ref")
    with pytest.raises(_Kill):
        go(tmp_path / "ck", kill=3)
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert "optimizer.safetensors" in names and "optimizer.json" in names
    assert not [n for n in names if n.endswith((".pt", ".pth", ".bin", ".pkl"))]
    opt = tmp_path / "ck" / "optimizer.safetensors"
    opt.write_bytes(opt.read_bytes()[:50])  # damaged: reported, adaptation starts over, same result
    _, res = go(tmp_path / "ck")
    assert res.history == ref.history and res.best_val_nll == ref.best_val_nll


# ----------------------------------------------------------------------------------------------- stage validity


def _corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncate":
        path.write_bytes(data[: len(data) // 2])
    else:  # one byte changed in the middle: a file that may still parse, with other content
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:])


# one output of every stage; timing fields aside, every recomputation must give the same bytes
STAGE_OUTPUTS = ["config.json", "groups.json", "kernels.safetensors", "kernels.json", "calibration.json",
                 ".oal/fidelity.json", ".oal/perplexity_no_adapt_oal.json", "adapter/oal/adapter_model.safetensors",
                 "adapter/oal/kernel_params.safetensors", ".oal/perplexity_oal.json", "adapter/softmax/adapt.json",
                 "report.md"]


# every output with one byte changed; truncation on one JSON file, one tensor file and config.json
CORRUPTIONS = [(name, "flip") for name in STAGE_OUTPUTS] + [
    (name, "truncate") for name in ("groups.json", "kernels.safetensors", "config.json")]


@pytest.mark.parametrize("name, how", CORRUPTIONS)
def test_corrupted_stage_output_is_recomputed_or_refused(name, how, assets, full_run, run_copy):
    """Property: for any stage, corrupting its output and rerunning either recomputes the same bytes (and the same
    metrics) or fails with a clear error naming the file, leaving the directory as it was."""
    out_ref, ref = full_run
    _corrupt(run_copy / name, how)
    before = tree(run_copy)
    try:
        metrics = run_seed(_cfg(assets, **CFG), run_copy, progress=False)
    except InputError as exc:
        assert name == "config.json" and "config.json" in str(exc)
        assert tree(run_copy) == before
        return
    assert _strip_time(metrics) == _strip_time(ref)
    for f in STAGE_OUTPUTS[:-1]:  # report.md holds the time per stage
        assert timeless(run_copy / f) == timeless(out_ref / f), f


def test_finished_run_with_truncated_outputs_is_not_skipped(assets, run_copy):
    """Issue 15 #4: `oal run` used to skip every stage of a finished run whose kernels/groups were truncated."""
    from oal.rundir.stages import StageLog

    _corrupt(run_copy / "kernels.safetensors", "truncate")
    _corrupt(run_copy / "groups.json", "truncate")
    log = StageLog(run_copy)
    assert log.damaged("calibrate") == ["kernels.safetensors"] and log.damaged("analyze") == ["groups.json"]
    assert log.damaged("fidelity") == []
    # the marker (same key) alone never vouches for the files
    assert not log.done("calibrate", log.stages["calibrate"]["key"])
    assert not log.done("analyze", log.stages["analyze"]["key"])
    assert log.done("fidelity", log.stages["fidelity"]["key"])


# ----------------------------------------------------------------------------------------------- one configuration


def test_other_configuration_is_refused_then_forced(assets, run_copy):
    before = tree(run_copy)
    cfg = _cfg(assets, methods=["oal", "global", "softmax"], layers=[0, 1])
    with pytest.raises(InputError, match=r"config\.json records a run of another configuration \(config\.layers.*"
                                         r"config\.methods") as info:
        run_seed(cfg, run_copy, progress=False)
    assert info.value.param == "--out" and "--force" in str(info.value)
    assert tree(run_copy) == before
    (run_copy / "adapter" / "stale").mkdir()  # results of the old configuration must not survive --force
    (run_copy / "notes.txt").write_text("mine")  # ... while files oal did not write stay
    metrics = run_seed(_cfg(assets, methods=["softmax"]), run_copy, progress=False, force=True)
    assert not (run_copy / "adapter" / "stale").exists() and not (run_copy / "adapter" / "oal").exists()
    assert not (run_copy / "kernels.safetensors").exists() and (run_copy / "notes.txt").read_text() == "mine"
    assert set(metrics["perplexity"]) == {"softmax"}


def test_single_and_multi_seed_layouts_do_not_mix(assets, run_copy, tmp_path):
    before = tree(run_copy)
    with pytest.raises(InputError, match="single-seed run"):
        run(_cfg(assets, **CFG), run_copy, [1, 2], progress=False)
    assert tree(run_copy) == before
    multi = tmp_path / "multi"
    (multi / "seed-1").mkdir(parents=True)
    shutil.copy(run_copy / "config.json", multi / "seed-1" / "config.json")
    snapshot = tree(multi)
    with pytest.raises(InputError, match="multi-seed run"):
        run(_cfg(assets, **CFG), multi, [42], progress=False)
    assert tree(multi) == snapshot


def test_cli_reports_differing_keys(assets, run_copy, tmp_path):
    big = tmp_path / "big.txt"  # large enough for the default preset's split plan (32 test blocks of 512)
    big.write_text((assets / "corpus.txt").read_text() * 10)
    before = tree(run_copy)
    res = cli("run", "--out", run_copy, "--model", assets / "model", "--data", big, "--layers", "1-2", "--methods",
              "oal,softmax", "--no-progress")
    assert_bad_input(res, "--out", "config.json records a run of another configuration", "--force")
    assert tree(run_copy) == before


# ----------------------------------------------------------------------------------------------- partial changes


def _ppl_from_files(assets, out, method):
    from oal.adaptation.adapter import load_adapter
    from oal.data import SplitPlan, load_corpus, plan_blocks
    from oal.evaluate.perplexity import perplexity
    from oal.models.registry import load_model

    model, tok, _ = load_model(str(assets / "model"))
    blocks = plan_blocks(load_corpus(str(assets / "corpus.txt")), tok, SplitPlan.from_dict(_plan()))
    if method != "softmax":
        model = oal.load(out, model)
    return perplexity(load_adapter(model, out / "adapter" / method), blocks["test"])


def test_adapt_refreshes_metrics_and_report(assets, full_run, run_copy):
    ref = full_run[1]
    res = cli("adapt", "--out", run_copy, "--method", "oal", "--steps", "2", "--no-progress")
    assert res.exit_code == 0, res.output
    metrics = _load_metrics(run_copy)
    assert metrics["adapt"]["oal"]["steps"] == 2
    assert metrics["perplexity"]["oal"] != ref["perplexity"]["oal"]
    assert metrics["perplexity"]["oal"] == pytest.approx(_ppl_from_files(assets, run_copy, "oal"), rel=1e-9)
    assert metrics["perplexity"]["softmax"] == ref["perplexity"]["softmax"]  # other arms untouched
    assert f"| {metrics['perplexity']['oal']:.4f} |" in (run_copy / "report.md").read_text()
    config = json.loads((run_copy / "config.json").read_text())
    assert config["config"]["adapt_overrides"] == {"oal": {"steps": 2}}


def test_evaluate_updates_metrics_and_report_consistently(full_run, run_copy):
    # the calibrated kernels on the run's own model, data and blocks: the pipeline's numbers
    res = cli("evaluate", "--out", run_copy, "--no-adapter")
    assert res.exit_code == 0, res.output
    metrics = _load_metrics(run_copy)
    for k in ("mse", "relmse", "mse_post_o", "relmse_post_o"):
        assert metrics["fidelity"]["oal"][k] == pytest.approx(full_run[1]["fidelity"]["oal"][k], rel=1e-12)
    assert metrics["fidelity"]["oal"]["n_blocks"] == 2
    res = cli("evaluate", "--out", run_copy, "--blocks", "1")  # default: the adapted model, its own section
    assert res.exit_code == 0, res.output
    metrics = _load_metrics(run_copy)
    assert metrics["fidelity_adapted"]["oal"]["n_blocks"] == 1 and metrics["fidelity"]["oal"]["n_blocks"] == 2
    assert "adapter/oal/adapter_model.safetensors" in metrics["sha256"]
    # metrics.json whose inputs changed since (here: the adapter) is not merged into
    _corrupt(run_copy / "adapter" / "oal" / "adapt.json", "flip")
    before = tree(run_copy)
    assert_bad_input(cli("evaluate", "--out", run_copy, "--no-adapter"), "metrics.json", "changed since")
    assert tree(run_copy) == before
    assert_bad_input(cli("evaluate", "--out", run_copy), "adapt.json", "changed since")  # refused before loading
    assert tree(run_copy) == before


def test_temp_files_of_a_kill_are_cleaned(assets, full_run, run_copy):
    stale = [run_copy / "figures" / ".perplexity.png.abc123.tmp", run_copy / ".oal" / ".stages.json.x1.tmp",
             run_copy / ".metrics.json.zz.tmp"]
    for p in stale:
        p.write_bytes(b"half")
    (run_copy / "adapter" / ".oal.q9.tmp").mkdir()
    metrics = run_seed(_cfg(assets, **CFG), run_copy, progress=False)
    assert not [p for p in stale if p.exists()] and not (run_copy / "adapter" / ".oal.q9.tmp").exists()
    assert _strip_time(metrics) == _strip_time(full_run[1])


def test_calibration_resumes_per_layer_bit_identically(tmp_path):
    """The per-layer checkpoints behind `oal run`'s calibrate stage and `oal calibrate`: a kill after a layer resumes
    at the next one with the same tensors; a damaged or foreign checkpoint is recalibrated, never trusted."""
    from test_calibrate import _data, _groups

    from oal.calibration.data import CalibConfig
    from oal.calibration.resume import LayerCheckpoints, calibrate_layers

    class Kill(Exception):
        pass

    data = {0: (_data(2, seed=0), _data(1, seed=1)), 2: (_data(2, seed=2), _data(1, seed=3))}
    kw = dict(groups={0: _groups(0), 2: _groups(1)}, cfg=CalibConfig.preset("tiny", max_steps=6), seed=0,
              progress=False)
    ref, _ = calibrate_layers(["oal", "global"], [0, 2], data.__getitem__, **kw)

    def capture(seen, kill=None):
        def f(layer):
            if layer == kill:
                raise Kill
            seen.append(layer)
            return data[layer]
        return f

    def same(got):
        return all(torch.equal(a, b) for m in ref for i in ref[m]
                   for a, b in zip(ref[m][i].state_dict().values(), got[m][i].state_dict().values(), strict=True))

    ck = LayerCheckpoints(tmp_path, "key-1")
    with pytest.raises(Kill):
        calibrate_layers(["oal", "global"], [0, 2], capture([], kill=2), checkpoints=ck, **kw)
    seen = []
    got, _ = calibrate_layers(["oal", "global"], [0, 2], capture(seen), checkpoints=ck, **kw)
    assert seen == [2] and same(got)
    _corrupt(tmp_path / ".oal" / "calibrate" / "layer-0" / "oal" / "kernels.safetensors", "flip")
    seen = []
    got, _ = calibrate_layers(["oal", "global"], [0, 2], capture(seen), checkpoints=ck, **kw)
    assert seen == [0] and same(got)
    seen = []
    calibrate_layers(["oal", "global"], [0, 2], capture(seen), checkpoints=LayerCheckpoints(tmp_path, "key-2"), **kw)
    assert seen == [0, 2]


def test_multi_seed_rerun_resumes_and_other_seeds_are_refused(assets, tmp_path):
    cfg = _cfg(assets, methods=["softmax"], adapt={"steps": 2, "val_every": 2})
    first = run(cfg, tmp_path, [1, 2], progress=False)
    assert json.loads((tmp_path / "config.json").read_text())["seeds"] == [1, 2]
    assert set(first["sha256"]) == {"seed-1/metrics.json", "seed-2/metrics.json"}
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.glob("seed-*/adapter/softmax/*")}
    again = run(cfg, tmp_path, [1, 2], progress=False)  # same seeds and configuration: every stage verified
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert again["perplexity"] == first["perplexity"]
    before = tree(tmp_path)
    with pytest.raises(InputError, match=r"over seeds \[1, 2\], not \[1, 3\]"):
        run(cfg, tmp_path, [1, 3], progress=False)
    assert tree(tmp_path) == before


def test_groups_of_another_model_are_refused(assets, full_run, tmp_path):
    d = tmp_path / "stage_dir"
    d.mkdir()
    shutil.copy(full_run[0] / "groups.json", d / "groups.json")
    before = tree(d)
    res = cli("calibrate", "--out", d, "--model", assets / "other", "--data", assets / "corpus.txt")
    assert_bad_input(res, "groups.json", "differ")
    assert tree(d) == before
