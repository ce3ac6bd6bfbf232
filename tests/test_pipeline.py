"""`oal run` end to end on a tiny random Qwen2 model: run directory contract, consistency and resume."""

import dataclasses
import json
import math
import random

import pytest
from _tiny import save_tiny_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from typer.testing import CliRunner

from oal.pipeline.aggregate import aggregate_seeds
from oal.pipeline.config import RunConfig, parse_methods, parse_seeds
from oal.pipeline.runs import run, run_seed


def _byte_tokenizer():
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk)


def make_assets(root, n_layers: int = 3, max_positions: int = 128, seed: int = 0, paragraphs: int = 500):
    """A tiny random Qwen2 (byte tokenizer) in root/model and a word-salad corpus of `paragraphs` paragraphs in
    root/corpus.txt."""
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    save_tiny_model(root / "model", Qwen2ForCausalLM, cfg, _byte_tokenizer())
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "kernel", "query", "key", "value", "head", "group"]
    text = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 20))) + "." for _ in range(paragraphs)]
    (root / "corpus.txt").write_text("\n\n".join(text))
    return root


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"))


def _plan():
    def bs(split, length, first, count, through_end=False):
        return {"split": split, "block_len": length, "indices": list(range(first, first + count)),
                "through_end": through_end}

    return {"grouping": bs("train", 32, 0, 8), "calib_train": bs("train", 64, 4, 2), "calib_val": bs("train", 64, 6, 1),
            "fidelity": bs("train", 64, 7, 2), "adapt_train": bs("train", 64, 9, 6), "val": bs("validation", 64, 0, 2),
            "test": bs("test", 64, 0, 3)}


def _cfg(assets, adapt=None, **kw):
    kw.setdefault("zeroshot_tasks", [])  # zero-shot has its own tests (test_zeroshot_pipeline.py); no hub access here
    return RunConfig(model=str(assets / "model"), data=str(assets / "corpus.txt"), plan=_plan(),
                     grouping={"n_bootstrap": 50}, calib={"max_steps": 10, "val_every": 5, "patience": 10},
                     adapt=adapt or {"steps": 4, "val_every": 2, "ckpt_every": 1}, **kw)


@pytest.fixture(scope="module")
def full_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    metrics = run_seed(_cfg(assets), out, progress=False)
    return out, metrics


def _strip_time(m):
    return {k: v for k, v in m.items() if k != "elapsed_s"}


def test_run_directory_contract(full_run):
    out, metrics = full_run
    for f in ("config.json", "groups.json", "kernels.safetensors", "calibration.json", "metrics.json", "report.md",
              "adapter/oal/oal_adapter.json", "adapter/oal/kernel_params.safetensors",
              "adapter/softmax/oal_adapter.json", "kernels/global/kernels.safetensors"):
        assert (out / f).is_file(), f
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["converted_layers"] == [1]
    for m in ("oal", "global"):
        assert set(saved["fidelity"][m]) >= {"mse", "relmse", "mse_post_o", "relmse_post_o"}
    for m in ("oal", "global", "softmax"):
        ppl = saved["perplexity"][m]
        rec = json.loads((out / ".oal" / f"perplexity_{m}.json").read_text())
        assert rec["tokens"] == 3 * 63  # 3 test blocks of 64 tokens, 63 scored targets each (App. F.3)
        assert ppl == pytest.approx(math.exp(rec["nll_sum"] / rec["tokens"]), rel=1e-12)
        assert 1 < ppl < 2 * 256  # an untrained byte model sits near the uniform 256; per-block sums would not
    assert len({saved["perplexity"][m] for m in ("oal", "global", "softmax")}) == 3  # three different models
    assert set(saved["elapsed_s"]) >= {"setup", "analyze", "calibrate", "fidelity", "budget", "adapt:oal", "report"}
    regime = json.loads((out / "regime.json").read_text())
    assert set(regime["layers"]) == {"1"} and set(regime["layers"]["1"]["kernels"]) == {"oal", "global"}
    budget = json.loads((out / "budget.json").read_text())
    assert [p["G"] for p in budget["points"]] == [1, 2, 3, 4, 6, 8] and budget["app_b_groups"] >= 2
    report = (out / "report.md").read_text()
    assert "## Attention regime" in report and "## Group budget beside App. B" in report
    assert "figures/group_budget.png" in report
    config = json.loads((out / "config.json").read_text())
    assert config["split_plan"]["test"]["split"] == "test" and config["versions"]["torch"]
    assert config["model"]["sha256"], "model file hashes recorded"
    # kernels trained jointly with LoRA for OAL, none for the softmax arm
    assert saved["adapt"]["oal"]["n_kernel_params"] > 0 and saved["adapt"]["oal"]["kernel_change"] > 0
    assert saved["adapt"]["softmax"]["n_kernel_params"] == 0


