"""`DIR/report.md` and its figures, from the files of a run directory (never from memory).

Sections: the summary (each arm's adapted PPL against softmax's, fidelity, zero-shot), the analysis figures,
calibration curves, the fidelity table (paper Table 2 layout) and per-layer figure, the perplexity table (paper
Table 3 layout, with the paper's Qwen2.5-0.5B numbers as a labelled reference group), Table 3's zero-shot columns,
passkey retrieval, layer selection, adaptation curves, time per stage, and last the configuration and provenance
(versions, hashes, splits).
"""

from __future__ import annotations

import re
from pathlib import Path

from oal.evaluate.passkey import passkey_section
from oal.pipeline.report_figures import adaptation_figure, calibration_figure, fidelity_figure, perplexity_figure
from oal.pipeline.report_format import display_name, markdown_table, read_optional
from oal.pipeline.report_sections import (
    adaptation_section,
    analysis_section,
    calibration_section,
    fidelity_section,
    perplexity_section,
    provenance_section,
    regime_section,
    timing_section,
    zeroshot_section,
)
from oal.pipeline.report_summary import summary_section
from oal.pipeline.selection import selection_section
from oal.rundir.files import atomic_write_text, make_dirs

__all__ = ["OWN_FIGURES", "figure_references", "first_seed", "write_markdown", "write_report"]

OWN_FIGURES = ("calibration_curves.png", "adaptation_curves.png", "perplexity.png", "group_budget.png", "passkey.png",
               "layer_selection.png", "fidelity_per_layer.png")


def figure_references(markdown: str) -> list[str]:
    """Relative paths of every image the report embeds."""
    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)


def write_report(run_dir: str | Path, *, console=None) -> Path:
    """Write DIR/report.md (and DIR/figures/*.png) from config.json, metrics.json, calibration.json etc."""
    run_dir = Path(run_dir)
    metrics = read_optional(run_dir / "metrics.json")
    if metrics is None:
        raise ValueError(f"run_dir: {run_dir} has no metrics.json (run `oal run --out {run_dir}` first)")
    config = read_optional(run_dir / "config.json") or {}
    fig_dir = make_dirs(run_dir / "figures")
    # --layers auto:K keeps every candidate layer's calibration in candidates/
    calibration = (read_optional(run_dir / "calibration.json")
                   or read_optional(run_dir / "candidates" / "calibration.json"))
    if calibration is None and metrics.get("seeds"):
        calibration = read_optional(run_dir / f"seed-{metrics['seeds'][0]}" / "calibration.json")
    seeds = metrics.get("seeds") or []
    one = f"seed {seeds[0]} alone (of seeds {seeds})" if len(seeds) > 1 else ""  # the curves are not averaged
    has_cal = bool(calibration) and calibration_figure(calibration, fig_dir / "calibration_curves.png", one)
    adapt_dir = run_dir if not metrics.get("seeds") else run_dir / f"seed-{metrics['seeds'][0]}"
    has_adapt = adaptation_figure(adapt_dir, metrics.get("methods", []), fig_dir / "adaptation_curves.png", one)
    has_ppl = perplexity_figure(metrics, fig_dir / "perplexity.png")
    analysis_dir = adapt_dir
    analysis_figs = sorted(p.name for p in (analysis_dir / "figures").glob("*.png") if p.name not in OWN_FIGURES) \
        if (analysis_dir / "figures").is_dir() else []
    prefix = "" if analysis_dir == run_dir else f"seed-{metrics['seeds'][0]}/"

    lines = [f"# OAL run report: `{metrics.get('model')}`", ""]
    seeds = metrics.get("seeds")
    head = f"Seeds: {seeds}" if seeds else f"Seed: {metrics.get('seed')}"
    lines += [f"{head}; methods: {', '.join(metrics.get('methods', []))}; "
              f"converted layers: {metrics.get('converted_layers')}.", ""]
    lines += summary_section(metrics, config)
    analysis = analysis_section(analysis_dir, analysis_figs)
    if prefix:
        analysis = [ln.replace("](figures/", f"]({prefix}figures/") for ln in analysis]
        analysis = [ln.replace(f"![{prefix}", "![") for ln in analysis]
    lines += first_seed(analysis, seeds)
    lines += first_seed(calibration_section(calibration, has_cal), seeds)
    lines += fidelity_section(metrics)
    if fidelity_figure(metrics, fig_dir / "fidelity_per_layer.png"):
        lines += ["![fidelity per layer](figures/fidelity_per_layer.png)", ""]
    lines += first_seed(regime_section(adapt_dir, prefix), seeds)
    cfg = config.get("config") or {}
    lines += perplexity_section(metrics, has_ppl, cfg.get("preset"))
    lines += zeroshot_section(metrics, cfg.get("zeroshot_tasks"))
    lines += selection_section(metrics, fig_dir, markdown_table)
    lines += passkey_section(metrics, fig_dir, markdown_table, display_name)
    lines += adaptation_section(adapt_dir, metrics, has_adapt)
    lines += timing_section(metrics)
    lines += provenance_section(config)  # last: hashes and versions are for the record, not the first screen
    return write_markdown(run_dir, lines, console=console)


def first_seed(lines: list[str], seeds: list[int] | None) -> list[str]:
    """`lines` with a note under each section heading that its numbers are the first seed's alone: a multi-seed
    report averages only metrics.json's numbers, and these sections are read from seed-<s>/ (they would otherwise
    pass for the run's, beside means that differ from them)."""
    if not seeds or len(seeds) < 2:
        return lines
    note = (f"Seed {seeds[0]} alone (of seeds {seeds}; not averaged): each seed's own is in "
            "seed-<s>/report.md.")
    out = []
    for i, ln in enumerate(lines):
        out.append(ln)
        if ln.startswith("## ") and i + 1 < len(lines) and not lines[i + 1]:
            out += ["", note]
    return out


def write_markdown(run_dir: Path, lines: list[str], *, console=None) -> Path:
    """Write DIR/report.md from `lines`, after checking that every figure it embeds exists and is not empty."""
    text = "\n".join(lines)
    for ref in figure_references(text):
        p = run_dir / ref
        if not p.is_file() or p.stat().st_size == 0:
            raise RuntimeError(f"report: figure {ref} is referenced but missing or empty")
    path = atomic_write_text(run_dir / "report.md", text)
    if console is not None:
        console.print(f"report: {path}")
    return path

