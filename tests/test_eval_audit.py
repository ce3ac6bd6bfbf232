"""Evaluation audit: zero-shot pairs tokenized as lm-eval does, acc / acc_norm by hand on fixture items, greedy
passkey decoding independent of a model's generation_config, perplexity independent of the batch size."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from _tiny import tiny_model
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import ByT5Tokenizer, PreTrainedTokenizerFast

from oal.evaluate.passkey import Template, _generate, make_prompt
from oal.evaluate.perplexity import block_nll
from oal.evaluate.zeroshot import Example, accuracies, encode_pair, evaluate_task, score_examples, to_example

FIXTURES = Path(__file__).parent / "fixtures" / "zeroshot"


def _legacy_sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-2 / Mistral-v0.1 style tokenizer.json (normalizer Prepend("▁") + Replace(" ", "▁"), BPE, no
    pre-tokenizer): " yes" alone is "▁▁yes" -> ["▁", "▁yes"], but "Answer: yes" ends in the one token "▁yes"."""
    chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789:.,?!\n'") | {"\u2581"})
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {c: 3 + i for i, c in enumerate(chars)}
    merges = [("\u2581", "y"), ("e", "s"), ("\u2581y", "es"), ("\u2581", "n"), ("\u2581n", "o")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    t = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    t.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    t.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module")
def default_tok():
    from oal.models.registry import load_model

    model, tok, _ = load_model("default", dtype=torch.float64)
    return model, tok


def _lm_eval_loglikelihoods(model, tok, examples: list[Example]) -> list[float]:
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=2, device="cpu", add_bos_token=False)
    reqs = [Instance("loglikelihood", {}, (ex.context, " " + c), i) for ex in examples
            for i, c in enumerate(ex.candidates)]
    return [ll for ll, _ in lm.loglikelihood(reqs, disable_tqdm=True)]


def test_sentencepiece_candidate_has_no_extra_prefix_token():
    """Tokenized on its own, " yes" gets a spurious "▁" from the dummy prefix; in context (as lm-eval splits the
    jointly encoded string) the candidate is the one token "▁yes"."""
    tok = _legacy_sentencepiece_tokenizer()
    assert tok.convert_ids_to_tokens(tok(" yes", add_special_tokens=False)["input_ids"]) == ["\u2581", "\u2581yes"]
    ctx, cont = encode_pair(tok, "Question: is it?\nAnswer:", " yes")
    assert tok.convert_ids_to_tokens(cont) == ["\u2581yes"]
    model = tiny_model("llama", len(tok)).double()
    exs = [Example("Question: is it?\nAnswer:", ["yes", "no"], 0)]
    ours = score_examples(model, tok, exs)[0]
    assert [n for _, n in ours] == [1, 1]
    theirs = _lm_eval_loglikelihoods(model, tok, exs)
    assert [ll for ll, _ in ours] == pytest.approx(theirs, abs=1e-9)


def test_context_ending_in_whitespace_is_split_as_lm_eval_does(default_tok):
    """HellaSwag's cleaning (shared with lm-eval) can leave a trailing space ("... [step]" at the end of ctx_a);
    lm-eval moves it to the continuation, so its log-probability is part of every candidate's score."""
    _, tok = default_tok
    row = {"activity_label": "Washing car", "ctx_a": "Somebody washes the car. [step]", "ctx_b": "",
           "endings": ["He rinses it.", "She dries it off [title] now.", "A man waves.", "It rains."], "label": 0}
    ex = to_example("hellaswag", row)
    assert ex.context.endswith(" ")  # what lm-eval's own preprocess gives too
    ctx, cont = encode_pair(tok, ex.context, " " + ex.candidates[0])
    whole = tok(ex.context.rstrip() + "  " + ex.candidates[0], add_special_tokens=False)["input_ids"]
    assert ctx + cont == whole and ctx == tok(ex.context.rstrip(), add_special_tokens=False)["input_ids"]
    model = tiny_model("qwen2", len(tok)).double()
    ours = score_examples(model, tok, [ex])[0]
    theirs = _lm_eval_loglikelihoods(model, tok, [ex])
    assert [ll for ll, _ in ours] == pytest.approx(theirs, abs=1e-9)


