"""The embedded default model: ships in the package, loads offline, is a GQA Qwen2 with head_dim 64 and a BPE
tokenizer, was pretrained only on the text the default plan reserves for it, and beats the unigram baseline by the
quality bar on held-out test blocks."""

from __future__ import annotations

import hashlib
import json
import math

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer, Qwen2ForCausalLM

from oal.data import bind_pretraining, default_plan, encode, load_corpus, plan_blocks
from oal.data.byte_tokenizer import byte_offset
from oal.models.registry import DEFAULT_MODEL_DIR, default_layers, load_model


@pytest.fixture(scope="module")
def loaded():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        return load_model("default")


def test_files_shipped_small_and_half_precision():
    weights = DEFAULT_MODEL_DIR / "model.safetensors"
    assert weights.stat().st_size <= 32_000_000
    assert (DEFAULT_MODEL_DIR / "tokenizer.json").stat().st_size <= 1_000_000
    with safe_open(str(weights), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"F16"}
    assert (DEFAULT_MODEL_DIR / "MODEL_CARD.md").is_file()
    summary = json.loads((DEFAULT_MODEL_DIR / "training_summary.json").read_text())
    assert summary["test"]["ppl_stored"] <= summary["test"]["ppl_unigram"] / 3


def test_architecture_and_provenance(loaded):
    model, tok, prov = loaded
    cfg = model.config
    assert isinstance(model, Qwen2ForCausalLM)
    assert cfg.head_dim == 64 and cfg.num_key_value_heads < cfg.num_attention_heads
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0
    assert next(model.parameters()).dtype == torch.float32  # fp16 on disk, upcast on load
    assert prov["source"] == "package" and prov["architecture"] == "Qwen2ForCausalLM"
    sha = hashlib.sha256((DEFAULT_MODEL_DIR / "model.safetensors").read_bytes()).hexdigest()
    assert prov["sha256"]["model.safetensors"] == sha
    assert default_layers(model) == list(range(1, cfg.num_hidden_layers - 1))


def test_tokenizer_loads_with_autotokenizer(loaded):
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR, local_files_only=True)
    assert len(tok) == loaded[0].config.vocab_size and byte_offset(tok) is None  # subword BPE, not bytes
    assert tok.convert_ids_to_tokens([0, 1, 2]) == ["<pad>", "</s>", "<unk>"]
    text = "def f(x):\n    return x  # caf\u00e9 </s>"
    ids = encode(tok, text)
    assert tok.decode(ids) == text and len(ids) < len(text.encode()) / 2  # merges: well under a token per byte
    summary = json.loads((DEFAULT_MODEL_DIR / "training_summary.json").read_text())
    assert summary["tokenizer"]["vocab"] == len(tok) and summary["config"]["context"] >= 512


def test_pretraining_range_is_the_plans_and_disjoint_from_every_role(loaded):
    """The model was pretrained on exactly the default plan's `pretrain` range of this corpus, and every role the
    pipeline uses lies outside it (check_disjoint); the recorded token hash matches this machine's tokens."""
    model, tok, prov = loaded
    summary = json.loads((DEFAULT_MODEL_DIR / "training_summary.json").read_text())
    rec, plan = summary["pretrain"], default_plan()
    assert (rec["split"], rec["block_len"], rec["first_block"]) == (plan.pretrain.split, plan.pretrain.block_len,
                                                                    plan.pretrain.indices[0])
    assert plan.pretrain.through_end and rec["heldout_head_tokens"] <= rec["token_start"]
    corpus = load_corpus("builtin")
    assert bind_pretraining(plan, prov, corpus).pretrain == plan.pretrain
    if corpus.fingerprint() == summary["corpus"]["fingerprint"]:  # same Python version as the training machine
        assert corpus.meta["pretrain_sha256"] == rec["sha256_text"]
        ids = torch.tensor(encode(tok, corpus.splits["train"]), dtype=torch.long)[rec["token_start"]:]
        assert hashlib.sha256(ids.numpy().tobytes()).hexdigest() == rec["sha256_tokens"]


def test_beats_unigram_on_test_blocks(loaded):
    model, tok, _ = loaded
    corpus = load_corpus("builtin")
    test = plan_blocks(corpus, tok, default_plan())["test"][:4]
    with torch.no_grad():
        logits = model(input_ids=test).logits[:, :-1]
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), test[:, 1:].reshape(-1))
    start = json.loads((DEFAULT_MODEL_DIR / "training_summary.json").read_text())["pretrain"]["token_start"]
    train = torch.tensor(encode(tok, corpus.splits["train"]))[start:]  # the unigram is fit on the pretraining text
    counts = torch.bincount(train, minlength=len(tok)).double() + 1
    unigram_nll = -torch.log(counts / counts.sum())[test[:, 1:]].mean()
    assert math.exp(float(nll)) <= math.exp(float(unigram_nll)) / 3


def test_generates(loaded):
    model, tok, _ = loaded
    ids = torch.tensor([encode(tok, "The ")])
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape == (1, ids.shape[1] + 8)


def test_retrieves_a_passkey_inside_its_training_context(loaded):
    """Issue 30: the shipped default recalls a passkey at 512 tokens (its training context) in the evaluation's own
    format and filler, never trained on, so `oal evaluate --passkey` measures what a conversion keeps. The prompts
    are those of `oal evaluate --passkey --lengths 512 --trials 4` (seed 0) for the softmax arm."""
    from oal.evaluate.passkey import evaluate_passkey

    model, tok, _ = loaded
    res = evaluate_passkey(model, tok, lengths=[512], trials=4, seed=0)
    assert res["by_length"]["512"] >= 0.9, res["examples"]
    recorded = json.loads((DEFAULT_MODEL_DIR / "training_summary.json").read_text())["passkey"]
    assert recorded["by_length"]["512"] >= 0.9  # what the card reports, measured on the fp32 weights at export
