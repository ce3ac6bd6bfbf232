"""Passkey retrieval: deterministic prompts, exact-match scoring, and a planted retriever the check can tell apart."""

from __future__ import annotations

import pytest
import torch
from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

from oal.evaluate.passkey import Template, default_lengths, evaluate_passkey, make_prompt, score_answer
from oal.methods import build_method
from oal.models.convert import convert

TOK = ByT5Tokenizer(extra_ids=0)
# A short format so that a tiny model learns it in seconds: find the digit after "k", repeat it, then ".".
SHORT = Template(intro="", filler=" ab", needle=" k{key}.", question=" k")


def test_prompt_is_deterministic_and_sized():
    a = make_prompt(TOK, 600, 0.5, seed=3, trial=1)
    b = make_prompt(TOK, 600, 0.5, seed=3, trial=1)
    assert a == b
    assert len(a.answer) == 5 and a.answer.isdigit()
    unit = len(TOK(" The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.",
                   add_special_tokens=False)["input_ids"])
    assert 600 - unit < a.length <= 600 and len(a.input_ids) == a.length
    keys = {make_prompt(TOK, 600, 0.5, seed=3, trial=t).answer for t in range(8)}
    assert len(keys) > 1  # trials draw different keys


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_needle_depth(depth):
    p = make_prompt(TOK, 100, depth, template=SHORT, digits=2)
    text = TOK.decode(p.input_ids)
    at = text.index(f"k{p.answer}.") / len(text)
    assert abs(at - depth) < 0.1 and text.endswith(" k")


def test_exact_match_on_the_generated_digits():
    assert score_answer("12345. Remember", "12345")
    assert score_answer(" is 12345", "12345")
    assert not score_answer("123456", "12345")
    assert not score_answer("1234 5", "12345")
    assert not score_answer("the key", "12345")


def test_default_lengths():
    assert default_lengths(4096) == [1024, 2048, 4096]
    assert default_lengths(32768)[-1] == 32768 and default_lengths(32768)[0] == 1024
    assert default_lengths(512) == [128, 256, 512]
    assert default_lengths(4096, reserve=10) == [1024, 2048, 4086]  # room for the answer inside the positions


def test_bad_input():
    with pytest.raises(ValueError, match="depth"):
        make_prompt(TOK, 600, 1.5)
    with pytest.raises(ValueError, match="length"):
        make_prompt(TOK, 50, 0.5)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64))
    with pytest.raises(ValueError, match="positions") as exc:
        evaluate_passkey(model, TOK, lengths=[64], template=SHORT, digits=1)
    assert exc.value.param == "--lengths"  # the CLI names its option, not the library's "lengths:"
    with pytest.raises(ValueError, match="trials"):
        evaluate_passkey(model, TOK, lengths=[32], template=SHORT, digits=1, trials=0)


def _train_retriever(steps: int = 220) -> LlamaForCausalLM:
    """A 2-layer model trained in the test to copy the one-digit key (loss on the answer only)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(steps):
        rows = []
        for b in range(16):
            p = make_prompt(TOK, 48, ((step * 16 + b) % 9) / 8, seed=1000 + step, trial=b, digits=1,
                            template=SHORT)
            rows.append(p.input_ids + TOK(p.answer + ".", add_special_tokens=False)["input_ids"])
        x = torch.tensor(rows)
        labels = torch.full_like(x, -100)
        labels[:, -2:] = x[:, -2:]
        model(input_ids=x, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def test_planted_retriever_passes_and_blind_attention_fails():
    model = _train_retriever()
    kw = dict(lengths=[48, 96], depths=[0.0, 0.5, 1.0], trials=4, digits=1, template=SHORT, seed=7)
    ok = evaluate_passkey(model, TOK, **kw)
    assert ok["mean"] >= 0.9, ok["accuracy"]
    assert set(ok["accuracy"]) == {"48", "96"} and set(ok["by_depth"]) == {"0", "0.5", "1"}
    # the same model with attention that cannot focus (a constant kernel: every key weighs the same) cannot retrieve
    blind = {}
    for i in range(2):
        m = build_method("global", 2, 1, 16, layer_idx=i)
        with torch.no_grad():
            m.factor.zero_()
            m.factor[:, 0, 0] = 1.0
        blind[i] = m
    res = evaluate_passkey(convert(model, [0, 1], blind), TOK, **kw)
    assert res["mean"] <= 0.5, res["accuracy"]