@pytest.mark.parametrize("task", ["piqa", "hellaswag", "arc_easy"])
def test_acc_and_acc_norm_by_hand_on_five_fixture_items(default_tok, task):
    """Each candidate scored alone by a full forward over context + candidate (jointly tokenized), then acc (sum),
    the paper's acc_norm (per token on PIQA / HellaSwag, per character on ARC-E) and lm-eval's (per character)."""
    model, tok = default_tok
    rows = [json.loads(line) for line in (FIXTURES / f"{task}.jsonl").read_text().splitlines()[:5]]
    exs = [to_example(task, r) for r in rows]
    hits = {"acc": 0, "acc_norm": 0, "acc_norm_lmeval": 0}
    for ex in exs:
        lls, ntok = [], []
        ctx = tok(ex.context, add_special_tokens=False)["input_ids"]
        for c in ex.candidates:
            whole = tok(ex.context + " " + c, add_special_tokens=False)["input_ids"]
            assert whole[: len(ctx)] == ctx
            with torch.no_grad():
                logp = torch.log_softmax(model(input_ids=torch.tensor([whole])).logits[0].double(), -1)
            lls.append(sum(float(logp[t - 1, whole[t]]) for t in range(len(ctx), len(whole))))
            ntok.append(len(whole) - len(ctx))
        norm = [ll / (len(c) if ex.by_chars else n) for ll, c, n in zip(lls, ex.candidates, ntok, strict=True)]
        chars = [ll / len(c) for ll, c in zip(lls, ex.candidates, strict=True)]
        for key, vals in (("acc", lls), ("acc_norm", norm), ("acc_norm_lmeval", chars)):
            hits[key] += max(range(len(vals)), key=vals.__getitem__) == ex.label
    got = evaluate_task(model, tok, exs, batch_size=3)
    assert got == {k: 100.0 * v / 5 for k, v in hits.items()} | {"n": 5}
    assert got == accuracies(exs, score_examples(model, tok, exs, batch_size=1))


def test_passkey_decoding_is_greedy_whatever_the_models_generation_config():
    """An instruct model's generation_config (repetition penalty, no_repeat_ngram_size) must not penalise copying
    the key from the prompt; the model's config is left as it was."""
    tok = ByT5Tokenizer(extra_ids=0)
    model = tiny_model("llama", 259)
    p = make_prompt(tok, 40, 0.5, template=Template(intro="", filler=" ab", needle=" k{key}.", question=" k"),
                    digits=2)
    ids = list(p.input_ids)
    with torch.no_grad():
        for _ in range(10):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    greedy = tok.decode(ids[len(p.input_ids):], skip_special_tokens=True)
    assert _generate(model, tok, p.input_ids, 10) == greedy
    cfg = model.generation_config
    cfg.repetition_penalty, cfg.no_repeat_ngram_size = 1.3, 2
    assert _generate(model, tok, p.input_ids, 10) == greedy
    assert model.generation_config is cfg and cfg.repetition_penalty == 1.3


def test_perplexity_does_not_depend_on_the_batch_size():
    model = tiny_model("qwen2", 97)
    blocks = torch.randint(0, 97, (5, 40), generator=torch.Generator().manual_seed(5))
    ref = {b: block_nll(model, blocks, batch_size=b) for b in (1, 3, 4, 5)}
    assert {c for _, c in ref.values()} == {5 * 39}
    base = math.exp(ref[1][0] / ref[1][1])
    for total, count in ref.values():
        assert math.exp(total / count) == pytest.approx(base, rel=1e-6)


@pytest.mark.parametrize("depth", [0.0, 1.0])
def test_passkey_depth_0_and_1_put_the_needle_at_the_ends_of_the_filler(depth):
    from oal.evaluate.passkey import PASSKEY, prompt_pieces

    tok = ByT5Tokenizer(extra_ids=0)
    p = make_prompt(tok, 700, depth, seed=2, trial=3)
    intro, needle, question = prompt_pieces(tok, p.answer, PASSKEY)
    unit = tok(PASSKEY.filler, add_special_tokens=False)["input_ids"]
    n = (700 - len(intro) - len(needle) - len(question)) // len(unit)
    body = [needle, unit * n] if depth == 0.0 else [unit * n, needle]
    assert p.input_ids == intro + body[0] + body[1] + question
    assert p == make_prompt(tok, 700, depth, seed=2, trial=3)
