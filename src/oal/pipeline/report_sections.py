"""The sections of `report.md`, each a list of markdown lines built from the files of a run directory:
configuration and provenance, analysis, calibration, fidelity (paper Table 2 layout), attention regime, perplexity
(Table 3 layout, with the paper's Qwen2.5-0.5B numbers as a labelled reference group), zero-shot, adaptation and
time per stage."""

from __future__ import annotations

import json
from pathlib import Path

from oal.analysis.regime import REGIME_FILE
from oal.data.zeroshot import DISPLAY_NAMES
from oal.diagnostics.budget import BUDGET_FILE
from oal.pipeline.report_format import (
    PAPER_TABLE2_QWEN,
    PAPER_TABLE3,
    PAPER_TABLE3_QWEN,
    display_name,
    distinct_digits,
    fmt,
    fmt_pm,
    fmt_std,
    markdown_table,
    ordered,
    read_optional,
)

__all__ = ["adaptation_section", "analysis_section", "calibration_section", "fidelity_section", "perplexity_section",
           "provenance_section", "regime_section", "stability_section", "timing_section", "window_comparison",
           "zeroshot_section"]


def provenance_section(config: dict) -> list[str]:
    out = ["## Configuration and provenance", ""]
    cfg = config.get("config", {})
    seeds = config.get("seeds") if isinstance(config.get("seeds"), list) else []
    # a multi-seed DIR keeps its first seed's configuration: every seed-<s>/config.json differs in the seed alone
    seed = (f"seeds {seeds} (the configuration below is seed {cfg.get('seed')}'s)" if len(seeds) > 1
            else f"seed {cfg.get('seed')}")
    out.append(f"- model: `{cfg.get('model')}`, preset `{cfg.get('preset')}`, dtype {cfg.get('dtype')}, {seed}")
    out.append(f"- methods: {', '.join(cfg.get('methods', []))}; converted layers: {config.get('converted_layers')}")
    windows = [m for m in cfg.get("methods", []) if m in ("swa", "oal-swa", "global-swa")]
    if windows:
        out.append(f"- sliding windows ({', '.join(windows)}): the last W = {cfg.get('window')} keys and the first "
                   f"S = {cfg.get('sinks')} keys (sinks) exact")
    data = config.get("data", {})
    out.append(f"- data: `{data.get('name')}`")
    for split, h in sorted(data.get("sha256", {}).items()):
        out.append(f"  - {split} SHA256 `{h}`")
    model = config.get("model", {})
    hashes = model.get("sha256") or model.get("hashes") or {}
    if isinstance(hashes, dict) and hashes:
        out.append("- model files:")
        for f, h in sorted(hashes.items()):
            out.append(f"  - `{f}` SHA256 `{h}`")
    elif hashes:
        out.append(f"- model SHA256: `{hashes}`")
    for k in ("revision", "name_or_path", "source"):
        if model.get(k):
            out.append(f"- model {k}: `{model[k]}`")
    out += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in sorted(config.get("versions", {}).items())), ""]
    plan, blocks = config.get("split_plan", {}), config.get("blocks", {})
    rows = []
    for role, b in plan.items():
        if not isinstance(b, dict):
            continue
        idx = b.get("indices", [])
        span = f"{idx[0]}..{idx[-1]}" if len(idx) > 1 else (str(idx[0]) if idx else "-")
        if b.get("through_end"):
            span += " .. end"
        shape = blocks.get(role, {}).get("shape", ["?", "?"])
        rows.append([role, str(b.get("corpus") or "run corpus"), b.get("split", "?"), str(b.get("block_len")),
                     span, str(shape[0])])
    if rows:
        out += ["Data split plan (disjoint token ranges; block i covers tokens [i L, (i+1) L) of its split):", "",
                markdown_table(["role", "corpus", "split", "block length L", "block indices", "blocks used"], rows), ""]
    out += ["<details><summary>effective configuration (config.json)</summary>", "", "```json",
            json.dumps(cfg, indent=2, sort_keys=True), "```", "", "</details>", ""]
    return out


