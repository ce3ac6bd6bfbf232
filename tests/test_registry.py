"""Model registry: local folders, provenance from real file hashes, Base-vs-Instruct check, offline hub errors."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, Qwen2Config, Qwen2ForCausalLM

from oal.data.byte_tokenizer import byte_tokenizer
from oal.models.folders import ModelUnavailableError
from oal.models.registry import HUB_MODELS, PRESETS, default_layers, identify, load_model, preset_for


def _tiny_dir(path, layers=3):
    cfg = Qwen2Config(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    return path


def test_local_folder_with_provenance(tmp_path):
    path = _tiny_dir(tmp_path / "tiny")
    model, tok, prov = load_model(str(path))
    assert isinstance(model, Qwen2ForCausalLM) and not model.training
    assert prov["source"] == "local" and prov["identified_as"] is None
    sha = hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
    assert prov["sha256"]["model.safetensors"] == sha
    assert "config.json" in prov["sha256"] and "tokenizer_config.json" in prov["sha256"]
    assert tok("ab", add_special_tokens=False)["input_ids"] == [ord("a") + 3, ord("b") + 3]
    model16, _, prov16 = load_model(path, dtype=torch.bfloat16)
    assert next(model16.parameters()).dtype == torch.bfloat16 and prov16["dtype"] == "bfloat16"


def _fake_qwen_dir(path, eos):
    """A folder whose config has Qwen2.5-0.5B's shape; its weight file is not the pinned one."""
    path.mkdir()
    base = HUB_MODELS["Qwen/Qwen2.5-0.5B"]["base_config"]
    (path / "config.json").write_text(json.dumps({**base, "eos_token_id": eos}))
    save_file({"w": torch.zeros(4)}, str(path / "model.safetensors"))
    return path


def test_instruct_config_is_not_base(tmp_path):
    instruct = _fake_qwen_dir(tmp_path / "instruct", eos=151645)
    hub_id, evidence = identify(instruct)
    assert hub_id is None
    assert evidence["Qwen/Qwen2.5-0.5B"]["config.eos_token_id"] is False
    with pytest.raises(ValueError, match="not the pinned Qwen/Qwen2.5-0.5B"):
        load_model(instruct, expect="Qwen/Qwen2.5-0.5B")


def test_base_config_with_other_weights_is_not_base(tmp_path):
    fake = _fake_qwen_dir(tmp_path / "fake", eos=151643)
    hub_id, evidence = identify(fake)
    checks = evidence["Qwen/Qwen2.5-0.5B"]
    assert hub_id is None and checks["config.eos_token_id"] is True
    assert checks["model.safetensors.size"] is False and checks["model.safetensors.sha256"] is False
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(fake, expect="Qwen/Qwen2.5-0.5B")


def test_offline_hub_fails_fast(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelUnavailableError, match="Qwen/Qwen2.5-0.5B@060db649"):
        load_model("Qwen/Qwen2.5-0.5B")
    with pytest.raises(ValueError, match="revision="):
        load_model("someone/unpinned-model")
    with pytest.raises(ValueError, match="name_or_path"):
        load_model("no-such-model")
    with pytest.raises(ValueError, match="dtype"):
        load_model("default", dtype="float32")


def test_default_layers_and_presets():
    qwen = Qwen2Config(num_hidden_layers=24, hidden_size=896, num_attention_heads=14, num_key_value_heads=2)
    llama = LlamaConfig(num_hidden_layers=16, hidden_size=2048, num_attention_heads=32, num_key_value_heads=8)
    assert default_layers(qwen) == list(range(3, 21)) and preset_for(qwen) == "qwen2.5-0.5b"
    assert default_layers(llama) == list(range(1, 15)) and preset_for(llama) == "llama-3.2-1b"
    assert default_layers(Qwen2Config(num_hidden_layers=6)) == [1, 2, 3, 4]
    assert default_layers(Qwen2Config(num_hidden_layers=2)) == [0, 1]
    assert (PRESETS["qwen2.5-0.5b"]["alpha"], PRESETS["qwen2.5-0.5b"]["gamma"]) == (0.25, 0.9)
    assert (PRESETS["llama-3.2-1b"]["alpha"], PRESETS["llama-3.2-1b"]["gamma"]) == (0.5, 0.5)
    for p in PRESETS.values():
        assert p["tau"] == 1.5 and p["min_groups"] == 2 and p["n_prompts"] == 40


def test_the_papers_table_layers_and_representative_head():
    """Sec. 5.1: Tables 1-2 on all query heads of Qwen2.5-0.5B's Layers 4, 12 and 20; App. B: Fig. 2's head is
    zero-based Layer 4, Head 0. Other presets: every converted layer and the first one's head 0."""
    from oal.models.registry import representative_head, table_layers

    assert table_layers("qwen2.5-0.5b", range(3, 21)) == [4, 12, 20]
    assert table_layers("qwen2.5-0.5b", [3, 4, 5]) is None  # the run did not convert all three
    assert table_layers("llama-3.2-1b", range(1, 15)) is None and table_layers("default", [1, 2]) is None
    assert representative_head("qwen2.5-0.5b", range(3, 21)) == (4, 0)
    assert representative_head("qwen2.5-0.5b", [7, 5]) == (5, 0)
    assert representative_head("smollm2-135m", range(3, 27)) == (3, 0)
