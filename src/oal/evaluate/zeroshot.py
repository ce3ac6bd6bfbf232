"""Zero-shot multiple choice in the paper's protocol (App. F.3): PIQA, HellaSwag, ARC-Easy.

Every candidate is prefixed with a space and scored by its conditional log-likelihood given the context; only the
candidate's tokens are scored. The score is normalised by the candidate's token count (PIQA, HellaSwag) or by
the option text's character count without the added space (ARC-E). No chat template, no BOS/EOS.

Examples come from `datasets` (hub ids below, when reachable) or from a local JSON-lines file with the hub's
field names. A converted model is a plain HF model that can also be handed to lm-eval's
`HFLM(pretrained=model, tokenizer=tok)` (not exercised by our tests); this module is the self-contained, offline
path.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import track

__all__ = ["TASKS", "Example", "evaluate_task", "load_examples", "score_candidates"]

# hub id, config, split (App. F.3)
TASKS = {
    "piqa": ("lighteval/piqa", None, "validation"),
    "hellaswag": ("Rowan/hellaswag", None, "validation"),
    "arc_easy": ("allenai/ai2_arc", "ARC-Easy", "test"),
}


@dataclass
class Example:
    context: str
    candidates: list[str]  # without the leading space
    label: int
    by_chars: bool = False  # ARC-E normalises by characters, the others by tokens


def _hellaswag_clean(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def to_example(task: str, row: dict) -> Example:
    """One dataset row -> context, candidates and gold index, with the task's prompt format."""
    if task == "piqa":
        return Example(f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"]))
    if task == "hellaswag":
        ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        context = _hellaswag_clean(row["activity_label"] + ": " + ctx)
        return Example(context, [_hellaswag_clean(e) for e in row["endings"]], int(row["label"]))
    if task == "arc_easy":
        labels = list(row["choices"]["label"])
        return Example(f"Question: {row['question']}\nAnswer:", list(row["choices"]["text"]),
                       labels.index(row["answerKey"]), by_chars=True)
    raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {task!r}")


def load_examples(task: str, source: str | Path | None = None, limit: int | None = None) -> list[Example]:
    """Rows from a local JSON-lines file (`source`) or from the hub through `datasets`."""
    if task not in TASKS:
        raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {task!r}")
    if source is not None:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"source: no such JSON-lines file: {path}")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    else:
        import datasets

        hub_id, config, split = TASKS[task]
        try:
            rows = list(datasets.load_dataset(hub_id, config, split=split))
        except Exception as exc:  # offline or missing: say what to do instead
            raise ValueError(f"task {task}: cannot load {hub_id} ({exc.__class__.__name__}); "
                             "pass a local JSON-lines file with the hub's fields") from exc
    rows = rows[:limit] if limit else rows
    return [to_example(task, row) for row in rows]


@torch.no_grad()
def score_candidates(model, tokenizer, example: Example) -> list[float]:
    """Normalised log-likelihood of each candidate (only candidate tokens are scored)."""
    device = next(model.parameters()).device
    ctx_ids = tokenizer(example.context, add_special_tokens=False)["input_ids"]
    scores = []
    for cand in example.candidates:
        cand_ids = tokenizer(" " + cand, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([ctx_ids + cand_ids], device=device)
        logp = F.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
        targets = ids[0, 1:]
        ll = logp[len(ctx_ids) - 1 :].gather(1, targets[len(ctx_ids) - 1 :, None]).sum().item()
        scores.append(ll / (len(cand) if example.by_chars else len(cand_ids)))
    return scores


def evaluate_task(model, tokenizer, examples: list[Example], *, progress: bool = False) -> dict:
    """Normalised accuracy (%) over `examples`."""
    if not examples:
        raise ValueError("examples: expected at least one example")
    was_training = model.training
    model.eval()
    correct = 0
    try:
        for ex in track(examples, description="zero-shot", disable=not progress, transient=True):
            scores = score_candidates(model, tokenizer, ex)
            correct += int(max(range(len(scores)), key=scores.__getitem__) == ex.label)
    finally:
        model.train(was_training)
    return {"acc_norm": 100.0 * correct / len(examples), "n": len(examples)}
