"""Parity with stock lm-eval: the converted embedded model run through `HFLM(pretrained=model, tokenizer=tok)` on
local tasks in the three formats (PIQA, HellaSwag with lm-eval's own preprocessing, ARC-E) gives the same prompts,
the same per-candidate log-likelihoods and the same accuracies as `oal.evaluate.zeroshot`.

Normalisation: lm-eval's `acc_norm` divides by the option's character count for every task, which is our
`acc_norm_lmeval`; the paper's (our `acc_norm`) divides by token count on PIQA and HellaSwag and equals lm-eval's on
ARC-E.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from lm_eval.api.task import ConfigurableTask
from lm_eval.evaluator import evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks.hellaswag import utils as lm_eval_hellaswag

from oal.evaluate.zeroshot import accuracies, load_task, score_examples
from oal.models.convert import convert
from oal.models.registry import load_model

FIXTURES = Path(__file__).parent / "fixtures" / "zeroshot"
LIMIT = 10  # examples per task: enough for every format, small for CI

# The stock lm-eval task definitions (lm_eval/tasks/{piqa,hellaswag,arc}), reading our fixtures instead of the hub.
FORMATS = {
    "piqa": {"doc_to_text": "Question: {{goal}}\nAnswer:", "doc_to_target": "label",
             "doc_to_choice": "{{[sol1, sol2]}}"},
    "hellaswag": {"process_docs": lm_eval_hellaswag.process_docs, "doc_to_text": "{{query}}",
                  "doc_to_target": "{{label}}", "doc_to_choice": "choices"},
    "arc_easy": {"doc_to_text": "Question: {{question}}\nAnswer:",
                 "doc_to_target": "{{choices.label.index(answerKey)}}", "doc_to_choice": "{{choices.text}}"},
}


def _task(name: str) -> ConfigurableTask:
    rows = [json.loads(line) for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines()][:LIMIT]
    return ConfigurableTask(config={
        "task": f"fixture_{name}", "output_type": "multiple_choice", "validation_split": "validation",
        "custom_dataset": lambda **_: datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)}),
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}], **FORMATS[name]})


@pytest.fixture(scope="module")
def converted():
    model, tok, _ = load_model("default", dtype=torch.float64)
    return convert(model, None, "oal").double(), tok  # kernels too: the parity check runs in fp64


@pytest.fixture(scope="module")
def lm_eval_results(converted):
    model, tok = converted
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=4, device="cpu", add_bos_token=False)
    return evaluate(lm, {f"fixture_{t}": _task(t) for t in FORMATS}, log_samples=True, bootstrap_iters=0,
                    verbosity="ERROR")


@pytest.mark.parametrize("task", list(FORMATS))
def test_lm_eval_parity(converted, lm_eval_results, task):
    model, tok = converted
    examples, _ = load_task(task, task_file=FIXTURES / f"{task}.jsonl", limit=LIMIT)
    ours = score_examples(model, tok, examples, batch_size=4)
    samples = sorted(lm_eval_results["samples"][f"fixture_{task}"], key=lambda s: s["doc_id"])
    assert len(samples) == len(examples) == LIMIT
    worst = 0.0
    for sample, ex, scores in zip(samples, examples, ours, strict=True):
        # the same prompt and candidates (lm-eval adds the space as its target delimiter)
        assert [tuple(a) for a in sample["arguments"]] == [(ex.context, " " + c) for c in ex.candidates]
        assert sample["target"] == ex.label
        theirs = [resp[0][0] for resp in sample["resps"]]  # (log-likelihood, is_greedy) per candidate
        worst = max(worst, *(abs(a - b) for a, (b, _) in zip(theirs, scores, strict=True)))
    assert worst < 1e-9, f"{task}: per-candidate log-likelihoods differ by up to {worst:.3g}"
    ref = lm_eval_results["results"][f"fixture_{task}"]
    acc = accuracies(examples, ours)
    assert acc["acc"] == pytest.approx(100 * ref["acc,none"])
    assert acc["acc_norm_lmeval"] == pytest.approx(100 * ref["acc_norm,none"])  # lm-eval: per character
    if task == "arc_easy":  # the paper normalises ARC-E by characters too
        assert acc["acc_norm"] == acc["acc_norm_lmeval"]