def test_unadapted_softmax_perplexity_is_the_base_models(full_run, assets):
    """The softmax arm before adaptation is the base model itself: its perplexity, by a plain cross-entropy over
    the test blocks, is the reported one."""
    import torch

    from oal.data import SplitPlan, load_corpus, plan_blocks
    from oal.models.registry import load_model

    out, metrics = full_run
    model, tok, _ = load_model(str(assets / "model"))
    test = plan_blocks(load_corpus(str(assets / "corpus.txt")), tok, SplitPlan.from_dict(_plan()))["test"]
    with torch.no_grad():
        logits = model(input_ids=test).logits[:, :-1].double()
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), test[:, 1:].reshape(-1))
    assert metrics["perplexity_no_adapt"]["softmax"] == pytest.approx(math.exp(float(nll)), rel=1e-6)


def test_perplexity_matches_model_rebuilt_from_files(full_run, assets):
    """The run directory alone reproduces the reported number: kernels + adapter on the base model."""
    import oal
    from oal.adaptation.adapter import load_adapter
    from oal.data import SplitPlan, load_corpus, plan_blocks
    from oal.evaluate.perplexity import perplexity
    from oal.models.registry import load_model

    out, metrics = full_run
    model, tok, _ = load_model(str(assets / "model"))
    blocks = plan_blocks(load_corpus(str(assets / "corpus.txt")), tok, SplitPlan.from_dict(_plan()))
    model = load_adapter(oal.load(out, model), out / "adapter" / "oal")
    assert perplexity(model, blocks["test"]) == pytest.approx(metrics["perplexity"]["oal"], rel=1e-9)


def test_killed_run_resumes_and_matches(full_run, assets, tmp_path):
    out_ref, ref = full_run
    cfg = _cfg(assets)
    assert run_seed(cfg, tmp_path, progress=False, stop_after="calibrate") == {}  # "killed" after calibrate
    assert not (tmp_path / "metrics.json").exists()
    stamps = {f: (tmp_path / f).stat().st_mtime_ns for f in ("groups.json", "calibration.json", "kernels.safetensors")}
    metrics = run_seed(cfg, tmp_path, progress=False)
    for f, t in stamps.items():
        assert (tmp_path / f).stat().st_mtime_ns == t, f"{f} was recomputed"
    assert _strip_time(metrics) == _strip_time(ref)
    # a finished run does nothing new and reports the same
    again = run_seed(cfg, tmp_path, progress=False)
    assert _strip_time(again) == _strip_time(ref)


def test_run_says_its_stages_on_stderr_and_its_result_on_stdout(assets, tmp_path, capsys):
    """`oal run`'s stage rules, skip lines and progress bars go to stderr; stdout holds the final table only."""
    cfg = _cfg(assets, methods=["softmax"], adapt={"steps": 2, "val_every": 2})
    run(cfg, tmp_path, progress=True)
    first = capsys.readouterr()
    assert "adapt:softmax" in first.err and "perplexity:softmax" in first.err  # the stage rules
    assert "loss" in first.err and "report:" in first.err  # the adaptation's progress bar, the report's path
    assert "PPL (LoRA)" in first.out  # the summary table
    run(cfg, tmp_path, progress=True)  # resumed: every stage is skipped
    again = capsys.readouterr()
    assert "skip adapt:softmax" in again.err
    for out in (first.out, again.out):
        assert "PPL (LoRA)" in out
        assert not any(word in out for word in ("skip", "adapt:", "perplexity:", "loss", "report:"))