def analysis_section(run_dir: Path, figures: list[str]) -> list[str]:
    out = ["## Contribution analysis and grouping (Sections 3, 4.2; App. B)", ""]
    summary = read_optional(run_dir / "analysis.json")
    if summary:
        ng = summary.get("n_groups", {})
        conc = summary.get("concentration", {}).get("mean", {})
        out.append(f"- group-count histogram over heads: {ng.get('histogram')} "
                   f"(isotropic Gaussian control: {ng.get('gaussian_histogram')})")
        if summary.get("procedure", "app_b") != "app_b":
            what = ("App. B over RoPE's rotation pairs (dims r and r + d/2 share a group)"
                    if summary["procedure"] == "app_b_pairs" else "Fig. 2(b)'s fixed budget per head")
            out.append(f"- groups used: `{summary['procedure']}`, {what}, a departure "
                       f"from the paper's App. B protocol (App. B would give {ng.get('app_b_histogram')})")
        if conc:
            out.append(f"- mean top-5 contribution concentration: {fmt(conc.get('real_top5'), 3)} "
                       f"(Gaussian control {fmt(conc.get('gaussian_top5'), 3)})")
        out.append("")
        out += stability_section(summary)
    if not figures:
        out += ["No analysis figures in this run directory.", ""]
    for f in figures:
        out += [f"![{f}](figures/{f})", ""]
    return out


def stability_section(summary: dict) -> list[str]:
    """App. A.3: calibration vs held-out contributions, and the top-5 dims' share across prefix lengths (Table 4)."""
    out = []
    inputs, lengths = summary.get("stability_inputs"), summary.get("stability_lengths")
    if inputs:
        rep = inputs["representative"]
        out += ["Stability across inputs (App. A.3, Fig. 6): Spearman rho between calibration and held-out chi "
                f"{fmt(inputs['mean_spearman'], 3)} on average (minimum {fmt(inputs['min_spearman'], 3)}), top-5 "
                f"overlap {inputs['mean_top5_overlap']:.2f} of 5; representative head: rho {fmt(rep['spearman'], 3)}, "
                f"overlap {rep['top5_overlap']} of 5.", ""]
    if lengths:
        rep = lengths["representative"]
        dims = [f"r = {d}" for d in rep["dims"]]
        rows = [[str(n)] + [f"{p:.2f}" for p in row] for n, row in zip(lengths["lengths"], rep["percent"], strict=True)]
        out += ["Stability across sequence lengths (Table 4 layout): normalised contribution (%) of the representative "
                "head's top-5 dimensions at each prefix length.", "", markdown_table(["length"] + dims, rows), ""]
    return out


def regime_section(run_dir: Path, prefix: str) -> list[str]:
    """The attention regime (oal.analysis.regime), the per-query offsets with the planted-offset experiment and OAL's
    gain per layer beside them (oal.diagnostics.offset_part), and the group-budget curve beside App. B (Fig. 2(b))."""
    from oal.analysis.regime import regime_markdown
    from oal.diagnostics.budget import budget_markdown
    from oal.diagnostics.offset_part import offset_report

    out = []
    regime, analysis = read_optional(run_dir / REGIME_FILE), read_optional(run_dir / "analysis.json")
    if regime or (analysis and "regime" in analysis):
        where = ("on the held-out fidelity blocks, with the calibrated kernels" if regime
                 else "on the grouping prompts (before calibration)")
        out += ["## Attention regime: can a quadratic kernel follow this softmax?", ""]
        out += regime_markdown(regime or analysis["regime"], where)
    out += offset_report(run_dir, prefix)
    budget = read_optional(run_dir / BUDGET_FILE)
    if budget:
        out += ["## Group budget beside App. B (Fig. 2(b))", "", *budget_markdown(budget)]
        if (run_dir / "figures" / "group_budget.png").is_file():
            out += [f"![group budget]({prefix}figures/group_budget.png)", ""]
    return out


