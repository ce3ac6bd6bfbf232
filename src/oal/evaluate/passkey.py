"""Synthetic passkey retrieval: does a converted model still recall a fact from far back in its context?

The prompt follows the passkey format of Mohtashami & Jaggi (2023, "Landmark Attention"), used by LongLoRA and
later long-context work: an instruction, filler sentences, one needle sentence holding a random number at a chosen
depth of the filler, more filler, and the question. The model continues greedily (through the generation cache, so
converted layers decode from their O(1) recurrent state) and scores 1 when the first run of digits it generates
is exactly the key and whole (not cut by the few tokens generated).

Prompts are assembled from separately tokenised pieces, so their token length is controlled exactly and does not
depend on how a tokenizer merges across piece boundaries; everything random comes from one seeded generator per
(seed, length, depth, trial), so the same arguments give the same text and answers on every machine.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from oal.errors import InputError
from oal.launch import progress_bar

__all__ = ["PASSKEY", "PasskeyPrompt", "Template", "answer_ids", "answer_tokens", "check_settings", "default_lengths",
           "evaluate_passkey", "make_prompt", "passkey_figure", "passkey_section", "passkey_table", "prompt_pieces",
           "score_answer"]

DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass(frozen=True)
class Template:
    """The prompt's pieces; `needle` holds `{key}`. The default is the Landmark-attention passkey format."""

    intro: str = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                  "I will quiz you about the important information there.")
    filler: str = " The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    needle: str = " The pass key is {key}. Remember it. {key} is the pass key."
    question: str = " What is the pass key? The pass key is"


PASSKEY = Template()


@dataclass(frozen=True)
class PasskeyPrompt:
    input_ids: list[int]
    answer: str
    depth: float  # fraction of the filler placed before the needle
    length: int  # tokens in the prompt (at most the requested length)


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_pieces(tokenizer, key: str, template: Template = PASSKEY) -> tuple[list[int], list[int], list[int]]:
    """Token ids of the instruction, the needle holding `key` and the question: a prompt is
    intro + filler before + needle + filler after + question (`make_prompt`; the embedded default's retrieval
    training stage builds its documents from the same pieces around other filler)."""
    return (_ids(tokenizer, template.intro), _ids(tokenizer, template.needle.format(key=key)),
            _ids(tokenizer, template.question))


def answer_ids(tokenizer, key: str) -> list[int]:
    """The continuation a retrieving model writes after the question: " <key>." (what training targets)."""
    return _ids(tokenizer, f" {key}.")


def make_prompt(tokenizer, length: int, depth: float, *, seed: int = 0, trial: int = 0, digits: int = 5,
                template: Template = PASSKEY) -> PasskeyPrompt:
    """A prompt of at most `length` tokens with a `digits`-digit key at relative `depth` of the filler."""
    if not 0.0 <= depth <= 1.0:
        raise InputError(f"expected a fraction in [0, 1], got {depth!r}", "--depths", "depth")
    if digits < 1:
        raise ValueError(f"digits: expected >= 1, got {digits!r}")
    rng = random.Random(f"passkey/{seed}/{length}/{depth:.6f}/{trial}")
    key = str(rng.randint(10 ** (digits - 1), 10**digits - 1))
    intro, needle, question = prompt_pieces(tokenizer, key, template)
    unit = _ids(tokenizer, template.filler)
    room = length - len(intro) - len(needle) - len(question)
    if room < 0 or not unit:
        raise InputError(f"{length} tokens cannot hold the passkey prompt's instruction, needle and question "
                         f"({len(intro) + len(needle) + len(question)} tokens)", "--lengths", "length")
    n_units = room // len(unit)
    before = round(depth * n_units)
    ids = intro + unit * before + needle + unit * (n_units - before) + question
    return PasskeyPrompt(input_ids=ids, answer=key, depth=depth, length=len(ids))


