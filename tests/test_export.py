"""The converted model as an artefact: export, reload through oal.load and transformers' Auto classes, the CLI.

The run directories here (`_runs.make_run`) are written by the library's own writers (save_kernels, save_adapter)
for a tiny random Llama, with random kernels and a random (non-zero) LoRA adapter, so every check can tell adapted
from calibrated and converted from softmax. lm-eval on an export: test_lm_eval_export.py; the refused routes:
test_routes.py. The round trips are exact: the saved form holds the same tensors as the model in memory.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from _runs import IDS, LAYERS, SRC, logits, make_run, random_methods
from _tiny import save_tiny_llama, tiny_model
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

import oal
from oal.adaptation.config import AdaptConfig
from oal.adaptation.train import wrap_lora
from oal.artefact.arms import calibrated_methods, load_converted
from oal.artefact.export import export
from oal.models.attention import converted_methods
from oal.models.convert import convert
from oal.models.pretrained import MANIFEST


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def run_dir(base_dir, tmp_path_factory):
    # taylorshift: calibrated, never adapted
    return make_run(tmp_path_factory.mktemp("r"), base_dir,
                    {"oal": True, "global": True, "performer": True, "taylorshift": False})


@pytest.fixture(scope="module")
def exported(run_dir, tmp_path_factory):
    return export(run_dir, "oal", tmp_path_factory.mktemp("x") / "oal")


def _same_methods(a, b):
    ma, mb = converted_methods(a), converted_methods(b)
    assert sorted(ma) == sorted(mb) == LAYERS
    for i in LAYERS:
        assert type(ma[i]) is type(mb[i])
        sa, sb = dict(ma[i].named_buffers()) | dict(ma[i].named_parameters()), \
            dict(mb[i].named_buffers()) | dict(mb[i].named_parameters())
        assert sorted(sa) == sorted(sb)
        for name, t in sa.items():
            assert t.dtype == sb[name].dtype and torch.equal(t, sb[name]), (i, name)


# ----------------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("method", ["oal", "global", "performer"])
def test_export_reloads_the_adapted_model(run_dir, tmp_path, method):
    adapted, _, info = load_converted(run_dir, method, merge=False)  # the in-memory adapted model (peft)
    assert info["adapter"] and not info["merged"]
    want = logits(adapted)
    calibrated = logits(load_converted(run_dir, method, adapter=False)[0])
    assert (want - calibrated).abs().max() > 1e-2  # the adapter matters, so the checks below can see it
    merged = adapted.merge_and_unload()
    path = export(run_dir, method, tmp_path / method)
    for reloaded in (oal.load(path), AutoModelForCausalLM.from_pretrained(path)):
        got = logits(reloaded)
        assert torch.equal(got, logits(merged))  # the saved form is exactly the merged model
        assert (got - want).abs().max() < 1e-5  # merging LoRA into the weights only rounds
        _same_methods(reloaded, merged)  # performer: its random features come back bit for bit (fp64)


def test_unmerged_export_keeps_the_adapter_separate(run_dir, tmp_path):
    adapted, _, _ = load_converted(run_dir, "oal", merge=False)
    path = export(run_dir, "oal", tmp_path / "unmerged", merge=False)
    assert (path / "adapter_model.safetensors").is_file() and not (path / "adapter_config.json").exists()
    assert json.loads((path / "config.json").read_text())["oal"]["lora"]["peft_type"] == "LORA"
    reloaded = oal.load(path)  # oal's class attaches the adapter recorded in config.json
    assert getattr(reloaded, "_hf_peft_config_loaded", False)
    assert torch.equal(logits(reloaded), logits(adapted))
    with pytest.raises(ValueError, match="would save only its LoRA adapter"):
        reloaded.save_pretrained(tmp_path / "again")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_base_keeps_fp32_kernels(base_dir, tmp_path, dtype):
    half = tmp_path / "base"
    AutoModelForCausalLM.from_pretrained(base_dir, dtype=dtype).save_pretrained(half)
    AutoTokenizer.from_pretrained(base_dir).save_pretrained(half)
    run = make_run(tmp_path, half, {"oal": True, "global": False}, dtype=str(dtype).removeprefix("torch."))
    for method in ("oal", "global"):
        model, _, info = load_converted(run, method)  # the run's dtype
        assert bool(info["adapter"]) == (method == "oal")
        path = export(run, method, tmp_path / method, adapter=method == "oal")
        reloaded = oal.load(path)
        for m in (model, reloaded):
            assert m.model.embed_tokens.weight.dtype == dtype
            assert all(p.dtype == torch.float32 for p in converted_methods(m)[1].parameters())
        assert torch.equal(logits(reloaded), logits(model))
        _same_methods(reloaded, model)


def test_reload_under_another_dtype(exported):
    ref = oal.load(exported)
    reloaded = oal.load(exported, dtype=torch.bfloat16)
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    _same_methods(reloaded, ref)  # kernels keep their own dtype (fp32 factor, int64 groups)
    with torch.no_grad():  # the same cast by hand: base weights to bf16, kernels untouched
        for name, p in ref.named_parameters():
            if ".oal_method." not in name:
                p.data = p.data.to(torch.bfloat16)
    assert torch.equal(logits(reloaded), logits(ref))


def test_generate_after_reload(run_dir, exported):
    model, _, _ = load_converted(run_dir, "oal")
    reloaded = oal.load(exported)
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    want = model.generate(IDS, **kw)
    assert torch.equal(reloaded.generate(IDS, **kw), want)
    assert torch.equal(reloaded.generate(IDS, use_cache=False, **kw), want)


@pytest.mark.parametrize("family,method,kwargs", [
    ("qwen2", "oal", {"eps": 1e-5}), ("qwen2", "global", {}), ("qwen2", "performer", {"n_features": 16}),
    ("qwen2", "spectraformer", {"chunk_size": 8}), ("qwen2", "dijiang", {}), ("qwen2", "taylorshift", {}),
    ("llama", "oal", {}), ("mistral", "oal", {}), ("qwen3", "oal", {}),
])
def test_save_pretrained_roundtrip(tmp_path, family, method, kwargs):
    model = tiny_model(family, 300)
    cfg = model.config
    convert(model, LAYERS, random_methods(method, cfg.num_attention_heads, cfg.num_key_value_heads,
                                           getattr(cfg, "head_dim", None) or 8, seed=3, **kwargs))
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(reloaded) is type(model) and reloaded.config.model_type == f"oal_{family}"
    assert torch.equal(logits(reloaded), logits(model))
    _same_methods(reloaded, model)  # non-persistent buffers (SpectraFormer's Hadamard matrix) rebuilt exactly
    reloaded.save_pretrained(tmp_path / "again")  # a reloaded model saves the same form again
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(tmp_path / "again")), logits(model))


def test_merged_peft_model_save_pretrained_keeps_the_kernels(tmp_path):
    """The issue's case: merge_and_unload, save_pretrained, from_pretrained used to give back softmax attention."""
    model = tiny_model("qwen2", 300)
    softmax = logits(model)
    convert(model, LAYERS, random_methods("oal", 6, 2, 8, seed=5))
    peft_model, _ = wrap_lora(model, AdaptConfig(lora_r=2, lora_dropout=0.0))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(logits(reloaded), logits(merged))
    assert (logits(reloaded) - softmax).abs().max() > 1e-2


