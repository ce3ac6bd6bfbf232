"""Zero-shot multiple choice in the paper's protocol (App. F.3): PIQA, HellaSwag, ARC-Easy.

Prompts: PIQA and ARC-E use "Question: {question}\\nAnswer:"; HellaSwag uses "{activity label}: {ctx_a} {ctx_b
capitalised}" with title markers replaced by periods and bracketed artifacts removed (endings cleaned the same way).
Every candidate is prefixed with a space and scored by its conditional log-likelihood given the context; only the
candidate's tokens are scored. No chat template, no BOS/EOS. The pair is tokenized as lm-eval does
(`_encode_pair`): whitespace at the end of the context moves to the start of the continuation, the context is
tokenized on its own and context + continuation as one string, and the candidate's tokens are those past the
context's (tokenizing " " + candidate on its own differs for SentencePiece tokenizers with a dummy prefix, which
give it an extra "▁", and for contexts ending in whitespace, which HellaSwag's cleaning can leave).

Accuracies (in %) per task:
- `acc`: argmax of the summed log-likelihood;
- `acc_norm`: the paper's normalisation: log-likelihood / candidate token count (PIQA, HellaSwag), or / the option
  text's character count without the added space (ARC-E);
- `acc_norm_lmeval`: lm-eval's `acc_norm`: log-likelihood / the option text's character count (no space) for every
  task. It equals `acc_norm` on ARC-E and differs on PIQA and HellaSwag (characters rather than tokens).

Scoring is batched: the (context, candidate) sequences of many examples are right-padded into one forward with an
attention mask (converted layers handle right padding, `oal.models.convert`); a pair longer than the model's
context keeps its last tokens, as lm-eval does. A converted model is a plain HF model,
so lm-eval's `HFLM(pretrained=model, tokenizer=tok)` scores it too; tests/test_zeroshot_lmeval.py checks that the
per-candidate log-likelihoods agree.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from oal.data.zeroshot import SOURCES, TASKS, DataUnavailable, fetch_task, parse_tasks
from oal.device import module_device
from oal.launch import progress_bar

__all__ = ["SCORING_VERSION", "TASKS", "Example", "accuracies", "encode_pair", "evaluate_task", "evaluate_tasks",
           "load_task", "load_tasks", "loglikelihoods", "merge_metrics", "sample_records", "score_candidates",
           "score_examples", "to_example"]


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
    """One dataset row -> context, candidates and gold index, with the task's prompt format (App. F.3)."""
    if task == "piqa":
        ex = Example(f"Question: {row['goal']}\nAnswer:", [row["sol1"], row["sol2"]], int(row["label"]))
    elif task == "hellaswag":
        ctx = row["ctx_a"] + " " + row["ctx_b"].capitalize()
        context = _hellaswag_clean(row["activity_label"] + ": " + ctx)
        ex = Example(context, [_hellaswag_clean(e) for e in row["endings"]], int(row["label"]))
    elif task == "arc_easy":
        labels = list(row["choices"]["label"])
        if row["answerKey"] not in labels:
            raise ValueError(f"answerKey {row['answerKey']!r} is not one of the choice labels {labels}")
        ex = Example(f"Question: {row['question']}\nAnswer:", list(row["choices"]["text"]),
                     labels.index(row["answerKey"]), by_chars=True)
    else:
        raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {task!r}")
    if not 0 <= ex.label < len(ex.candidates):
        raise ValueError(f"label {ex.label} is out of range for {len(ex.candidates)} candidates")
    return ex


def examples_from_rows(task: str, rows: list[dict], source: str = "rows") -> list[Example]:
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(to_example(task, row))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"{source}: row {i} does not fit the {SOURCES[task].dataset_id} schema "
                             f"{SOURCES[task].schema}: {exc}") from None
    return out


def load_task(task: str, *, data_dir: str | Path | None = None, task_file: str | Path | None = None,
              limit: int | None = None, sources=None) -> tuple[list[Example], dict]:
    """`task`'s examples and their provenance (see `oal.data.zeroshot.fetch_task` for where rows come from)."""
    got = fetch_task(task, data_dir=data_dir, task_file=task_file, limit=limit, sources=sources)
    return examples_from_rows(task, got.rows, got.provenance["path"]), got.provenance


def load_tasks(tasks=None, *, data_dir: str | Path | None = None, task_files: dict | None = None,
               limit: int | None = None) -> tuple[dict[str, tuple[list[Example], dict]], dict[str, str]]:
    """(examples, provenance) per task of `tasks` (default: all), and {task: reason} for those whose data is
    unavailable (offline, nothing cached): skipped, never made up. Bad files raise ValueError."""
    sets, skipped = {}, {}
    for task in parse_tasks(tasks):
        try:
            sets[task] = load_task(task, data_dir=data_dir, task_file=(task_files or {}).get(task), limit=limit)
        except DataUnavailable as exc:
            skipped[task] = str(exc)
    return sets, skipped


