"""`DIR/report.md` of an encoder run (`oal.pipeline.encoder`), from the files of the run directory.

Sections: model and data provenance, the passage plan, the analysis figures, calibration, frozen-attention
fidelity (Eq. 21-22, non-causal), embedding agreement with the original model, what did not run, time per stage.
The analysis, calibration, fidelity and timing sections are the decoder report's own (`oal.pipeline.report`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from matplotlib.figure import Figure

from oal.data.passages import PASSAGE_ROLES
from oal.pipeline.report import OWN_FIGURES, write_markdown
from oal.pipeline.report_figures import calibration_figure
from oal.pipeline.report_format import display_name, markdown_table, ordered, read_optional
from oal.pipeline.report_sections import analysis_section, calibration_section, fidelity_section, timing_section
from oal.rundir.files import atomic_save_figure

__all__ = ["cosine_text", "embedding_figure", "write_encoder_report"]

POOLING_LABEL = {"mean": "mean pooling", "cls": "first token ([CLS])", "max": "max pooling",
                 "mean_sqrt_len": "mean pooling / sqrt(length)", "weightedmean": "position-weighted mean",
                 "lasttoken": "last token"}


def cosine_text(x) -> str:
    """A cosine with the decimals that show 1 - cos to three significant digits (4 to 10): converted layers often
    stay above 0.99999, which five decimals print as 1.00000 for every method."""
    if not isinstance(x, (int, float)) or not math.isfinite(x):
        return "-"
    gap = 1.0 - x
    return f"{x:.{4 if gap <= 0 else min(10, max(4, math.ceil(-math.log10(gap)) + 2))}f}"


def embedding_figure(embedding: dict, path: Path) -> bool:
    """Per-passage cosine similarity to the original model's embedding, one box per method and pooling."""
    methods = ordered(embedding)
    if not methods:
        return False
    poolings = list(embedding[methods[0]])
    fig = Figure(figsize=(4.5 * len(poolings), 3.6))  # no pyplot: no GUI backend, nothing global
    axes = fig.subplots(1, len(poolings), squeeze=False)
    for ax, p in zip(axes[0], poolings, strict=True):
        ax.boxplot([embedding[m][p]["per_passage"] for m in methods], tick_labels=[display_name(m) for m in methods])
        ax.set_title(f"Embedding agreement: {_label(p)}")
        ax.set_ylabel("cosine to the original model")
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)
    return True


def provenance_section(config: dict) -> list[str]:
    cfg, model, data = config.get("config", {}), config.get("model", {}), config.get("data", {})
    out = ["## Configuration and provenance", "",
           f"- encoder: `{cfg.get('model')}` ({model.get('architecture')}), dtype {cfg.get('dtype')}, "
           f"seed {cfg.get('seed')}; declared sentence pooling: {model.get('pooling') or 'none'}",
           f"- methods: {', '.join(cfg.get('methods', []))}; converted layers: {config.get('converted_layers')}",
           f"- data: `{data.get('name')}`"]
    out += [f"  - {split} SHA256 `{h}`" for split, h in sorted(data.get("sha256", {}).items())]
    out += ["- model files:"] + [f"  - `{f}` SHA256 `{h}`" for f, h in sorted((model.get("sha256") or {}).items())]
    out += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(config.get("versions", {}).items())), ""]
    plan, passages = config.get("split_plan", {}), config.get("blocks", {})
    rows = [[role, p["split"], f"{p['start']}..{p['start'] + p['count'] - 1}",
             "x".join(map(str, passages.get(role, {}).get("shape", []))),
             str(passages.get(role, {}).get("real_tokens"))] for role, p in
            ((r, plan[r]) for r in PASSAGE_ROLES if r in plan)]
    if rows:
        out += [f"Passage plan (paragraphs of >= {plan.get('min_words')} words, each tokenised with its special "
                f"tokens, truncated to {plan.get('max_len')} tokens (or the tokenizer's or position embeddings' "
                "limit, when shorter), right-padded; roles disjoint):", "",
                markdown_table(["role", "split", "paragraphs", "tokens (passages x padded length)", "real tokens"],
                               rows), ""]
    out += ["<details><summary>effective configuration (config.json)</summary>", "", "```json",
            json.dumps(cfg, indent=2, sort_keys=True), "```", "", "</details>", ""]
    return out