# ----------------------------------------------------------------------------------------------- refusals


def test_tampered_or_missing_files_are_refused(exported, tmp_path):
    for name in ("model.oal.safetensors", "config.json", "tokenizer_config.json"):
        bad = tmp_path / name
        bad.mkdir()
        for f in exported.iterdir():
            (bad / f.name).write_bytes(f.read_bytes())
        data = bytearray((bad / name).read_bytes())
        if name == "tokenizer_config.json":  # bound by content, all but model_max_length (test_routes.py)
            data = bytearray(json.dumps({**json.loads(data), "padding_side": "left", "x": 1}).encode())
        elif name.endswith(".json"):
            data += b"\n"  # still valid JSON, so the hash check (not the parser) must refuse it
        else:
            data[len(data) // 2] ^= 1
        (bad / name).write_bytes(bytes(data))
        for load in (oal.load, AutoModelForCausalLM.from_pretrained):
            with pytest.raises(ValueError, match=rf"{name}: SHA256 does not match oal.json"):
                load(bad)
    (bad / MANIFEST).unlink()
    with pytest.raises(ValueError, match="oal.json: missing"):
        oal.load(bad)
    (bad / MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match="oal.json: not valid JSON"):
        oal.load(bad)


def test_files_added_to_an_export_are_refused(exported, tmp_path):
    """An export records its whole folder, tokenizer included: a special_tokens_map.json added later (transformers
    reads it beside the recorded tokenizer files: it changed how "def main(" was tokenized) or an added adapter is
    refused; its model card and sampling defaults stay free, as do hidden files (.gitattributes)."""
    for name, text in (("special_tokens_map.json", '{"eos_token": "main"}'), ("chat_template.jinja", "{{ x }}"),
                       ("adapter_config.json", "{}")):
        bad = tmp_path / name
        shutil.copytree(exported, bad)
        (bad / name).write_text(text)
        for load in (oal.load, AutoModelForCausalLM.from_pretrained):
            with pytest.raises(ValueError, match=rf"{name}: not recorded in oal.json \(added to the folder"):
                load(bad)
    free = tmp_path / "free"
    shutil.copytree(exported, free)
    for name in ("README.md", "generation_config.json", ".gitattributes"):
        (free / name).write_text("{}" if name.endswith(".json") else "edited")
    oal.load(free)


def test_foreign_folders_are_refused(base_dir, tmp_path):
    with pytest.raises(ValueError, match="model_type 'llama' is not a converted model"):
        oal.load(base_dir)
    with pytest.raises(ValueError, match="config.json: missing"):
        oal.load(tmp_path)


def test_run_errors_name_the_file(run_dir, tmp_path):
    assert calibrated_methods(run_dir) == ["oal", "global", "performer", "taylorshift"]
    with pytest.raises(ValueError, match=r"method: the run did not calibrate 'dijiang' \(.*kernels/dijiang/kernels."
                                         r"json is missing"):
        load_converted(run_dir, "dijiang")
    with pytest.raises(ValueError, match=r"adapter/taylorshift/oal_adapter.json is missing"):
        export(run_dir, "taylorshift", tmp_path / "t", adapter=True)  # required
    assert not (tmp_path / "t").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="to: .* exists and is not a converted-model folder"):
        export(run_dir, "oal", mine)
    assert (mine / "notes.txt").read_text() == "keep me"