# ----------------------------------------------------------------------------------------------- scoring


# what a run's zero-shot stage key records of the scorer, so that a resumed run rescores after a change of it
SCORING_VERSION = 2  # 2 (2026-12-07): pairs tokenized as lm-eval's _encode_pair (1: context and " " + candidate apart)


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's `_encode_pair` for a causal LM, without special tokens."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    if not ctx:
        raise ValueError(f"example: the context {context!r} tokenizes to nothing")
    cont = tokenizer(context + continuation, add_special_tokens=False)["input_ids"][len(ctx):]
    if not cont:
        raise ValueError(f"example: the continuation {continuation!r} adds no tokens to the context {context!r}")
    return list(ctx), list(cont)


def _encode(tokenizer, examples: list[Example]) -> list[list[tuple[list[int], list[int]]]]:
    return [[encode_pair(tokenizer, ex.context, " " + c) for c in ex.candidates] for ex in examples]


def _accepts_logits_to_keep(model) -> bool:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def _window(ctx: list[int], cont: list[int], max_length: int | None) -> tuple[list[int], int]:
    """The model input for one pair and the context length inside it.

    The last continuation token is never an input (no prediction is needed after it). A pair longer than the model's
    context keeps its last `max_length + 1` tokens (the context is cut from the left), as lm-eval does.
    """
    full = ctx + cont
    if max_length is not None:
        if len(cont) > max_length:
            raise ValueError(f"continuation: {len(cont)} tokens do not fit the model's {max_length}-token context")
        full = full[-(max_length + 1):]
    return full[:-1], len(full) - len(cont)


@torch.no_grad()
def loglikelihoods(model, pairs: list[tuple[list[int], list[int]]], *, pad_id: int = 0, batch_size: int = 8,
                   max_length: int | None = None, progress: bool = False,
                   description: str = "zero-shot") -> list[float]:
    """log p(continuation | context) for each (context ids, continuation ids) pair; batches are right-padded."""
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    device = module_device(model)
    keep = _accepts_logits_to_keep(model)
    windows = [_window(ctx, cont, max_length) for ctx, cont in pairs]
    order = sorted(range(len(pairs)), key=lambda i: -len(windows[i][0]))  # similar lengths together: little padding
    out: list = [None] * len(pairs)  # per pair a 0-dim tensor on the model's device; numbers once, at the end
    was_training = model.training
    model.eval()
    try:
        with progress_bar(progress) as bar:
            task = bar.add_task(description, total=len(pairs))
            for s in range(0, len(order), batch_size):
                idx = order[s : s + batch_size]
                width = max(len(windows[i][0]) for i in idx)
                ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
                mask = torch.zeros_like(ids)
                for r, i in enumerate(idx):
                    ids[r, : len(windows[i][0])] = torch.tensor(windows[i][0])
                    mask[r, : len(windows[i][0])] = 1
                # logits at position t predict token t + 1: the continuation is predicted from n_ctx - 1 on
                lo = min(windows[i][1] for i in idx) - 1
                kw = {"logits_to_keep": torch.arange(lo, width, device=device)} if keep else {}
                logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False,
                               **kw).logits
                offset = lo if keep else 0
                for r, i in enumerate(idx):
                    cont, start = pairs[i][1], windows[i][1] - 1 - offset
                    rows = logits[r, start : start + len(cont)]
                    logp = torch.log_softmax(rows.to(torch.promote_types(rows.dtype, torch.float32)), dim=-1)
                    target = torch.tensor(cont, device=logp.device)[:, None]
                    out[i] = logp.gather(1, target).double().sum()
                bar.advance(task, len(idx))
    finally:
        model.train(was_training)
    return torch.stack(out).tolist() if out else []


def score_examples(model, tokenizer, examples: list[Example], *, batch_size: int = 8, progress: bool = False,
                   description: str = "zero-shot") -> list[list[tuple[float, int]]]:
    """Per example, per candidate: (summed log-likelihood of " " + candidate, its token count), tokenized as lm-eval
    does (`encode_pair`)."""
    encoded = _encode(tokenizer, examples)
    pairs = [p for ex in encoded for p in ex]
    # pad with id 0, as lm-eval does: right padding never reaches a real position, and 0 is always an embedding row
    # (a tokenizer's pad id may not be, e.g. a Qwen2 tokenizer's added <|endoftext|> on a smaller test vocabulary)
    lls = loglikelihoods(model, pairs, batch_size=batch_size, progress=progress,
                         max_length=getattr(model.config, "max_position_embeddings", None), description=description)
    out, k = [], 0
    for ex in encoded:
        out.append([(lls[k + j], len(cont)) for j, (_, cont) in enumerate(ex)])
        k += len(ex)
    return out


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)  # first maximum, as numpy's argmax