def calibration_section(calibration: dict | None, has_fig: bool) -> list[str]:
    out = ["## Calibration (Eq. 20, App. B)", ""]
    if not calibration:
        return out + ["Calibration did not run.", ""]
    rows = []
    for m in ordered(calibration.get("methods", {})):
        heads = [h for layer in calibration["methods"][m].values() for h in layer.get("heads", [])]
        if not heads:
            rows.append([display_name(m), "-", "-", "no trainable parameters"])
            continue
        chosen: dict[str, int] = {}
        for h in heads:
            chosen[h["init"]] = chosen.get(h["init"], 0) + 1
        finite = [h["val_mse"] for h in heads if h["val_mse"] is not None]  # null: no finite validation MSE
        mean = f"{sum(finite) / len(finite):.5f}" if finite else "-"
        inits = ", ".join(f"{k}: {v}" for k, v in sorted(chosen.items()))
        rows.append([display_name(m), str(len(heads)), mean, inits])
    out += ["Validation MSE: the calibrated kernel's attention output against softmax's on the calibration "
            "validation blocks (Eq. 20; lower is better), mean over units.", "",
            markdown_table(["method", "units (heads or layers)", "mean validation MSE", "chosen initialisation"], rows),
            ""]
    if has_fig:
        out += ["![calibration curves](figures/calibration_curves.png)", ""]
    return out


def fidelity_section(metrics: dict) -> list[str]:
    out = ["## Frozen-attention fidelity (paper Table 2 layout; Eq. 21-22)", ""]
    fid = metrics.get("fidelity") or {}
    std = metrics.get("fidelity_std") or {}
    if not fid:
        return out + ["Fidelity was not evaluated in this run.", ""]
    keys = ("mse", "relmse", "mse_post_o", "relmse_post_o")
    multi = len(metrics.get("seeds", [])) > 1
    digits = {k: distinct_digits([fid[m].get(k) for m in fid], 4) for k in keys}
    rows = [[display_name(m), *(fmt_pm(fid[m].get(k), std.get(m, {}).get(k) if multi else None, digits[k])
                                for k in keys)] for m in ordered(fid)]
    header = ["Method", "Before W_o MSE", "Before W_o RelMSE", "After W_o MSE", "After W_o RelMSE"]
    out += [f"This run: layers {metrics.get('converted_layers')}, all query heads, fidelity blocks of the split plan "
            "(lower is better for all four)" + (f"; mean ± sample std over seeds {metrics['seeds']}" if multi else "")
            + ".",
            "", markdown_table(header, rows), ""]
    measured = [f"{display_name(m)} {fid[m]['dtype']}" for m in ordered(fid) if fid[m].get("dtype")]
    if measured:  # `oal evaluate --dtype` may measure in another dtype than the run's
        out += [f"Base model dtype of the rows measured by `oal evaluate`: {', '.join(measured)}.", ""]
    paper = {m: fid[m]["subsets"]["paper_layers"] for m in ordered(fid) if "paper_layers" in fid[m].get("subsets", {})}
    if paper:
        rows = [[display_name(m), *(fmt(row.get(k)) for k in keys)] for m, row in paper.items()]
        layers = next(iter(paper.values()))["layers"]
        out += [f"The paper's layers {layers} alone (Sec. 5.1: all query heads of these layers), the numbers to "
                "hold beside its Table 2:", "", markdown_table(header, rows), ""]
    if "oal" in fid and "global" in fid and fid["oal"].get("per_layer") and fid["global"].get("per_layer"):
        rows = []
        d = distinct_digits([r.get("relmse") for m in ("oal", "global") for r in fid[m]["per_layer"].values()], 4)
        for layer, o in fid["oal"]["per_layer"].items():
            g = fid["global"]["per_layer"].get(layer)
            if g:
                rel = 100 * (g["relmse"] - o["relmse"]) / g["relmse"]
                rows.append([layer, fmt(o["relmse"], d), fmt(g["relmse"], d), f"{rel:+.1f}%",
                             "yes" if o["relmse"] < g["relmse"] else "no"])
        what = f", mean over seeds {metrics['seeds']}" if multi else ""
        out += [f"Per layer, OAL against the learned global quadratic (RelMSE before W_o{what}; lower is better):", "",
                markdown_table(["layer", "OAL", "global", "reduction", "OAL better"], rows), ""]
    ref = [[display_name(m), *(f"{v:.3f}" for v in vals)] for m, vals in PAPER_TABLE2_QWEN.items()]
    out += ["Reference, **paper Table 2** (Qwen2.5-0.5B, layers 4/12/20, N = 4096; not comparable in scale with a "
            "different model):", "", markdown_table(header, ref), ""]
    return out