def _embedding(metrics: dict, has_fig: bool, fig_seed=None) -> list[str]:
    out = ["## Embedding agreement with the original encoder (held-out passages)", ""]
    emb = metrics.get("embedding") or {}
    if not emb:
        return out + ["Embedding similarity was not evaluated in this run.", ""]
    own, std = metrics.get("pooling"), metrics.get("embedding_std") or {}
    poolings = list(next(iter(emb.values())))
    header = ["Method"] + [f"cosine, {_label(p)}{OWN if p == own else ''} (mean / min)" for p in poolings]

    def cell(m, p):
        sd = std.get(m, {}).get(p, {}).get("mean")
        spread = f" ± {sd:.1e}" if sd is not None else ""  # over seeds; min: over seeds and passages
        return f"{cosine_text(emb[m][p]['mean'])}{spread} / {cosine_text(emb[m][p]['min'])}"

    rows = [[display_name(m)] + [cell(m, p) for p in poolings] for m in ordered(emb)]
    seeds = metrics.get("seeds")
    out += ["Each converted model (kernels on the base weights, ordinary HF forward with padding) against the "
            "original, one cosine per passage" + (f"; mean ± sample std over seeds {seeds}, min over every seed"
                                                  if seeds else "") + ":", "", markdown_table(header, rows), ""]
    if has_fig:
        caption = f" of seed {fig_seed}'s kernels" if fig_seed is not None else ""
        out += [f"Per-passage cosines{caption}:", "", "![embedding agreement](figures/embedding_cosine.png)", ""]
    return out


OWN = " (the model's own)"


def _label(pooling: str) -> str:
    return " + ".join(POOLING_LABEL.get(p, p) for p in pooling.split("+"))


def _not_run(metrics: dict) -> list[str]:
    items = metrics.get("not_run") or {}
    return ["## Not run for encoders", ""] + [f"- {k}: {v}" for k, v in sorted(items.items())] + [""]


def write_encoder_report(run_dir: str | Path, *, console=None) -> Path:
    """Write DIR/report.md (and DIR/figures/*.png) of an encoder run."""
    run_dir = Path(run_dir)
    metrics = read_optional(run_dir / "metrics.json")
    if metrics is None:
        raise ValueError(f"run_dir: {run_dir} has no metrics.json (run `oal run --out {run_dir}` first)")
    seeds = metrics.get("seeds")
    first = run_dir / f"seed-{seeds[0]}" if seeds else run_dir
    prefix = f"seed-{seeds[0]}/" if seeds else ""
    config = read_optional(run_dir / "config.json") or {}
    fig_dir = run_dir / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    calibration = read_optional(first / "calibration.json")
    has_cal = bool(calibration) and calibration_figure(calibration, fig_dir / "calibration_curves.png")
    per_passage = (read_optional(first / "metrics.json") or {}).get("embedding") or {}
    has_emb = bool(per_passage) and embedding_figure(per_passage, fig_dir / "embedding_cosine.png")
    own = set(OWN_FIGURES) | {"embedding_cosine.png"}
    analysis_figs = sorted(p.name for p in (first / "figures").glob("*.png") if p.name not in own) \
        if (first / "figures").is_dir() else []
    analysis = [ln.replace("](figures/", f"]({prefix}figures/") for ln in analysis_section(first, analysis_figs)]

    head = f"Seeds: {seeds}" if seeds else f"Seed: {metrics.get('seed')}"
    lines = [f"# OAL encoder run report: `{metrics.get('model')}`", "",
             f"{head}; methods: {', '.join(metrics.get('methods', []))}; converted layers: "
             f"{metrics.get('converted_layers')}. Encoder protocol: non-causal attention (every real token sees every "
             "real token), padding masked throughout.", ""]
    lines += provenance_section(config) + analysis + calibration_section(calibration, has_cal)
    lines += fidelity_section(metrics)
    lines += _embedding(metrics, has_emb, seeds[0] if seeds else None) + _not_run(metrics) + timing_section(metrics)
    return write_markdown(run_dir, lines, console=console)