def score_answer(generated: str, answer: str, *, complete: bool = True) -> bool:
    """Exact match of the first run of digits in the continuation against the key. `complete` False: generation
    stopped at its token budget, so a run of digits that reaches the end of the text may go on (" 123456" cut to
    " 12345"): not a match."""
    found = re.search(r"\d+", generated)
    if found is None or found.group(0) != answer:
        return False
    return complete or found.end() < len(generated)


def default_lengths(max_positions: int | None, shortest: int = 1024, reserve: int = 0) -> list[int]:
    """Powers of two from `shortest` (1k) up to the model's maximum less `reserve` (room for the answer's tokens);
    below 1k, a quarter, half and all of it."""
    top = int(max_positions or 4096) - int(reserve)
    if top < shortest:
        return sorted({max(64, top // 4), max(64, top // 2), top})
    out, n = [], shortest
    while n < top:
        out.append(n)
        n *= 2
    return out + [top]


def answer_tokens(tokenizer, digits: int = 5) -> int:
    """Tokens generated per prompt: the key's digits plus a little room for a space or punctuation before them."""
    return len(_ids(tokenizer, " " + "9" * digits)) + 2


# what a run's passkey cache key records of the decoding, so that a resumed evaluation reruns after a change of it
# 2 (2026-12-07): greedy whatever the model's generation_config (1: its penalties applied); 3: a key whose digits
# reach the token budget is a miss (the number may go on), 2 counted it
DECODING_VERSION = 3


def _generate(model, tokenizer, ids: list[int], max_new_tokens: int) -> str:
    """The text of `_greedy`."""
    return _greedy(model, tokenizer, ids, max_new_tokens)[0]


@torch.no_grad()
def _greedy(model, tokenizer, ids: list[int], max_new_tokens: int) -> tuple[str, bool]:
    """Plain greedy decoding of `max_new_tokens` tokens (fewer at EOS): (the text, whether it ended before the
    budget or at EOS, so that a number at its end is whole).

    generate() fills every option not given from the model's own `generation_config`, so an instruct model's
    repetition penalty or no_repeat_ngram_size would penalise copying the key out of the prompt: for the call, the
    model (under a peft wrapper, its base model) gets a fresh config that keeps only its EOS."""
    from transformers import GenerationConfig

    device = next(model.parameters()).device
    x = torch.tensor([ids], device=device)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    own = getattr(base, "generation_config", None)
    base.generation_config = GenerationConfig(eos_token_id=getattr(own, "eos_token_id", None), pad_token_id=pad)
    try:
        seq = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                             do_sample=False, num_beams=1, use_cache=True, pad_token_id=pad)
    finally:
        base.generation_config = own
    new = seq[0, x.shape[1]:].tolist()
    eos = getattr(own, "eos_token_id", None)
    eos = {*(eos if isinstance(eos, (list, tuple)) else [eos]), tokenizer.eos_token_id} - {None}
    complete = len(new) < max_new_tokens or (bool(new) and new[-1] in eos)
    return tokenizer.decode(new, skip_special_tokens=True), complete


def check_settings(model, tokenizer, *, lengths: Sequence[int], depths: Sequence[float] = DEPTHS, trials: int = 4,
                   seed: int = 0, digits: int = 5, template: Template = PASSKEY) -> tuple[list[int], list[float]]:
    """(lengths, depths) sorted and each once, after every prompt was built (InputError naming --lengths for one
    that cannot hold it or that exceeds the model's positions): what `evaluate_passkey` checks before it decodes,
    and `oal run --passkey` before the run."""
    if trials < 1:
        raise ValueError(f"trials: expected >= 1, got {trials!r}")
    # each cell once, in order: the heatmap's axes and the table's columns read from short to long, top to bottom
    lengths, depths = sorted({int(n) for n in lengths}), sorted({float(x) for x in depths})
    if not lengths or not depths:
        raise ValueError("lengths/depths: expected at least one of each")
    max_pos = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    new_tokens = answer_tokens(tokenizer, digits)
    if max_pos is not None and max(lengths) + new_tokens > max_pos:
        raise InputError(f"{max(lengths)} + {new_tokens} generated tokens exceed the model's {max_pos} positions "
                         "(max_position_embeddings)", "--lengths", "lengths")
    # every prompt is built once before any is decoded: a length too short for one fails now, not after the others
    for n in lengths:
        for depth in depths:
            for t in range(trials):
                make_prompt(tokenizer, n, depth, seed=seed, trial=t, digits=digits, template=template)
    return lengths, depths


def evaluate_passkey(model, tokenizer, *, lengths: Sequence[int], depths: Sequence[float] = DEPTHS,
                     trials: int = 4, seed: int = 0, digits: int = 5, template: Template = PASSKEY,
                     progress: bool = False, description: str = "passkey") -> dict:
    """Greedy passkey accuracy per (length, depth): metrics.json's `passkey.<arm>` entry.

    Returns {"lengths", "depths", "trials", "digits", "accuracy": {length: {depth: acc}}, "by_length",
    "by_depth", "mean", "examples": one (answer, generated) pair per length for inspection}.
    """
    lengths, depths = check_settings(model, tokenizer, lengths=lengths, depths=depths, trials=trials, seed=seed,
                                     digits=digits, template=template)
    new_tokens = answer_tokens(tokenizer, digits)

    was_training = model.training
    model.eval()
    acc: dict[str, dict[str, float]] = {}
    examples: dict[str, dict[str, str]] = {}
    try:
        with progress_bar(progress) as bar:
            task = bar.add_task(description, total=len(lengths) * len(depths) * trials)
            for n in lengths:
                acc[str(n)] = {}
                for depth in depths:
                    hits = 0
                    for t in range(trials):
                        p = make_prompt(tokenizer, n, depth, seed=seed, trial=t, digits=digits, template=template)
                        text, complete = _greedy(model, tokenizer, p.input_ids, new_tokens)
                        hits += score_answer(text, p.answer, complete=complete)
                        if str(n) not in examples:
                            examples[str(n)] = {"answer": p.answer, "generated": text}
                        bar.advance(task)
                    acc[str(n)][f"{depth:g}"] = hits / trials
    finally:
        model.train(was_training)
    by_length = {n: sum(row.values()) / len(row) for n, row in acc.items()}
    by_depth = {f"{d:g}": sum(acc[str(n)][f"{d:g}"] for n in lengths) / len(lengths) for d in depths}
    return {"lengths": lengths, "depths": depths, "trials": trials, "digits": digits, "seed": seed,
            "accuracy": acc, "by_length": by_length, "by_depth": by_depth,
            "mean": sum(by_length.values()) / len(by_length), "examples": examples}


def passkey_figure(results: dict[str, dict], path) -> bool:
    """Heatmaps (depth x length) of passkey accuracy, one panel per arm; False when there is nothing to draw."""
    arms = [a for a, r in results.items() if r and r.get("accuracy")]
    if not arms:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oal.rundir.files import atomic_save_figure

    # constrained: each panel keeps room for its own depth labels (they ran into the panel on their left)
    fig, axes = plt.subplots(1, len(arms), figsize=(2.6 * len(arms) + 1, 2.8), squeeze=False, layout="constrained")
    for ax, arm in zip(axes[0], arms, strict=True):
        r = results[arm]
        lengths, depths = [str(n) for n in r["lengths"]], [f"{d:g}" for d in r["depths"]]
        grid = [[r["accuracy"][n][d] for n in lengths] for d in depths]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto", origin="lower")
        ax.set_xticks(range(len(lengths)), lengths, rotation=45)
        ax.set_yticks(range(len(depths)), depths)
        ax.set_title(arm, fontsize=9)
        ax.set_xlabel("context length")
    axes[0][0].set_ylabel("needle depth")
    fig.colorbar(im, ax=axes[0].tolist(), label="accuracy")
    atomic_save_figure(fig, path, dpi=120, bbox_inches="tight")
    return True


def passkey_table(pk: dict, std: dict | None = None, name=None) -> tuple[dict[str, dict], list[str], list[list[str]]]:
    """({arm label: result}, header, rows) of metrics.json["passkey"]: accuracy by context length and the mean, one
    row per arm ("<method> (no adapt|adapted)", softmax first), for the report and the terminal; `std` (a multi-seed
    run's metrics.json["passkey_std"]) adds the spread over seeds to the mean. `name` (the report's display names,
    "Softmax (LoRA)") labels the arms as the report's other tables and figures do: "<name> (LoRA)" and "<name>
    before adaptation"."""
    label = _arm_label if name is None else _display_label(name)
    order = ["softmax"] + [m for m in pk if m != "softmax"]
    # metrics.json keeps its keys sorted ("adapted" first): no adapt first, as measured and printed
    arms = {label(m, v): pk[m][v] for m in order if m in pk
            for v in sorted(pk[m], key=lambda v: v != "no_adapt")}
    lens = sorted({int(n) for r in arms.values() for n in r["by_length"]})
    spread = {label(m, v): s["mean"] for m, vs in (std or {}).items() for v, s in vs.items()}
    rows = [[arm, *(f"{r['by_length'][str(n)]:.2f}" if str(n) in r["by_length"] else "-" for n in lens),
             f"{r['mean']:.2f}" + (f" ± {spread[arm]:.2f}" if arm in spread else "")] for arm, r in arms.items()]
    return arms, ["arm", *map(str, lens), "mean"], rows


def _arm_label(m: str, variant: str) -> str:
    return f"{m} ({variant.replace('_', ' ')})"


def _display_label(name):
    def label(m: str, variant: str) -> str:
        shown = name(m).removesuffix(" (LoRA)")
        return {"adapted": f"{shown} (LoRA)", "no_adapt": f"{shown} before adaptation"}.get(
            variant, f"{shown} ({variant.replace('_', ' ')})")
    return label


def passkey_section(metrics: dict, fig_dir: Path, table, name=None) -> list[str]:
    """report.md's passkey section from metrics.json["passkey"] (and figures/passkey.png); `table(header, rows)`
    renders a markdown table; `name` as in `passkey_table`."""
    pk = metrics.get("passkey") or {}
    seeds = metrics.get("seeds") or []
    out = ["## Passkey retrieval (long-context recall)", ""]
    if not pk:
        if len(seeds) > 1:  # `oal evaluate` measures one seed's directory; DIR's aggregate then averages them
            return out + [f"Not measured for every seed of {seeds} with the same settings (`oal evaluate --out "
                          "DIR/seed-<s> --passkey` for each seed; DIR's report then gives their mean).", ""]
        return out + ["Not measured in this run (`oal evaluate --out DIR --passkey`).", ""]
    arms, header, rows = passkey_table(pk, metrics.get("passkey_std"), name)
    # arms measured by separate `oal evaluate --passkey` calls may differ in depths and keys: say so, per arm
    settings: dict[str, list[str]] = {}
    for arm, r in arms.items():
        keys = f"{r['trials']} key{'s' if r['trials'] != 1 else ''}"
        settings.setdefault(f"a {r['digits']}-digit key hidden at depths {', '.join(f'{d:g}' for d in r['depths'])}"
                            f" of the filler, {keys} per cell", []).append(arm)
    how = next(iter(settings)) if len(settings) == 1 else "the arms were measured with different settings, so their " \
        "rows do not compare: " + "; ".join(f"{', '.join(a)}: {s}" for s, a in settings.items())
    out += [f"Greedy decoding through the recurrent cache; {how}; exact match of the first whole number generated. "
            "Accuracy by context length (tokens), mean over depths. The softmax row is what the base model itself "
            "can do: a small model that fails there says nothing about the conversion." + (
                f" Mean over seeds {seeds}, the same prompts in each (mean column: ± sample std over seeds); each "
                "seed's own: seed-<s>/report.md." if len(seeds) > 1 else ""), "", table(header, rows), ""]
    if passkey_figure(arms, fig_dir / "passkey.png"):
        out += ["![passkey accuracy by length and depth](figures/passkey.png)", ""]
    return out