def perplexity_section(metrics: dict, has_fig: bool, preset: str | None = None) -> list[str]:
    out = ["## Language modelling after LoRA adaptation (paper Table 3 layout; App. F.2-F.3)", ""]
    ppl = metrics.get("perplexity") or {}
    pre = metrics.get("perplexity_no_adapt") or {}
    std = metrics.get("perplexity_std") or {}
    seeds = metrics.get("seeds", [])
    if ppl or pre:
        header = ["Method", "PPL (LoRA)", "PPL before adaptation"]
        if len(seeds) > 1:
            header.append(f"per seed {seeds}")
        rows = []
        multi = len(seeds) > 1
        pre_std = metrics.get("perplexity_no_adapt_std") or {}
        d_ppl, d_pre = distinct_digits(ppl.values(), 4), distinct_digits(pre.values(), 4)
        for m in ordered(set(ppl) | set(pre)):
            row = [display_name(m), fmt_pm(ppl.get(m), std.get(m) if multi else None, d_ppl),
                   fmt_pm(pre.get(m), pre_std.get(m) if multi else None, d_pre)]
            if multi:
                row.append(", ".join(fmt(metrics["per_seed"][str(s)]["perplexity"].get(m), d_ppl) for s in seeds))
            rows.append(row)
        label = f"This run ({metrics.get('model')}, test split of the run's corpus"
        label += f", mean ± sample std over seeds {seeds})" if len(seeds) > 1 else ")"
        out += [label + ":", "", markdown_table(header, rows), ""]
        if "oal" in ppl and "global" in ppl:
            verdict = "beats" if ppl["oal"] < ppl["global"] else "does NOT beat"
            rel = 100 * (ppl["global"] - ppl["oal"]) / ppl["global"]
            line = (f"OAL {verdict} the learned global quadratic in adapted test PPL: {fmt(ppl['oal'], d_ppl)} vs "
                    f"{fmt(ppl['global'], d_ppl)} ({rel:+.3f}% relative to global)")
            if "oal" in std and "global" in std and multi:
                line += f"; sample std over seeds {fmt_std(std['oal'])} (OAL) and {fmt_std(std['global'])} (global)"
            elif not multi:
                line += "; one seed, so no spread is measured (`--seeds` gives mean ± sample std)"
            out += [line + ".", ""]
        out += window_comparison(ppl)
    else:
        out += ["Perplexity was not evaluated in this run.", ""]
    backbone, table = PAPER_TABLE3.get(preset, ("Qwen2.5-0.5B", PAPER_TABLE3_QWEN))
    ref = [[display_name(m), *(f"{v:.2f}" for v in vals)] for m, vals in table.items()]
    out += [f"Reference row group, **paper Table 3, {backbone}** (WikiText-103 test PPL, lower is better; zero-shot "
            "normalised accuracy %, higher is better); reported by the paper, not measured here:", "",
            markdown_table(["Method (paper)", "PPL", "PIQA", "HellaSwag", "ARC-E"], ref), ""]
    if has_fig:
        out += ["![perplexity](figures/perplexity.png)", ""]
    return out


def window_comparison(ppl: dict) -> list[str]:
    """The sliding windows against OAL in adapted test PPL, said plainly whichever way it goes: SWA against OAL, and
    whether the hybrid (window + OAL) is closer to softmax than both (by the PPL gap to softmax when it ran)."""
    out = []
    if "swa" in ppl and "oal" in ppl:
        who = "OAL beats the sliding-window baseline" if ppl["oal"] < ppl["swa"] else \
            "The sliding-window baseline beats OAL"
        out += [f"{who} in adapted test PPL: SWA {ppl['swa']:.4f} vs OAL {ppl['oal']:.4f}.", ""]
    if all(m in ppl for m in ("oal-swa", "oal", "swa")):
        ref = ppl.get("softmax")
        dist = {m: abs(ppl[m] - ref) if ref is not None else ppl[m] for m in ("oal-swa", "oal", "swa")}
        beaten = [n for m, n in (("oal", "OAL"), ("swa", "SWA")) if dist["oal-swa"] < dist[m]]
        verdict = ("is closer to softmax than both OAL and SWA" if len(beaten) == 2 else
                   f"is NOT closer to softmax than both (closer than {beaten[0]} only)" if beaten else
                   "is NOT closer to softmax than OAL or SWA")
        what = f"gap to softmax's {ref:.4f}" if ref is not None else "softmax not run: PPL itself"
        out += [f"The hybrid (window + OAL) {verdict} in adapted test PPL ({what}): hybrid {dist['oal-swa']:.4f}, "
                f"OAL {dist['oal']:.4f}, SWA {dist['swa']:.4f}.", ""]
    return out


