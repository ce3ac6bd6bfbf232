"""`oal run --model PATH` on a tiny BERT folder: detection, the encoder protocol end to end, resume."""

import json
import math
import random

import pytest
import torch
from _tiny_encoders import save_tiny_encoder, save_word_corpus
from typer.testing import CliRunner

from oal.models.encoder import is_encoder_model
from oal.pipeline.config import RunConfig
from oal.pipeline.runs import run, run_seed

WORDS = ["alpha", "beta", "gamma", "delta", "kernel", "query", "key", "value", "head", "group", "token", "layer"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("enc_assets")
    save_tiny_encoder(root / "model", WORDS)
    save_word_corpus(root / "corpus.txt", WORDS)
    return root


def _plan():
    return {"grouping": {"split": "train", "start": 0, "count": 12},
            "calib_train": {"split": "train", "start": 12, "count": 8},
            "calib_val": {"split": "train", "start": 20, "count": 4},
            "heldout": {"split": "test", "start": 0, "count": 6}, "max_len": 64}


def _cfg(assets, **kw):
    return RunConfig(model=str(assets / "model"), data=str(assets / "corpus.txt"), plan=_plan(),
                     grouping={"n_bootstrap": 20}, calib={"max_steps": 12, "val_every": 4, "patience": 8}, **kw)


@pytest.fixture(scope="module")
def enc_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("enc_run")
    return out, run(_cfg(assets), out, progress=False)


def test_detection(assets):
    from oal.models.registry import load_model

    assert is_encoder_model(assets / "model")
    assert not is_encoder_model("default") and not is_encoder_model(assets / "corpus.txt")
    with pytest.raises(ValueError, match="is an encoder"):  # the causal-LM loader refuses it clearly
        load_model(str(assets / "model"))


def test_encoder_run_contract(enc_run):
    out, metrics = enc_run
    for f in ("config.json", "groups.json", "analysis.json", "kernels.safetensors", "calibration.json",
              "kernels/global/kernels.safetensors", "metrics.json", "report.md", "figures/embedding_cosine.png",
              "figures/calibration_curves.png"):
        assert (out / f).is_file(), f
    saved = json.loads((out / "metrics.json").read_text())
    assert saved["protocol"] == "encoder" and saved["converted_layers"] == [1]
    for m in ("oal", "global"):
        f = saved["fidelity"][m]
        assert 0 < f["relmse"] < 1 and 0 < f["relmse_post_o"] and set(f["per_layer"]) == {"1"}
        for p in ("mean", "cls"):
            e = saved["embedding"][m][p]
            assert e["n"] == 6 and 0.5 < e["min"] <= e["mean"] < 1.0
    assert "adapt" in saved["not_run"] and saved["perplexity"] == {}
    assert set(saved["elapsed_s"]) >= {"setup", "analyze", "calibrate", "fidelity", "embedding", "report"}
    config = json.loads((out / "config.json").read_text())
    assert config["protocol"] == "encoder" and config["blocks"]["heldout"]["shape"][0] == 6
    # roles are padded to their own longest passage: calibration copes with train and val of different lengths
    assert config["blocks"]["calib_train"]["shape"][1] != config["blocks"]["calib_val"]["shape"][1]
    assert config["model"]["sha256"]["model.safetensors"]
    groups = json.loads((out / "groups.json").read_text())
    assert len(groups["heads"]["1"]) == 4
    report = (out / "report.md").read_text()
    assert "Embedding agreement" in report and "Not run for encoders" in report and "adaptation" in report


def test_reported_numbers_reproduce_from_files(enc_run, assets):
    """The run directory alone (kernels on the base encoder) reproduces the reported embedding cosine."""
    import oal
    from oal.data import load_corpus
    from oal.data.passages import PassagePlan, plan_passages, tokenize_passages
    from oal.evaluate.embedding import embedding_similarity
    from oal.models.encoder import load_encoder

    out, metrics = enc_run
    base, tok, _ = load_encoder(assets / "model")
    plan = PassagePlan.from_dict(_plan())
    held = tokenize_passages(tok, plan_passages(load_corpus(str(assets / "corpus.txt")), plan)["heldout"], 64)
    conv, _, _ = load_encoder(assets / "model")
    sim = embedding_similarity(base, oal.load(out, conv), held, batch_size=8)
    assert sim["mean"]["mean"] == pytest.approx(metrics["embedding"]["oal"]["mean"]["mean"], rel=1e-9)
    assert sim["mean"]["mean"] < 1.0


def test_export_of_an_encoder_run_reloads(enc_run, assets, tmp_path):
    """`oal export` of an encoder run: one folder that `oal.load` (AutoModel inside) reloads as the converted
    encoder, giving the outputs of the run's kernels on the base encoder."""
    import oal
    from oal.artefact.export import export
    from oal.models.encoder import load_encoder

    out, _ = enc_run
    export(out, "oal", tmp_path / "exp", adapter=False)  # encoder runs have no adapter
    again = oal.load(tmp_path / "exp")
    ref = oal.load(out, load_encoder(assets / "model")[0])
    ids = torch.tensor([[2, 7, 9, 11, 3, 0], [2, 8, 3, 0, 0, 0]])
    mask = (ids != 0).long()
    assert type(again).__name__ == "OALBertModel"
    torch.testing.assert_close(again(input_ids=ids, attention_mask=mask).last_hidden_state,
                               ref(input_ids=ids, attention_mask=mask).last_hidden_state, rtol=0, atol=0)


def test_encoder_run_dir_keeps_one_configuration(enc_run, assets):
    """Provenance binds an encoder run as a decoder run: another configuration in DIR is refused by name."""
    out, _ = enc_run
    with pytest.raises(ValueError, match="converted_layers"):
        run(_cfg(assets, layers=[0]), out, progress=False)


def test_encoder_run_resumes(enc_run, assets, tmp_path):
    _, ref = enc_run
    cfg = _cfg(assets)
    assert run_seed(cfg, tmp_path, progress=False, stop_after="calibrate") == {}
    stamp = (tmp_path / "kernels.safetensors").stat().st_mtime_ns
    metrics = run_seed(cfg, tmp_path, progress=False)
    assert (tmp_path / "kernels.safetensors").stat().st_mtime_ns == stamp, "calibration was recomputed"
    strip = lambda m: {k: v for k, v in m.items() if k != "elapsed_s"}  # noqa: E731
    assert strip(metrics) == strip(ref)


def test_cli_run_dispatches_to_encoder(assets, tmp_path):
    from oal.cli import load_commands

    args = ["run", "--model", str(assets / "model"), "--data", str(assets / "corpus.txt"), "--methods", "global",
            "--out", str(tmp_path), "--no-progress"]
    res = CliRunner().invoke(load_commands(), args)
    assert res.exit_code == 0, res.output
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["protocol"] == "encoder" and math.isfinite(saved["fidelity"]["global"]["relmse"])
    assert torch.tensor(saved["embedding"]["global"]["mean"]["per_passage"]).numel() == 32  # default plan


def test_methods_all_on_an_encoder_is_every_method_that_applies(assets, tmp_path):
    """`--methods all` on an encoder runs every method but the (causal) sliding windows; naming a window is refused."""
    from oal.errors import InputError
    from oal.methods.base import get_method
    from oal.pipeline.config import ALL_METHODS

    metrics = run_seed(_cfg(assets, methods=["all"]), tmp_path / "all", progress=False)
    recorded = json.loads((tmp_path / "all" / "config.json").read_text())["config"]["methods"]
    applies = [m for m in ALL_METHODS if not get_method(m).positional]
    assert recorded == applies and "softmax" in recorded and len(applies) == 7
    assert set(metrics["fidelity"]) == set(applies) - {"softmax"}
    with pytest.raises(InputError, match="sliding windows"):
        run_seed(_cfg(assets, methods=["oal", "swa"]), tmp_path / "swa", progress=False)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_passages_longer_than_the_position_embeddings_are_cut_to_them(tmp_path, family):
    """A plan's max_len beyond the encoder's position embeddings, with a tokenizer that sets no model_max_length
    (transformers' 1e30), cut passages to the model's limit (RoBERTa's positions start after the padding id)
    instead of failing deep in the embeddings' forward."""
    from _tiny_encoders import tiny_encoder, wordpiece_tokenizer

    tok = wordpiece_tokenizer(WORDS, max_len=int(1e30))
    tiny_encoder(family, vocab_size=len(tok)).save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    rng = random.Random(0)
    (tmp_path / "corpus.txt").write_text("\n\n".join(" ".join(rng.choice(WORDS) for _ in range(100)) + "."
                                                     for _ in range(400)))
    cfg = RunConfig(model=str(tmp_path / "model"), data=str(tmp_path / "corpus.txt"), methods=["global"],
                    plan={**_plan(), "max_len": 100}, grouping={"n_bootstrap": 20})
    run_seed(cfg, tmp_path / "run", progress=False, stop_after="analyze")
    blocks = json.loads((tmp_path / "run" / "config.json").read_text())["blocks"]
    assert {b["shape"][1] for b in blocks.values()} == {80 if family == "bert" else 79}  # max_position_embeddings 80


def test_cli_export_of_an_encoder_run(enc_run, tmp_path):
    """`oal export --out RUN --to DIR --no-adapter` (the docs' command) on an encoder run: the card's numbers are
    rebuilt from the run's records with no model loaded, which failed on the encoder's declared pooling."""
    import oal
    from oal.cli import load_commands

    out, metrics = enc_run
    args = ["export", "--out", str(out), "--method", "oal", "--to", str(tmp_path / "exp"), "--no-adapter"]
    res = CliRunner().invoke(load_commands(), args)
    assert res.exit_code == 0, res.output
    assert "AutoModel.from_pretrained" in res.output and "CausalLM" not in res.output  # an encoder's Auto class
    assert type(oal.load(tmp_path / "exp")).__name__ == "OALBertModel"
    from oal.pipeline.publish import verified_metrics

    assert verified_metrics(out)["pooling"] == metrics["pooling"]


def test_evaluate_says_an_encoder_run_is_measured_by_oal_run(enc_run):
    """`oal evaluate` read an encoder's passage plan as a decoder's split plan and blamed --data."""
    from oal.cli import load_commands

    out, _ = enc_run
    for extra in ([], ["--zeroshot"], ["--passkey"]):
        res = CliRunner(env={"COLUMNS": "300"}).invoke(load_commands(), ["evaluate", "--out", str(out), *extra])
        assert res.exit_code == 2 and "an encoder's run" in res.output and "--data" not in res.output, res.output


def test_the_other_commands_on_an_encoder_run(enc_run, tmp_path):
    """`oal generate` and `oal convert` died in tracebacks (no .generate, no .logits); `oal export` told the user to
    train an adapter with `oal adapt`, which refuses encoders; the softmax export loaded the encoder as a causal LM
    and blamed --model; `oal select-layers` listed 52 configuration differences and offered --force."""
    from transformers import AutoModel

    import oal
    from oal.cli import load_commands

    out, _ = enc_run
    cli = CliRunner(env={"COLUMNS": "300"})
    for args in (["generate", "hi", "--out", str(out)], ["select-layers", "--out", str(out), "--k", "1"]):
        res = cli.invoke(load_commands(), args)
        assert res.exit_code == 2 and "an encoder's run" in res.output and "Traceback" not in res.output, res.output
        assert "--force" not in res.output
    res = cli.invoke(load_commands(), ["convert", "--out", str(out), "--method", "oal"])
    assert res.exit_code == 0 and "groups per head" in res.output, res.output
    res = cli.invoke(load_commands(), ["export", "--out", str(out), "--method", "oal", "--to", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert type(oal.load(tmp_path / "o")).__name__ == "OALBertModel"
    res = cli.invoke(load_commands(), ["export", "--out", str(out), "--method", "softmax", "--to",
                                       str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    assert type(AutoModel.from_pretrained(tmp_path / "s")).__name__ == "BertModel"
    assert "AutoModel.from_pretrained" in (tmp_path / "s" / "README.md").read_text()
    assert "AutoModelForCausalLM" not in (tmp_path / "s" / "README.md").read_text()


def test_linearize_refuses_an_encoder_in_one_line(assets):
    """It cut token-stream blocks for BERT and died inside its embeddings (a size mismatch past its positions)."""
    import oal
    from oal.models.encoder import load_encoder

    model, tok, _ = load_encoder(assets / "model")
    with pytest.raises(ValueError, match="model: BertModel is an encoder; .* `oal run --model PATH`"):
        oal.linearize(model, tok, assets / "corpus.txt", layers=[1])


@pytest.mark.parametrize("extra, option", [(["--steps", "3"], "--steps"), (["--tasks", "piqa"], "--tasks"),
                                           (["--passkey", "64"], "--passkey"), (["--limit", "5"], "--limit")])
def test_run_refuses_options_an_encoder_run_would_ignore(assets, tmp_path, extra, option):
    """`oal run --model BERT --steps 3` (or --tasks, --window) recorded the option and ignored it."""
    from oal.cli import load_commands

    args = ["run", "--model", str(assets / "model"), "--data", str(assets / "corpus.txt"), "--out",
            str(tmp_path / "r"), *extra]
    res = CliRunner(env={"COLUMNS": "300"}).invoke(load_commands(), args)
    needs = "applies only to a causal LM's run, not an encoder's"
    assert res.exit_code == 2 and f"Invalid value for {option}: {needs}" in res.output, res.output
    assert not (tmp_path / "r").exists()
