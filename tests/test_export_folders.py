"""Exported folders as a user receives them: what the card claims about the model in the folder, and where the
folder may be written. Run directories from `_runs.make_run` (tiny random Llama, random kernels and adapters)."""

from __future__ import annotations

import pytest
import torch
from _runs import make_run
from _tiny import save_tiny_llama
from huggingface_hub import ModelCard
from typer.testing import CliRunner

from oal.artefact.export import export

METRICS = {"perplexity": {"softmax": 12.5, "oal": 13.25, "performer": 14.75},
           "perplexity_no_adapt": {"softmax": 12.5, "oal": 20.5, "performer": 21.5}}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    base = save_tiny_llama(tmp_path_factory.mktemp("base"))
    return make_run(tmp_path_factory.mktemp("r"), base, {"oal": True, "performer": True})


def test_card_claims_trained_kernels_only_where_the_adapter_has_them(run_dir, tmp_path):
    """Performer's random features are not trained (its adapter has no kernel_params.safetensors): its card must not
    say "and trained kernels"; OAL's adapter trains its factor, and its card says so."""
    performer = (export(run_dir, "performer", tmp_path / "p", metrics=METRICS) / "README.md").read_text()
    assert "With the run's LoRA adapter (merged into the weights)." in performer
    assert "trained kernels" not in performer
    oal_card = (export(run_dir, "oal", tmp_path / "o", metrics=METRICS) / "README.md").read_text()
    assert "With the run's LoRA adapter (merged into the weights) and trained kernels." in oal_card


def test_card_says_when_its_numbers_were_measured_in_another_dtype(run_dir, tmp_path):
    """`--dtype bfloat16` writes bf16 weights, but the run measured its numbers in float32: the card must say so
    rather than present them as this folder's; an export in the run's own dtype needs no such line."""
    text = (export(run_dir, "oal", tmp_path / "bf16", dtype=torch.bfloat16, metrics=METRICS) / "README.md").read_text()
    ModelCard(text)  # still a valid card
    assert "oal 13.25" in text
    assert "weights in `bfloat16` here" in text and "measured in `float32`" in text
    same = (export(run_dir, "oal", tmp_path / "fp32", metrics=METRICS) / "README.md").read_text()
    assert "measured in `" not in same


def test_export_to_the_current_folder_is_one_clean_error_on_to(run_dir, tmp_path, monkeypatch):
    """`oal export --to .` used to fail with "Invalid value for --out: PosixPath('.') has an empty name"; swapping
    the current folder away would also leave the shell in a deleted folder. It is refused on --to."""
    from oal.cli import load_commands

    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    for to in (".", str(here), "sub/../.."):
        res = CliRunner(env={"COLUMNS": "400"}).invoke(load_commands(), ["export", "--out", str(run_dir), "--to", to])
        assert res.exit_code != 0
        out = " ".join(res.output.replace("│", " ").split())
        assert "--to" in out and "current folder" in out and "empty name" not in out, out
    assert list(here.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == ["here"]



def test_card_does_not_promise_hash_checks_on_the_hub_route(run_dir, tmp_path):
    """A card is read on the hub, where users load by id: that route goes through transformers' download cache and
    oal.json is not checked (a warning says so). The card used to say "every load checks the SHA256"."""
    text = " ".join((export(run_dir, "oal", tmp_path / "o") / "README.md").read_text().split())
    assert "every load checks" not in text
    assert "every load from a local folder checks the SHA256" in text and "hub id" in text