def _blocks_per_update(a: dict) -> str:
    """The global batch, and the processes that shared it (data parallel) when there were several."""
    n = a.get("processes", 1)
    return f"{a.get('global_batch', 1)}" + (f" ({n} processes)" if n > 1 else "")


def _data_line(task: str, prov: dict) -> str:
    if prov.get("source") == "task_file":
        return (f"- {DISPLAY_NAMES[task]}: local file `{prov.get('path')}` in the {prov.get('schema_of')} schema "
                f"(unverified; SHA256 `{prov.get('sha256')}`), {prov.get('rows')} rows")
    pin = "matches the pinned hash" if prov.get("sha256_pinned") else \
        "no published hash to pin: recorded, then checked against the folder's manifest"
    return (f"- {DISPLAY_NAMES[task]}: `{prov.get('dataset_id')}` {prov.get('split')} at revision "
            f"`{prov.get('revision')}`, `{prov.get('file')}` from {prov.get('source')} (SHA256 `{prov.get('sha256')}`, "
            f"{pin}), {prov.get('rows')} rows")


def zeroshot_section(metrics: dict, selected: list[str] | None = None) -> list[str]:
    """Table 3's zero-shot columns; `selected`: the run's --tasks (config.json), to say why none was measured."""
    out = ["## Zero-shot accuracy (paper Table 3 columns; App. F.3)", ""]
    zs, std = metrics.get("zeroshot") or {}, metrics.get("zeroshot_std") or {}
    skipped = metrics.get("zeroshot_skipped") or {}
    data = metrics.get("zeroshot_data") or {}
    tasks = [t for t in DISPLAY_NAMES if any(t in z for z in zs.values())]
    if not zs:
        # `oal evaluate --zeroshot` on some seeds of a multi-seed run: not averaged, their own reports have it
        partial = {k.split(":", 1)[1]: v for k, v in (metrics.get("not_averaged") or {}).items()
                   if k.startswith("zeroshot:")}
        out += ["Zero-shot accuracy was " + ("measured on some seeds only, so not averaged (" + "; ".join(
            f"{k}: seeds {v} lack it or used other examples" for k, v in partial.items()) + "; each measured seed's "
            "`seed-<s>/report.md` gives its numbers)" if partial else "not evaluated in this run")
                + "; the PIQA, HellaSwag and ARC-E columns are missing."]
        out += [f"- {DISPLAY_NAMES.get(t, t)}: {why}" for t, why in skipped.items()]
        if not partial and not skipped and selected is not None and not selected:
            out += ["- no task was selected (`--tasks none`)."]
        return out + [""]
    multi = len(metrics.get("seeds", [])) > 1

    def cell(m, t, key="acc_norm"):
        row = zs.get(m, {}).get(t)
        if row is None:
            return "-"
        s = f"{row[key]:.2f}"
        return s + (f" ± {fmt_std(std[m][t][key], 2)}" if multi and t in std.get(m, {}) else "")

    ppl = metrics.get("perplexity") or {}
    rows = [[display_name(m), fmt(ppl.get(m), 4), *(cell(m, t) if t in tasks else "-" for t in DISPLAY_NAMES)]
            for m in ordered(zs)]
    what = f", mean ± sample std over seeds {metrics['seeds']}" if multi else ""
    out += [f"This run ({metrics.get('model')}{what}): test PPL after adaptation and zero-shot normalised accuracy "
            "(%; the paper's normalisation: log-likelihood per candidate token for PIQA and HellaSwag, per option "
            "character for ARC-E), on the selected adapted checkpoint:", "",
            markdown_table(["Method", "PPL (LoRA)", *DISPLAY_NAMES.values()], rows), ""]
    missing = [t for t in DISPLAY_NAMES if t not in tasks]
    if missing:
        out += ["Missing columns: " + "; ".join(
            f"{DISPLAY_NAMES[t]} ({skipped.get(t, 'not selected (--tasks)')})" for t in missing) + ".", ""]
    limits = {t: data[t]["limit"] for t in tasks if data.get(t, {}).get("limit")}
    if limits:
        out += ["**Quick run**: only the first " + ", ".join(f"{n} {DISPLAY_NAMES[t]}" for t, n in limits.items())
                + " examples (`--limit`); these numbers are not comparable with the paper's full sets.", ""]
    out += ["Data:", "", *(_data_line(t, data[t]) for t in tasks if t in data), ""]
    detail = [[display_name(m), DISPLAY_NAMES[t], cell(m, t, "acc"), cell(m, t), cell(m, t, "acc_norm_lmeval"),
               str(zs[m][t]["n"])] for m in ordered(zs) for t in tasks if t in zs[m]]
    out += ["Per task (%): `acc` ranks candidates by summed log-likelihood; `acc_norm` is the paper's normalisation; "
            "`acc_norm (lm-eval)` is lm-eval's, which divides by the option's character count for every task (the "
            "same as the paper's on ARC-E, characters instead of tokens on PIQA and HellaSwag).", "",
            markdown_table(["Method", "task", "acc", "acc_norm (paper)", "acc_norm (lm-eval)", "n"], detail), ""]
    return out


