"""Every route to an exported converted model or to a run's adapter loads the converted model or refuses loudly;
none gives the softmax model (issue 27). And the manifests' rules (issue 28): file names confined to their folder,
safetensors only, routine edits (generation_config.json, README.md) allowed, the model card.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from _runs import LAYERS, logits, make_run, random_methods
from _tiny import save_tiny_llama, tiny_model
from peft import AutoPeftModelForCausalLM, LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, LlamaForCausalLM, Qwen2ForCausalLM

import oal
from oal.adaptation.adapter import ADAPTER_MANIFEST, check_adapter, load_adapter
from oal.artefact.arms import adapter_dir, load_converted
from oal.artefact.export import export
from oal.models.convert import convert
from oal.models.pretrained import MANIFEST


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    root = tmp_path_factory.mktemp("routes")
    base = save_tiny_llama(root / "base")
    run = make_run(root, base, {"oal": True})
    return {"base": base, "run": run, "adapter": adapter_dir(run, "oal"),
            "merged": export(run, "oal", root / "merged"), "unmerged": export(run, "oal", root / "unmerged",
                                                                                merge=False)}


def _softmax(art):
    return AutoModelForCausalLM.from_pretrained(art["base"])


REFUSED = {
    "family class, merged export": (lambda a: LlamaForCausalLM.from_pretrained(a["merged"]), OSError,
                                    "no file named model.safetensors"),
    "family class, unmerged export": (lambda a: LlamaForCausalLM.from_pretrained(a["unmerged"]), OSError,
                                      "no file named model.safetensors"),
    "PeftModel on softmax, run adapter": (lambda a: PeftModel.from_pretrained(_softmax(a), a["adapter"]),
                                          ValueError, "Can't find 'adapter_config.json'"),
    "PeftModel on softmax, unmerged export": (lambda a: PeftModel.from_pretrained(_softmax(a), a["unmerged"]),
                                              ValueError, "Can't find 'adapter_config.json'"),
    "AutoPeftModel, unmerged export": (lambda a: AutoPeftModelForCausalLM.from_pretrained(a["unmerged"]),
                                       ValueError, "Can't find 'adapter_config.json'"),
    "AutoPeftModel, run adapter": (lambda a: AutoPeftModelForCausalLM.from_pretrained(a["adapter"]), ValueError,
                                   "Can't find 'adapter_config.json'"),
    "Auto class, run adapter": (lambda a: AutoModelForCausalLM.from_pretrained(a["adapter"]), ValueError,
                                "Unrecognized model"),
}


@pytest.mark.parametrize("route", list(REFUSED))
def test_softmax_routes_refuse(art, route):
    load, error, message = REFUSED[route]
    with pytest.raises(error, match=message):
        load(art)


def test_family_class_refuses_a_converted_qwen2(tmp_path):
    """The acceptance route, on the family of the default model: Qwen2ForCausalLM on a converted folder."""
    model = convert(tiny_model("qwen2", 300), LAYERS, random_methods("oal", 6, 2, 8, seed=1))
    model.save_pretrained(tmp_path)
    with pytest.raises(OSError, match="no file named model.safetensors"):
        Qwen2ForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path)), logits(model))
    with pytest.raises(ValueError, match="variant: a converted model's weights are"):
        AutoModelForCausalLM.from_pretrained(tmp_path, variant="fp16")


def test_supported_routes_give_the_converted_model(art):
    merged, _, _ = load_converted(art["run"], "oal")
    adapted, _, _ = load_converted(art["run"], "oal", merge=False)
    want_merged, want_adapted, softmax = logits(merged), logits(adapted), logits(_softmax(art))
    assert (want_adapted - softmax).abs().max() > 1e-2
    for load in (oal.load, AutoModelForCausalLM.from_pretrained):
        assert torch.equal(logits(load(art["merged"])), want_merged)
        assert torch.equal(logits(load(art["unmerged"])), want_adapted)  # converted + trained kernels + LoRA
    # the run's adapter through oal's loader on the run's converted model (what convert/generate/evaluate use)
    calibrated, _, _ = load_converted(art["run"], "oal", adapter=False)
    assert torch.equal(logits(load_adapter(calibrated, art["adapter"])), want_adapted)
    with pytest.raises(ValueError, match="trained on another model"):
        load_adapter(_softmax(art), art["adapter"])


def test_no_route_uses_transformers_adapter_mixin(art, tmp_path, monkeypatch):
    """peft's floor (issue 28): transformers 5.x's adapter mixin (`model.load_adapter`, `active_adapters()`, adapter
    detection in from_pretrained, save_pretrained of a model carrying one) checks for peft >= 0.22, which is not
    installable here; oal attaches LoRA through peft's own API, so its routes hold with the floor in pyproject (the
    version tested). Any call into the mixin fails this test, whatever peft is installed."""
    import peft
    import transformers.integrations.peft as hf_peft
    from packaging.requirements import Requirement
    from packaging.version import Version

    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    (floor,) = [r for r in map(Requirement, pyproject["project"]["dependencies"]) if r.name == "peft"]
    assert Version(peft.__version__) in floor.specifier
    if Version(peft.__version__) < Version(hf_peft.MIN_PEFT_VERSION):  # the mixin really is out of reach here
        with pytest.raises(ValueError, match="version of PEFT"):
            hf_peft.check_peft_version(hf_peft.MIN_PEFT_VERSION)

    def mixin(*args, **kwargs):
        raise AssertionError("transformers' adapter mixin was used")

    monkeypatch.setattr(hf_peft, "check_peft_version", mixin)
    with pytest.raises(AssertionError, match="mixin was used"):  # the patch bites
        _softmax(art).active_adapters()
    adapted, _, _ = load_converted(art["run"], "oal", merge=False)
    unmerged = export(art["run"], "oal", tmp_path / "unmerged", merge=False)  # saving an unmerged LoRA
    for load in (oal.load, AutoModelForCausalLM.from_pretrained):
        assert torch.equal(logits(load(unmerged)), logits(adapted))


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def test_routine_edits_keep_the_export_loadable(art, tmp_path):
    path = _copy(art["unmerged"], tmp_path / "x")
    manifest = json.loads((path / MANIFEST).read_text())
    assert "README.md" not in manifest["sha256"] and "generation_config.json" not in manifest["sha256"]
    assert {"config.json", "model.oal.safetensors", "adapter_model.safetensors"} <= set(manifest["sha256"])
    gen = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**gen, "max_new_tokens": 7, "temperature": 0.5}))
    (path / "README.md").write_text("---\nlicense: mit\n---\n# edited by hand\n")
    assert torch.equal(logits(oal.load(path)), logits(oal.load(art["unmerged"])))
    (path / "config.json").write_text((path / "config.json").read_text().replace('"r": 2', '"r": 3'))
    with pytest.raises(ValueError, match="config.json: SHA256 does not match oal.json"):
        oal.load(path)


def test_tokenizer_max_length_is_true_and_may_be_edited(art, tmp_path):
    """The export's tokenizer says the model's true length (not transformers' 1e30); editing model_max_length keeps
    the folder loadable, editing what changes the numbers does not."""
    path = _copy(art["merged"], tmp_path / "x")
    tok_config = path / "tokenizer_config.json"
    data = json.loads(tok_config.read_text())
    positions = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    assert data["model_max_length"] == positions
    tok_config.write_text(json.dumps({**data, "model_max_length": 64}, indent=4))
    assert torch.equal(logits(oal.load(path)), logits(oal.load(art["merged"])))
    tok_config.write_text(json.dumps({**data, "add_bos_token": not data.get("add_bos_token", False)}))
    with pytest.raises(ValueError, match="tokenizer_config.json: SHA256 does not match oal.json"):
        oal.load(path)


def test_model_card(art):
    from huggingface_hub import ModelCard

    card = ModelCard.load(art["merged"] / "README.md")
    assert card.data.library_name == "oal" and "oal" in card.data.tags
    assert card.data.base_model == art["base"].name and card.data.license == "unknown"  # a local base: its name
    assert card.data.pipeline_tag == "text-generation"
    text = card.text
    assert "pip install oal-attention" in text and "import oal" in text and f"Attention layers {LAYERS}" in text
    assert str(art["run"].resolve()) not in text and str(art["base"].resolve()) not in text
    assert "merged into the weights" in text and "python -m oal.lm_eval" in text


def test_card_metrics_and_hub_base_model(art):
    from huggingface_hub import ModelCard

    from oal.artefact.card import card_metrics, card_text

    metrics = {"perplexity": {"softmax": 10.0, "oal": 11.5}, "perplexity_no_adapt": {"oal": 14.0},
               "fidelity_adapted": {"oal": {"relmse": 0.01, "relmse_post_o": 0.02, "mse": 1.0}},
               "zeroshot": {"oal": {"piqa": {"acc": 60.0, "acc_norm": 61.0, "n": 100, "acc_norm_lmeval": 1}}}}
    rows = card_metrics(metrics, "oal", adapted=True)
    assert rows == {"perplexity (test blocks)": "softmax 10, oal 11.5",
                    "attention fidelity (relative MSE)": "relmse 0.01, relmse_post_o 0.02",
                    "zero-shot piqa, oal (%)": "acc 60, acc_norm (paper) 61, acc_norm (lm-eval, per "
                                                          "character) 1, n 100"}
    assert card_metrics(metrics, "oal", adapted=False) == {"perplexity (test blocks)": "oal 14"}
    model = oal.load(art["merged"])
    from oal.artefact.base_facts import base_model_facts

    card = ModelCard(card_text(model, {"base": base_model_facts("Qwen/Qwen2.5-0.5B", None)}, rows))
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B" and "| perplexity (test blocks) | softmax 10, oal 11.5 |" in \
        card.text


# ----------------------------------------------------------------------------------------------- manifests


def _relist(folder: Path, manifest: str, name: str, digest: str = "0" * 64) -> None:
    data = json.loads((folder / manifest).read_text())
    data["sha256"][name] = digest
    (folder / manifest).write_text(json.dumps(data))


@pytest.mark.parametrize("name,message", [("../../x", "not a plain relative path"),
                                          ("/etc/hostname", "not a plain relative path"),
                                          ("sub/../../x", "not a plain relative path"),
                                          ("link", "leads outside")])
def test_manifest_names_are_confined_to_their_folder(art, tmp_path, name, message):
    outside = tmp_path / "outside.json"
    outside.write_text("{}")
    export_dir, adapter = _copy(art["merged"], tmp_path / "e"), _copy(art["adapter"], tmp_path / "a")
    for folder, manifest, load in ((export_dir, MANIFEST, oal.load), (adapter, ADAPTER_MANIFEST, check_adapter)):
        (folder / "link").symlink_to(outside)
        _relist(folder, manifest, name)
        with pytest.raises(ValueError, match=message):
            load(folder)


def test_pickle_files_are_refused_and_never_opened(art, tmp_path, monkeypatch):
    def no_unpickling(*args, **kwargs):
        raise AssertionError("torch.load was called")

    monkeypatch.setattr(torch, "load", no_unpickling)
    export_dir, adapter = _copy(art["merged"], tmp_path / "e"), _copy(art["adapter"], tmp_path / "a")
    for folder, manifest, name, load, message in (
            (export_dir, MANIFEST, "pytorch_model.bin", oal.load, "a pickle file"),
            (adapter, ADAPTER_MANIFEST, "adapter_model.bin", check_adapter, "a pickle file")):
        (folder / name).write_bytes(b"not really a pickle")
        _relist(folder, manifest, name)
        with pytest.raises(ValueError, match=message):
            load(folder)


def test_an_adapter_recorded_as_a_pickle_is_refused_as_one(art, tmp_path):
    """A manifest that records adapter_model.bin instead of the safetensors: the refusal says pickle, and why."""
    adapter = _copy(art["adapter"], tmp_path / "a")
    data = json.loads((adapter / ADAPTER_MANIFEST).read_text())
    data["sha256"]["adapter_model.bin"] = data["sha256"].pop("adapter_model.safetensors")
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    (adapter / ADAPTER_MANIFEST).write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"records 'adapter_model.bin', a pickle file; .* unpickling a file can run"):
        check_adapter(adapter)


def test_softmax_twin_of_an_unmerged_export_is_the_merged_ones(art):
    """The softmax reference of an unmerged export merges its attached LoRA (it failed on the state-dict keys)."""
    from oal.artefact.export import softmax_twin

    unmerged = oal.load(art["unmerged"])
    twin = softmax_twin(unmerged, str(art["base"]))
    assert torch.equal(logits(twin), logits(softmax_twin(oal.load(art["merged"]), str(art["base"]))))
    assert not torch.equal(logits(twin), logits(_softmax(art)))  # the LoRA is in it
    assert any("lora_A" in k for k in unmerged.state_dict())  # and the converted model keeps its own


def test_adapter_format_v1_is_still_read(art, tmp_path):
    """An adapter folder of an earlier oal (a peft folder: adapter_config.json, no LoRA config in the manifest)."""
    from oal.rundir.hashes import sha256_file

    old = _copy(art["adapter"], tmp_path / "v1")
    manifest = json.loads((old / ADAPTER_MANIFEST).read_text())
    LoraConfig(**manifest.pop("lora")).save_pretrained(old)  # peft's adapter_config.json
    manifest["format"] = "oal-adapter/1"
    (old / "README.md").write_text("---\nlibrary_name: peft\n---\n")  # peft's card, listed by oal then
    for name in ("adapter_config.json", "README.md"):
        manifest["sha256"][name] = sha256_file(old / name)
    (old / ADAPTER_MANIFEST).write_text(json.dumps(manifest))
    calibrated = load_converted(art["run"], "oal", adapter=False)[0]
    want = logits(load_adapter(load_converted(art["run"], "oal", adapter=False)[0], art["adapter"]))
    assert torch.equal(logits(load_adapter(calibrated, old)), want)


@pytest.mark.parametrize("name", ["adapter_config.json", "model.safetensors", "pytorch_model.bin",
                                  "model.safetensors.index.oal.json"])
def test_weights_or_adapters_added_later_are_refused(art, tmp_path, name):
    """transformers would read these (an added adapter_config.json would even attach a LoRA): not in oal.json."""
    path = _copy(art["merged"], tmp_path / "x")
    if name == "adapter_config.json":
        LoraConfig(r=2, target_modules=["q_proj"]).save_pretrained(path)
    else:
        (path / name).write_bytes(b"{}")
    with pytest.raises(ValueError, match=rf"{name}: not recorded in oal.json"):
        oal.load(path)


def test_old_export_format_is_refused_with_what_to_do(art, tmp_path):
    path = _copy(art["merged"], tmp_path / "old")
    data = json.loads((path / MANIFEST).read_text())
    (path / MANIFEST).write_text(json.dumps({**data, "format": "oal-model/1"}))
    with pytest.raises(ValueError, match=r"oal-model/1.*write it again with `oal export`"):
        oal.load(path)


def test_a_foreign_peft_folder_is_refused(tmp_path):
    LoraConfig(r=2, target_modules=["q_proj"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="a peft folder without oal_adapter.json"):
        check_adapter(tmp_path)


def test_unmerged_lora_must_fit(art, tmp_path):
    from safetensors.torch import load_file, save_file

    from oal.models.pretrained import write_manifest

    path = _copy(art["unmerged"], tmp_path / "u")
    tensors = load_file(str(path / "adapter_model.safetensors"))
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, str(path / "adapter_model.safetensors"))
    write_manifest(path, json.loads((path / MANIFEST).read_text())["source"])  # consistent hashes, missing tensor
    assert "lora_" in dropped
    with pytest.raises(ValueError, match="adapter_model.safetensors does not fit the LoRA adapter"):
        oal.load(path)