def paper_scores(example: Example, scores: list[tuple[float, int]]) -> list[float]:
    """App. F.3: log-likelihood / token count (PIQA, HellaSwag) or / option characters without the space (ARC-E)."""
    return [ll / (max(len(c), 1) if example.by_chars else n)
            for (ll, n), c in zip(scores, example.candidates, strict=True)]


def accuracies(examples: list[Example], scores: list[list[tuple[float, int]]]) -> dict:
    """acc, acc_norm (paper) and acc_norm_lmeval (characters), in %, and the example count."""
    if not examples:
        raise ValueError("examples: expected at least one example")
    hits = {"acc": 0, "acc_norm": 0, "acc_norm_lmeval": 0}
    for ex, sc in zip(examples, scores, strict=True):
        lls = [ll for ll, _ in sc]
        hits["acc"] += _argmax(lls) == ex.label
        hits["acc_norm"] += _argmax(paper_scores(ex, sc)) == ex.label
        hits["acc_norm_lmeval"] += _argmax([ll / max(len(c), 1) for ll, c in zip(lls, ex.candidates,
                                                                                  strict=True)]) == ex.label
    return {k: 100.0 * v / len(examples) for k, v in hits.items()} | {"n": len(examples)}


def sample_records(examples: list[Example], scores: list[list[tuple[float, int]]]) -> list[dict]:
    """Per example (in order, `doc_id` its index): the prompt, the candidates, the gold label, each candidate's
    summed log-likelihood and token count, and the predicted index under `acc` and the paper's `acc_norm`."""
    out = []
    for i, (ex, sc) in enumerate(zip(examples, scores, strict=True)):
        lls = [ll for ll, _ in sc]
        out.append({"doc_id": i, "context": ex.context, "candidates": ex.candidates, "label": ex.label,
                    "loglikelihoods": lls, "n_tokens": [n for _, n in sc], "pred": _argmax(lls),
                    "pred_norm": _argmax(paper_scores(ex, sc))})
    return out


def evaluate_task(model, tokenizer, examples: list[Example], *, batch_size: int = 8, progress: bool = False,
                  description: str = "zero-shot", samples: list | None = None) -> dict:
    """acc / acc_norm / acc_norm_lmeval (%) and n over `examples`; `samples` (a list) receives `sample_records`."""
    if not examples:
        raise ValueError("examples: expected at least one example")
    scores = score_examples(model, tokenizer, examples, batch_size=batch_size, progress=progress,
                            description=description)
    if samples is not None:
        samples.extend(sample_records(examples, scores))
    return accuracies(examples, scores)


def score_candidates(model, tokenizer, example: Example) -> list[float]:
    """The paper's normalised score of each candidate of one example."""
    return paper_scores(example, score_examples(model, tokenizer, [example])[0])


def evaluate_tasks(model, tokenizer, sets: dict[str, tuple[list[Example], dict]], *, batch_size: int = 8,
                   progress: bool = False, description: str = "zero-shot",
                   samples: dict | None = None) -> dict[str, dict]:
    """`evaluate_task` for every task of `sets` (as returned by `load_tasks`); `samples` (a dict) receives each
    task's `sample_records`."""
    return {t: evaluate_task(model, tokenizer, ex, batch_size=batch_size, progress=progress,
                             description=f"{description} {t}",
                             samples=None if samples is None else samples.setdefault(t, []))
            for t, (ex, _) in sets.items()}


def merge_metrics(metrics: dict, method: str, results: dict[str, dict], provenance: dict[str, dict],
                  skipped: dict[str, str]) -> dict:
    """metrics.json layout: zeroshot.<method>.<task> = {acc, acc_norm, acc_norm_lmeval, n} (%); zeroshot_data.<task>
    = where the rows came from (source, revision, sha256, limit); zeroshot_skipped.<task> = why a task is missing."""
    if results:
        metrics.setdefault("zeroshot", {}).setdefault(method, {}).update(results)
    if provenance:
        metrics.setdefault("zeroshot_data", {}).update(provenance)
    missing = {t: why for t, why in {**metrics.get("zeroshot_skipped", {}), **skipped}.items() if t not in results}
    metrics.pop("zeroshot_skipped", None)
    if missing:
        metrics["zeroshot_skipped"] = missing
    return metrics