def adaptation_section(run_dir: Path, metrics: dict, has_fig: bool) -> list[str]:
    out = ["## Adaptation (App. F.2)", ""]
    ad = metrics.get("adapt") or {}
    if not ad:
        return out + ["Adaptation did not run.", ""]
    rows = [[display_name(m), str(a["steps"]), _blocks_per_update(a), str(a["best_step"]), f"{a['best_val_nll']:.4f}",
             str(a["n_lora_params"]), str(a["n_kernel_params"]), f"{a['kernel_change']:.4g}"] for m, a in
            ((m, ad[m]) for m in ordered(ad))]
    if metrics.get("seeds"):
        out += [f"Seed {metrics['seeds'][0]} shown; the other seeds are in metrics.json `per_seed`.", ""]
    out += [markdown_table(["method", "updates", "blocks per update", "selected update",
                            "best validation NLL (nats/token, lower is better)",
                    "LoRA parameters", "kernel parameters", "kernel change (L2)"], rows), ""]
    if has_fig:
        out += ["![adaptation curves](figures/adaptation_curves.png)", ""]
    return out


def _stage_order(name: str, methods: list[str]) -> tuple:
    base, _, method = name.partition(":")
    steps = ("setup", "analyze", "calibrate", "fidelity", "perplexity_no_adapt", "adapt", "perplexity", "zeroshot",
             "report")
    m = methods.index(method) if method in methods else -1
    group = 1 if base in ("perplexity_no_adapt", "adapt", "perplexity", "zeroshot") else (2 if base == "report" else 0)
    return (group, m,
            steps.index(base) if base in steps else len(steps), name)


def timing_section(metrics: dict) -> list[str]:
    el = metrics.get("elapsed_s") or {}
    order = sorted(el, key=lambda k: _stage_order(k, metrics.get("methods", [])))
    rows = [[k, f"{el[k]:.1f}"] for k in order]
    rows.append(["total", f"{sum(el.values()):.1f}"])
    note = ("Wall-clock seconds of the process that completed each stage (a skipped stage keeps its original "
            "time; a stage resumed mid-way counts only the resuming process).")
    if metrics.get("seeds"):
        note += f" Summed over seeds {metrics['seeds']}."
    if "report" not in el:
        note += " Writing this report is itself a stage: metrics.json adds its time once the file is written."
    return ["## Time per stage", "", note, "", markdown_table(["stage", "seconds"], rows), ""]
