"""Zero-shot scoring in the App. F.3 protocol, on local fixtures and a tiny random model."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import ByT5Tokenizer, Qwen2Config, Qwen2ForCausalLM

from oal.evaluate.zeroshot import Example, evaluate_task, load_examples, score_candidates

ROWS = {
    "piqa": [{"goal": "Open a jar", "sol1": "twist the lid", "sol2": "eat the lid", "label": 0}],
    "hellaswag": [{"activity_label": "Cooking", "ctx_a": "A man cuts onions.", "ctx_b": "he [title] then",
                   "endings": ["fries them.", "sings [x] loudly.", "sleeps.", "runs."], "label": 0}],
    "arc_easy": [{"question": "Which is a planet?", "answerKey": "B",
                  "choices": {"label": ["A", "B", "C"], "text": ["Moon", "Mars", "Sun"]}}],
}


@pytest.fixture(scope="module")
def model_and_tok():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return Qwen2ForCausalLM(cfg).eval(), ByT5Tokenizer()


@pytest.mark.parametrize("task", list(ROWS))
def test_load_local_fixture(tmp_path, task):
    path = tmp_path / f"{task}.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS[task]))
    (ex,) = load_examples(task, path)
    assert ex.label == {"piqa": 0, "hellaswag": 0, "arc_easy": 1}[task]
    if task == "hellaswag":  # activity label, capitalised second segment, title marker and brackets cleaned
        assert ex.context == "Cooking: A man cuts onions. He. then"
        assert ex.candidates[1] == "sings loudly."
    else:
        assert ex.context.startswith("Question: ") and ex.context.endswith("\nAnswer:")
    assert ex.by_chars == (task == "arc_easy")


def test_bad_task_and_source(tmp_path):
    with pytest.raises(ValueError, match="^task"):
        load_examples("mmlu", tmp_path / "x.jsonl")
    with pytest.raises(ValueError, match="^source"):
        load_examples("piqa", tmp_path / "missing.jsonl")


@pytest.mark.parametrize("by_chars", [False, True])
def test_scores_only_candidate_tokens(model_and_tok, by_chars):
    model, tok = model_and_tok
    ex = Example("Question: hi\nAnswer:", ["yes", "no way"], 0, by_chars=by_chars)
    got = score_candidates(model, tok, ex)
    ctx = tok(ex.context, add_special_tokens=False)["input_ids"]
    for cand, score in zip(ex.candidates, got, strict=True):
        cids = tok(" " + cand, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([ctx + cids])
        logp = F.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        ll = sum(logp[len(ctx) - 1 + i, c].item() for i, c in enumerate(cids))
        assert score == pytest.approx(ll / (len(cand) if by_chars else len(cids)), rel=1e-5)


def test_accuracy_is_argmax_of_scores(model_and_tok):
    model, tok = model_and_tok
    exs = [Example("Q: a\nA:", ["x", "yy", "zzz"], i % 3) for i in range(6)]
    best = [max(range(3), key=score_candidates(model, tok, e).__getitem__) for e in exs]
    want = 100.0 * sum(b == e.label for b, e in zip(best, exs, strict=True)) / 6
    assert evaluate_task(model, tok, exs) == {"acc_norm": want, "n": 6}
    with pytest.raises(ValueError, match="^examples"):
        evaluate_task(model, tok, [])