def test_aggregate_seeds_mean_and_sample_std():
    def m(seed, ppl):
        return {"model": "x", "converted_layers": [1], "methods": ["oal"], "seed": seed,
                "perplexity": {"oal": ppl}, "perplexity_no_adapt": {}, "elapsed_s": {"adapt:oal": 1.0},
                "fidelity": {"oal": {"mse": ppl / 10, "relmse": 0.5, "mse_post_o": 0.1, "relmse_post_o": 0.2}},
                "adapt": {}}

    agg = aggregate_seeds({42: m(42, 10.0), 43: m(43, 12.0), 44: m(44, 14.0)})
    assert agg["perplexity"]["oal"] == pytest.approx(12.0)
    assert agg["perplexity_std"]["oal"] == pytest.approx(2.0)  # n-1 denominator
    assert agg["fidelity"]["oal"]["mse"] == pytest.approx(1.2)
    assert agg["per_seed"]["43"]["perplexity"]["oal"] == 12.0 and agg["seeds"] == [42, 43, 44]
    assert agg["elapsed_s"]["adapt:oal"] == pytest.approx(3.0)


def test_two_seeds_write_per_seed_dirs_and_aggregate(assets, tmp_path):
    cfg = _cfg(assets, methods=["softmax"])
    metrics = run(cfg, tmp_path, [1, 2], progress=False)
    for s in (1, 2):
        assert (tmp_path / f"seed-{s}" / "metrics.json").is_file()
    per = [json.loads((tmp_path / f"seed-{s}" / "metrics.json").read_text())["perplexity"]["softmax"] for s in (1, 2)]
    assert metrics["perplexity"]["softmax"] == pytest.approx(sum(per) / 2)
    assert metrics["perplexity_std"]["softmax"] == pytest.approx(abs(per[0] - per[1]) / math.sqrt(2))
    assert (tmp_path / "report.md").is_file() and (tmp_path / "metrics.json").is_file()


def test_config_parsing_errors():
    assert parse_methods("all")[:3] == ["oal", "global", "softmax"] and len(parse_methods("all")) == 10
    assert parse_seeds("42,43,44") == [42, 43, 44]
    with pytest.raises(ValueError, match="methods"):
        parse_methods("oal,flash")
    with pytest.raises(ValueError, match="seeds"):
        parse_seeds("4x")
    with pytest.raises(ValueError, match="preset"):
        RunConfig(preset="gpt-5")
    with pytest.raises(ValueError, match="steps"):
        RunConfig(adapt={"steps": 0})


def test_cli_rejects_bad_methods(tmp_path):
    from oal.cli import load_commands

    app = load_commands()
    res = CliRunner().invoke(app, ["run", "--out", str(tmp_path), "--methods", "oal,nope"])
    assert res.exit_code == 2 and "nope" in res.output
    res = CliRunner().invoke(app, ["adapt", "--out", str(tmp_path / "none")])
    assert res.exit_code == 2 and "config.json" in res.output


def test_cli_adapt_reruns_one_arm(full_run, tmp_path):
    import shutil

    from oal.cli import load_commands

    app = load_commands()
    out, _ = full_run
    shutil.copytree(out, tmp_path / "run")
    res = CliRunner().invoke(app, ["adapt", "--out", str(tmp_path / "run"), "--method", "global", "--steps", "2",
                                   "--no-progress"])
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "run" / "adapter" / "global" / "adapt.json").read_text())["steps"] == 2
    assert "test PPL after adaptation" in res.output
    wide = CliRunner(env={"COLUMNS": "400"})  # keep the error on one line of the rich box
    res = wide.invoke(app, ["adapt", "--out", str(tmp_path / "run"), "--method", "performer"])
    assert res.exit_code == 2 and "no calibrated kernels" in res.output


def test_all_methods_run_end_to_end(assets, tmp_path):
    """`--methods all`: every baseline is calibrated (when trainable), converted, adapted and evaluated."""
    metrics = run_seed(_cfg(assets, methods=["all"], adapt={"steps": 2, "val_every": 2}, window=16, sinks=2), tmp_path,
                       progress=False)  # blocks of 64 tokens: the windows must be shorter
    kernel_methods = ["oal", "global", "performer", "spectraformer", "dijiang", "taylorshift", "swa", "oal-swa",
                      "global-swa"]
    assert set(metrics["fidelity"]) == set(kernel_methods)
    assert set(metrics["perplexity"]) == set(kernel_methods) | {"softmax"}
    assert metrics["adapt"]["performer"]["n_kernel_params"] == 0  # fixed random features stay fixed (App. F.1)
    for m in ("spectraformer", "dijiang", "taylorshift"):
        assert metrics["adapt"][m]["n_kernel_params"] > 0 and metrics["adapt"][m]["kernel_change"] > 0
    text = (tmp_path / "report.md").read_text()
    for name in ("Performer", "SpectraFormer", "DiJiang", "TaylorShift", "Sliding window (SWA)",
                 "Window + OAL (hybrid)", "Window + learned global"):
        assert f"| {name} |" in text


