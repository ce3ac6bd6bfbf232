"""The model card of `oal export` from an `oal run` directory (issue 37): only numbers rebuilt from verified
records, a licence and a base model in the front matter, the paper, the data, the limitations, no machine path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from huggingface_hub import ModelCard
from test_pipeline import _cfg, assets  # noqa: F401  (the tiny model + corpus fixture)
from typer.testing import CliRunner

from oal.cli import load_commands
from oal.pipeline.runs import run_seed


@pytest.fixture(scope="module")
def oal_run(assets, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("card") / "run"
    metrics = run_seed(_cfg(assets, methods=["oal"], adapt={"steps": 2, "val_every": 2}), out, progress=False)
    return out, metrics


def _export(run: Path, to: Path):
    return CliRunner(env={"COLUMNS": "400"}).invoke(load_commands(), ["export", "--out", str(run), "--method", "oal",
                                                                      "--to", str(to)])


def test_card_has_licence_base_model_paper_data_limitations_and_no_path(oal_run, assets, tmp_path):  # noqa: F811
    run, metrics = oal_run
    res = _export(run, tmp_path / "exp")
    assert res.exit_code == 0, res.output
    text = (tmp_path / "exp" / "README.md").read_text()
    card = ModelCard(text)
    assert card.data.license == "unknown" and "names no licence" in text  # the tiny model's folder says none
    assert card.data.base_model == "model"  # the base model's folder name, not its path
    assert "arxiv.org/abs/2610.13674" in text and "## Limitations" in text and "position_ids" in text
    assert "## Data" in text and "a local text corpus `corpus.txt`" in text
    assert f"oal {metrics['perplexity']['oal']:.4g}" in text
    for path in (str(run.resolve()), str(assets.resolve()), str(tmp_path.resolve()), "/tmp/"):
        assert path not in text
    manifest = json.loads((tmp_path / "exp" / "oal.json").read_text())
    assert str(run.resolve()) not in json.dumps(manifest) and str(assets.resolve()) not in json.dumps(manifest)


def test_card_licence_is_read_from_the_base_models_files(tmp_path):
    from oal.artefact.base_facts import base_model_facts

    (tmp_path / "README.md").write_text("---\nlicense: apache-2.0\nlanguage: en\n---\n# a model\n")
    assert base_model_facts(str(tmp_path), tmp_path)["license"] == "apache-2.0"
    (tmp_path / "README.md").write_text("# no front matter\n")
    (tmp_path / "LICENSE").write_text("                                 Apache License\n  Version 2.0, January 2004\n")
    facts = base_model_facts("Org/Name", tmp_path)
    assert facts == {"id": "Org/Name", "license": "apache-2.0", "license_note": "from the base model's LICENSE"}
    assert base_model_facts("default", None)["license"] == "apache-2.0"  # the embedded default ships inside oal
    assert base_model_facts("smollm2-135m", tmp_path / "3f9a1c")["id"] == "smollm2-135m"  # a registry name, not
    # the content-addressed folder it resolves to


def test_a_number_typed_into_metrics_json_never_reaches_the_card(oal_run, tmp_path):
    src, metrics = oal_run
    run = Path(shutil.copytree(src, tmp_path / "run"))
    edited = json.loads((run / "metrics.json").read_text())
    edited["perplexity"]["oal"] = 1.0
    (run / "metrics.json").write_text(json.dumps(edited))
    res = _export(run, tmp_path / "exp")
    assert res.exit_code == 0, res.output
    text = (tmp_path / "exp" / "README.md").read_text()
    assert "oal 1 |" not in text and "oal 1," not in text
    assert f"oal {metrics['perplexity']['oal']:.4g}" in text  # the verified number, rebuilt
    assert "metrics.json was changed since oal wrote it" in " ".join(res.output.split())


@pytest.mark.parametrize("name", ["calibration.json", "groups.json"])
def test_export_refuses_a_run_whose_records_no_longer_verify(oal_run, tmp_path, name):
    src, _ = oal_run
    run = Path(shutil.copytree(src, tmp_path / "run"))
    data = json.loads((run / name).read_text())
    data["edited"] = True
    (run / name).write_text(json.dumps(data))
    res = _export(run, tmp_path / "exp")
    assert res.exit_code == 2 and name in res.output and "rerun `oal run" in res.output, res.output
    assert not (tmp_path / "exp").exists()


def test_a_dequantised_gguf_folder_is_named_by_its_records(tmp_path, monkeypatch):
    """A GGUF folder (named by a hash) is named in the card by what oal recorded and checks: the upstream id and
    licence of a model oal fetches, else the GGUF file's name and general.license; never by its README.md, which a
    user may edit (issue 48: the licence edited to `mit` there reached the card)."""
    pytest.importorskip("gguf")
    from _tiny_gguf import write_tiny_gguf

    from oal.artefact.base_facts import base_model_facts
    from oal.models.fetch import LOCAL_MODELS
    from oal.models.gguf import materialize_gguf
    from oal.models.provenance import file_sha256

    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tmp_path / "tiny.gguf", license="gpl-3.0")
    folder = materialize_gguf(path)
    facts = base_model_facts(str(path), folder)
    assert (facts["id"], facts["license"]) == ("tiny.gguf", "gpl-3.0") and "general.license" in facts["license_note"]
    monkeypatch.setitem(LOCAL_MODELS, "tiny", {"sha256": file_sha256(path), "license": "apache-2.0",
                                               "base_model": "Org/Tiny-Instruct"})
    facts = base_model_facts("tiny", folder)  # a model oal fetches: oal's record of it
    assert (facts["id"], facts["license"]) == ("Org/Tiny-Instruct", "apache-2.0")
    readme = folder / "README.md"
    readme.write_text(readme.read_text().replace("license: gpl-3.0", "license: mit"))
    facts = base_model_facts("tiny", folder)  # an edited folder is quoted nowhere
    assert facts["license"] == "unknown" and "do not match the record" in facts["license_note"]