# ---------------------------------------------------------------------------------------- import and registration


def _python(code: str, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=600)


def test_import_oal_stays_light():
    res = _python("import sys, oal; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stderr


def test_registered_families_are_the_supported_ones():
    from oal.models.auto import FAMILIES
    from oal.models.families import SUPPORTED_ARCHITECTURES

    assert set(FAMILIES) == set(SUPPORTED_ARCHITECTURES)


def test_transformers_alone_refuses_then_import_oal_registers(exported):
    code = """
import sys
from transformers import AutoModelForCausalLM
assert "oal" not in sys.modules
try:
    AutoModelForCausalLM.from_pretrained(sys.argv[1])
    print("loaded")
except ValueError as exc:
    print("refused", "oal_llama" in str(exc))
import oal  # the Auto classes are already imported: registers at once
print(type(AutoModelForCausalLM.from_pretrained(sys.argv[1])).__name__)
"""
    res = _python(code, exported)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["refused", "True", "OALLlamaForCausalLM"], res.stdout


def test_acceptance_cli_export_and_fresh_interpreters(run_dir, base_dir, tmp_path):
    """issue 12: export from the CLI; plain transformers raises; after `import oal` the Auto route gives the
    same logits as oal.load, and they differ from the softmax base model's."""
    from oal.cli import load_commands

    dest = tmp_path / "export"
    res = CliRunner().invoke(load_commands(), ["export", "--out", str(run_dir), "--method", "oal", "--to", str(dest)])
    assert res.exit_code == 0, res.output
    plain = _python("import sys\nfrom transformers import AutoModelForCausalLM\n"
                    "AutoModelForCausalLM.from_pretrained(sys.argv[1])", dest)
    assert plain.returncode != 0 and "oal_llama" in plain.stderr
    code = """
import json, sys, torch
import oal
from transformers import AutoModelForCausalLM
ids = torch.tensor([[5, 17, 99, 3, 250, 41, 7, 7, 130, 64, 12, 200, 33]])
with torch.no_grad():
    auto = AutoModelForCausalLM.from_pretrained(sys.argv[1])(ids).logits
    lib = oal.load(sys.argv[1])(ids).logits
    base = AutoModelForCausalLM.from_pretrained(sys.argv[2])(ids).logits
print(json.dumps({"vs_load": float((auto - lib).abs().max()), "vs_softmax": float((auto - base).abs().max())}))
"""
    res = _python(code, dest, base_dir)
    assert res.returncode == 0, res.stderr
    diffs = json.loads(res.stdout.strip().splitlines()[-1])
    assert diffs["vs_load"] <= 1e-4 and diffs["vs_softmax"] > 1e-2, diffs


# ----------------------------------------------------------------------------------------------- command line


@pytest.fixture(scope="module")
def cli():
    from oal.cli import load_commands

    app = load_commands()
    return lambda *args: CliRunner().invoke(app, [str(a) for a in args])


def _text(res) -> str:
    return " ".join(res.output.replace("│", " ").split())  # rich wraps long lines in a box


def test_cli_bad_input_is_one_clean_line(cli, run_dir, tmp_path):
    cases = {
        ("export", "--out", run_dir, "--method", "taylorshift", "--adapter", "--to", tmp_path / "a"):
            "oal_adapter.json",
        # softmax exports from an `oal run` directory (tests/test_recipe.py); this one has no config.json
        ("export", "--out", run_dir, "--method", "softmax", "--to", tmp_path / "b"): "config.json: missing",
        ("export", "--out", tmp_path / "nowhere", "--to", tmp_path / "c"): "not a directory",
        ("export", "--out", run_dir, "--to", tmp_path / "d", "--dtype", "int8"): "float32, float16 or bfloat16",
        ("generate", "hi", "--out", run_dir, "--method", "taylorshift", "--adapter"): "oal_adapter.json",
        ("convert", "--out", run_dir, "--method", "dijiang"): "did not calibrate 'dijiang'",
    }
    for args, msg in cases.items():
        res = cli(*args)
        assert res.exit_code == 2 and msg in _text(res), (args, res.output)
        assert "Traceback" not in res.output
    # the option to change is the one named: --adapter requires the run's adapter
    res = cli("export", "--out", run_dir, "--method", "taylorshift", "--adapter", "--to", tmp_path / "a")
    assert res.exit_code == 2 and "Invalid value for '--adapter'" in _text(res), res.output
    assert "pass --no-adapter" in _text(res), res.output
    res = cli("export", "--out", run_dir, "--method", "taylorshift", "--no-adapter", "--to", tmp_path / "e",
              "--dtype", "bfloat16")
    assert res.exit_code == 0 and (tmp_path / "e" / MANIFEST).is_file(), res.output
    reloaded = oal.load(tmp_path / "e")
    assert reloaded.model.embed_tokens.weight.dtype == torch.bfloat16
    assert converted_methods(reloaded)[1].tau.dtype == torch.float32


def test_cli_commands_take_the_adapter_by_default(cli, run_dir, tmp_path):
    res = cli("convert", "--out", run_dir, "--method", "global", "--export", tmp_path / "g")
    assert res.exit_code == 0 and "LoRA adapter (merged)" in _text(res), res.output
    assert torch.equal(logits(oal.load(tmp_path / "g")), logits(load_converted(run_dir, "global")[0]))
    res = cli("convert", "--out", run_dir, "--method", "global", "--no-adapter")
    assert res.exit_code == 0 and "calibrated kernels only (adapter left out)" in _text(res), res.output
    adapted = cli("generate", "abc", "--out", run_dir, "--max-new-tokens", "6")
    plain = cli("generate", "abc", "--out", run_dir, "--max-new-tokens", "6", "--no-adapter")
    assert adapted.exit_code == 0 and plain.exit_code == 0, adapted.output + plain.output
    assert "LoRA adapter" in _text(adapted) and "calibrated kernels only" in _text(plain)
    res = cli("evaluate", "--out", run_dir, "--methods", "oal,taylorshift", "--blocks", "1")
    assert res.exit_code == 0, res.output
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert set(metrics["fidelity_adapted"]) == {"oal"} and set(metrics["fidelity"]) == {"taylorshift"}
    res = cli("evaluate", "--out", run_dir, "--methods", "oal", "--blocks", "1", "--no-adapter")
    assert res.exit_code == 0, res.output
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["fidelity"]["oal"]["relmse"] != metrics["fidelity_adapted"]["oal"]["relmse"]