def test_older_construction_kernels_are_recalibrated(assets, tmp_path, monkeypatch):
    """A run directory whose DiJiang kernels came from another construction version recalibrates them (and every
    stage reading them reruns) instead of skipping the calibration and reporting the old kernels' numbers."""
    from oal.methods.dijiang import DiJiangMethod

    cfg = _cfg(assets, methods=["dijiang"], adapt={"steps": 2, "val_every": 2})
    stages = tmp_path / ".oal" / "stages.json"
    run_seed(cfg, tmp_path, progress=False)
    first = json.loads(stages.read_text())
    run_seed(cfg, tmp_path, progress=False)
    assert json.loads(stages.read_text())["calibrate"] == first["calibrate"]  # same construction: skipped
    monkeypatch.setattr(DiJiangMethod, "version", DiJiangMethod.version + 1)
    run_seed(cfg, tmp_path, progress=False)
    again = json.loads(stages.read_text())
    assert again["calibrate"]["key"] != first["calibrate"]["key"]
    assert again["fidelity"]["key"] != first["fidelity"]["key"]  # it read the recalibrated kernel files


def test_cli_conventions():
    """`oal --version`, `python -m oal`, and --quiet/--verbose are mutually exclusive."""
    import subprocess
    import sys

    from oal import __version__
    from oal.cli import load_commands

    res = CliRunner().invoke(load_commands(), ["--version"])
    assert res.exit_code == 0 and res.output.strip() == f"oal {__version__}"
    res = CliRunner().invoke(load_commands(), ["--quiet", "--verbose", "demo", "--length", "8"])
    assert res.exit_code == 2 and "--quiet" in res.output
    out = subprocess.run([sys.executable, "-m", "oal", "--version"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"oal {__version__}"


def test_shell_completion(monkeypatch):
    """typer's completion: `oal --show-completion bash` prints the script; the script's query completes a command."""
    import typer.completion

    from oal.cli import load_commands

    # with shellingham installed, typer reads the shell off the process tree, not the argument: a runner with no
    # shell among its ancestors (a double-forked job) got "Shell  not supported."; the user's terminal has one
    monkeypatch.setattr(typer.completion, "_get_shell_name", lambda: "bash")
    res = CliRunner().invoke(load_commands(), ["--show-completion", "bash"], prog_name="oal")
    assert res.exit_code == 0 and "_oal_completion" in res.output
    env = {"_OAL_COMPLETE": "complete_bash", "COMP_WORDS": "oal ev", "COMP_CWORD": "1"}
    res = CliRunner(env=env).invoke(load_commands(), [], prog_name="oal")
    assert res.exit_code == 0 and res.output.split() == ["evaluate"]


def test_adaptation_starts_where_the_paper_says(assets, tmp_path, monkeypatch):
    """App. F.1-F.2: OAL starts LoRA from its calibrated coefficients; a baseline's trainable kernel parameters
    (DiJiang's theta = 0, TaylorShift's tau = 1, SpectraFormer's FastFood draws) start it at their initial values,
    their calibration serving the frozen-attention evaluation only. They started from the calibrated values."""
    import torch

    from oal.calibration.kernels import load_kernels
    from oal.methods.base import build_method
    from oal.pipeline import decoder

    starts, real_adapt = {}, decoder.adapt

    def recording_adapt(model, *args, description="", **kwargs):
        starts[description.removeprefix("adapt ")] = {
            n.split("oal_method.")[-1]: p.detach().clone() for n, p in model.named_parameters()
            if "oal_method." in n}
        return real_adapt(model, *args, description=description, **kwargs)

    monkeypatch.setattr(decoder, "adapt", recording_adapt)
    out = tmp_path / "run"
    run_seed(_cfg(assets, methods=parse_methods("oal,dijiang,taylorshift,spectraformer"),
                  adapt={"steps": 1, "val_every": 1, "ckpt_every": 1}), out, progress=False)
    calibrated = {m: load_kernels(out if m == "oal" else out / "kernels" / m)[0][1]
                  for m in ("oal", "dijiang", "taylorshift", "spectraformer")}
    assert torch.equal(starts["oal"]["factor"], calibrated["oal"].factor)
    assert not torch.equal(calibrated["dijiang"].theta, torch.zeros_like(calibrated["dijiang"].theta))
    assert torch.equal(starts["dijiang"]["theta"], torch.zeros_like(calibrated["dijiang"].theta))
    assert not torch.equal(calibrated["taylorshift"].tau, torch.ones_like(calibrated["taylorshift"].tau))
    assert torch.equal(starts["taylorshift"]["tau"], torch.ones_like(calibrated["taylorshift"].tau))
    fresh = build_method("spectraformer", 4, 2, 16, layer_idx=1, seed=calibrated["spectraformer"].seed)
    for name in ("B", "G", "S"):
        assert torch.equal(starts["spectraformer"][name], getattr(fresh, name)), name
    assert not torch.equal(calibrated["spectraformer"].B, fresh.B)
    # the adapter goes back onto the run's calibrated kernels (its check sees the start), its trained tensors win
    from oal.artefact.arms import load_converted
    from oal.models.attention import converted_methods
    from oal.rundir.files import load_safetensors

    model, _, _ = load_converted(out, "dijiang")
    trained = next(v for k, v in load_safetensors(out / "adapter" / "dijiang" / "kernel_params.safetensors").items()
                   if k.endswith("theta"))
    assert torch.equal(converted_methods(model)[1].theta, trained)
    assert not torch.equal(trained, starts["dijiang"]["theta"])


def test_a_preset_with_the_papers_table_layers_reports_them(assets, tmp_path, monkeypatch):
    """Sec. 5.1 / App. B on a preset that has them (Qwen2.5-0.5B: Layers 4, 12, 20; Layer 4, Head 0): fidelity gets
    their own Eq. 22 aggregate in metrics.json and the report, Fig. 2's analysis and the budget curve use that head.
    Here the default preset is given table layers [1] and head 1:1 on the tiny model's one converted layer."""
    from oal.models import registry

    monkeypatch.setitem(registry.PRESETS["default"], "table_layers", [1])
    monkeypatch.setitem(registry.PRESETS["default"], "representative", [1, 1])
    out = tmp_path / "run"
    metrics = run_seed(_cfg(assets, methods=parse_methods("oal,global"), adapt={"steps": 1, "val_every": 1,
                                                                                 "ckpt_every": 1}), out, progress=False)
    for m in ("oal", "global"):
        paper = metrics["fidelity"][m]["subsets"]["paper_layers"]
        assert paper["layers"] == [1]
        assert {k: paper[k] for k in ("mse", "relmse")} == {k: metrics["fidelity"][m][k] for k in ("mse", "relmse")}
    assert "The paper's layers [1] alone" in (out / "report.md").read_text()
    budget = json.loads((out / "budget.json").read_text())
    assert (budget["layer"], budget["head"]) == (1, 1)
    analysis = json.loads((out / "analysis.json").read_text())
    assert analysis["representative"] == {"layer": 1, "head": 1}


def test_config_records_every_corpus_the_plan_reads(assets, tmp_path):
    """The paper's plans read WikiText-2 beside the --data corpus: config.json recorded only the --data corpus's
    provenance (revision, file hashes), the other one's blocks alone by hash."""
    from oal.data import load_corpus
    from oal.pipeline.decoder import Run
    from oal.rundir.lock import own_dir

    other = tmp_path / "other.txt"
    other.write_text("\n\n".join(f"paragraph {i} of another corpus, long enough to fill blocks." for i in range(400)))
    plan = _plan()
    plan["test"] = {**plan["test"], "split": "train", "corpus": str(other)}
    r = Run(dataclasses.replace(_cfg(assets), plan=plan), tmp_path / "run", progress=False)
    with own_dir(r.dir, r.ranks):
        r.setup()
    data = json.loads((tmp_path / "run" / "config.json").read_text())["data"]
    assert data["name"] == load_corpus(assets / "corpus.txt").name
    recorded = data["other_corpora"][str(other)]
    assert recorded["sha256"] == load_corpus(other).sha256 and recorded["meta"]
