"""The recipe as a user keeps it (issue 48): every arm of a run exports, softmax included (its adapter merged, a
plain transformers folder); `oal run --passkey` measures passkey retrieval of every arm into metrics.json and
report.md; report.md names oal's version."""

from __future__ import annotations

import json
import shutil
from importlib.metadata import version

import pytest
import torch
from test_pipeline import _cfg, make_assets
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

from oal.cli import load_commands
from oal.pipeline.runs import run_seed

IDS = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 7, 130, 64, 12, 200, 33]])


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    """The tiny model of test_pipeline with room for a passkey prompt in its byte tokens."""
    return make_assets(tmp_path_factory.mktemp("assets"), max_positions=512)


@pytest.fixture(scope="module")
def recipe_run(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe")
    run_seed(_cfg(assets, methods=["oal", "softmax"]), out, progress=False)
    return out


@pytest.fixture
def run_copy(recipe_run, tmp_path):
    shutil.copytree(recipe_run, tmp_path / "run")
    return tmp_path / "run"


def cli(*args):
    return CliRunner().invoke(load_commands(), [str(a) for a in args])


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


def test_the_softmax_arm_exports_with_its_adapter_merged(recipe_run, assets, tmp_path):
    from oal.artefact.arms import load_arm
    from oal.models.pretrained import verify_manifest
    from oal.models.registry import load_model

    to = tmp_path / "softmax"
    res = cli("export", "--out", recipe_run, "--method", "softmax", "--to", to)
    assert res.exit_code == 0, res.output
    assert {"config.json", "model.safetensors", "oal.json", "README.md"} <= {p.name for p in to.iterdir()}
    manifest = verify_manifest(to)  # every file's SHA256, and the adapter it came from
    assert manifest["source"]["method"] == "softmax" and manifest["source"]["adapter"]["merged"]
    exported = AutoModelForCausalLM.from_pretrained(to).eval()  # the family's own class, no conversion
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    arm, _, _ = load_arm(recipe_run, "softmax")
    torch.testing.assert_close(_logits(exported), _logits(arm), rtol=0, atol=1e-6)
    base, _, _ = load_model(str(assets / "model"))
    assert (_logits(exported) - _logits(base)).abs().max() > 1e-4  # the adapter is in the weights
    card = (to / "README.md").read_text()
    assert "# Softmax reference of" in card and "license:" in card and "perplexity (test blocks)" in card
    res = cli("export", "--out", recipe_run, "--method", "softmax", "--to", tmp_path / "b", "--no-merge")
    assert res.exit_code == 2 and "--no-merge" in res.output


def test_run_passkey_measures_every_arm_into_the_report(run_copy):
    from oal.pipeline.evaluate_passkey import passkey_after_run

    res = passkey_after_run(run_copy, ["oal", "softmax"], lengths=[300, 400], depths=[0.5], trials=1)
    assert set(res) == {"oal", "softmax"} and all(set(r) == {"adapted"} for r in res.values())
    metrics = json.loads((run_copy / "metrics.json").read_text())
    for m in ("oal", "softmax"):
        assert set(metrics["passkey"][m]["adapted"]["by_length"]) == {"300", "400"}
    assert "passkey" in (run_copy / "report.md").read_text().lower()


def test_run_passkey_option(monkeypatch, tmp_path):
    """`oal run --passkey` parses its lengths before the run and measures after it, with the run's methods."""
    import oal.pipeline.evaluate_passkey as passkey
    import oal.pipeline.runs as runs

    calls = []
    monkeypatch.setattr(runs, "run", lambda cfg, out, seeds, **kw: calls.append(("run", cfg.methods)))
    monkeypatch.setattr(passkey, "passkey_after_run", lambda out, methods, **kw: calls.append(("passkey", methods, kw))
                        or {}, raising=False)
    res = cli("run", "--out", tmp_path / "r", "--methods", "oal-swa,softmax", "--passkey", "1024,2048,4096",
              "--passkey-depths", "0.1,0.5,0.9", "--passkey-trials", "1", "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert calls[0] == ("run", ["oal-swa", "softmax"])
    assert calls[1][1] == ["oal-swa", "softmax"] and calls[1][2]["lengths"] == [1024, 2048, 4096]
    assert calls[1][2]["depths"] == [0.1, 0.5, 0.9] and calls[1][2]["trials"] == 1
    calls.clear()
    for bad in (["--passkey", "abc"], ["--passkey", "0"], ["--passkey-depths", "2", "--passkey", "64"],
                ["--passkey", "64", "--seeds", "1,2"]):
        res = cli("run", "--out", tmp_path / "r", *bad)
        assert res.exit_code == 2 and "--passkey" in res.output and not calls, res.output
    # under a launch the passkey step (one process) was refused only after the whole run
    monkeypatch.setenv("WORLD_SIZE", "2")
    res = cli("run", "--out", tmp_path / "r", "--passkey", "64")
    assert res.exit_code == 2 and "one seed, in one process" in res.output and not calls, res.output


def test_report_names_oal_by_its_distribution(recipe_run):
    from oal.rundir.hashes import versions

    assert versions()["oal"] == version("oal-attention")
    assert f"oal {version('oal-attention')}" in (recipe_run / "report.md").read_text()
