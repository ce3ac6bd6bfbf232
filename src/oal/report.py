"""`DIR/report.md` and its figures, from the files of a run directory (never from memory).

Sections: configuration and provenance (versions, hashes, splits), the analysis figures, calibration curves, the
fidelity table (paper Table 2 layout), the perplexity table (paper Table 3 layout, with the paper's Qwen2.5-0.5B
numbers as a labelled reference group), Table 3's zero-shot columns, passkey retrieval, layer selection, adaptation
curves and time per stage.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .data.zeroshot import DISPLAY_NAMES  # noqa: E402
from .evaluate.passkey import passkey_section  # noqa: E402
from .runio import atomic_save_figure, atomic_write_text, load_json  # noqa: E402
from .selection import selection_section  # noqa: E402

__all__ = ["PAPER_TABLE2_QWEN", "PAPER_TABLE3_QWEN", "DISPLAY", "write_report", "figure_references"]

DISPLAY = {"softmax": "Softmax (LoRA)", "performer": "Performer", "spectraformer": "SpectraFormer",
           "dijiang": "DiJiang", "taylorshift": "TaylorShift", "global": "Learned global", "oal": "OAL"}
ORDER = ("softmax", "performer", "spectraformer", "dijiang", "taylorshift", "global", "oal")

# Paper Table 3, Qwen2.5-0.5B column group: WikiText-103 test PPL and zero-shot normalised accuracy (%).
PAPER_TABLE3_QWEN = {
    "softmax": (10.89, 70.18, 51.38, 62.63),
    "performer": (37.03, 57.78, 30.37, 38.93),
    "spectraformer": (34.78, 59.19, 31.77, 41.84),
    "dijiang": (36.05, 59.90, 31.47, 41.41),
    "taylorshift": (39.50, 59.90, 31.18, 40.78),
    "global": (31.71, 61.15, 32.43, 41.41),
    "oal": (27.50, 64.69, 37.20, 50.38),
}
# Paper Table 2 (Qwen2.5-0.5B, all query heads of layers 4, 12, 20, N = 4096): MSE, RelMSE before/after W_o.
PAPER_TABLE2_QWEN = {
    "performer": (0.103, 0.569, 0.038, 0.710),
    "spectraformer": (0.106, 0.585, 0.041, 0.772),
    "dijiang": (0.086, 0.474, 0.033, 0.631),
    "taylorshift": (0.088, 0.490, 0.034, 0.649),
    "oal": (0.078, 0.432, 0.031, 0.595),
}

OWN_FIGURES = ("calibration_curves.png", "adaptation_curves.png", "perplexity.png", "group_budget.png", "passkey.png",
               "layer_selection.png")


def _load(path: Path):
    return load_json(path) if path.exists() else None


def _ordered(methods) -> list[str]:
    return [m for m in ORDER if m in methods] + [m for m in methods if m not in ORDER]


def _name(m: str) -> str:
    return DISPLAY.get(m, m)


def _fmt(x, digits=4) -> str:
    """Fixed decimals, or scientific notation for values that would print as 0.0000."""
    if x is None:
        return "-"
    return f"{x:.{digits - 1}e}" if 0 < abs(x) < 10 ** (-digits + 1) else f"{x:.{digits}f}"


# ----------------------------------------------------------------------------------------------- figures


def _carry(curve: list, steps: list[int]) -> list[float]:
    """Validation MSE at `steps`, holding the last value after a head stopped early."""
    out, j, last = [], 0, None
    for s in steps:
        while j < len(curve) and curve[j][0] <= s:
            last = curve[j][1]
            j += 1
        out.append(last if last is not None else float("nan"))
    return out


def _auto_scale(ax, values, label: str) -> None:
    """Log scale only when the values span more than a factor 20 (otherwise log ticks are unreadable)."""
    vals = [v for v in values if v == v and v > 0]
    log = bool(vals) and max(vals) / min(vals) > 20
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(label + (" (log scale)" if log else ""))


def calibration_figure(calibration: dict, path: Path) -> bool:
    """Per method: mean validation MSE over heads and layers against updates, one line per initialisation."""
    methods = [m for m in _ordered(calibration.get("methods", {}))
               if any(v.get("heads") for v in calibration["methods"][m].values())]
    if not methods:
        return False
    fig, axes = plt.subplots(1, len(methods), figsize=(4.5 * len(methods), 3.6), squeeze=False)
    for ax, m in zip(axes[0], methods, strict=True):
        curves: dict[str, list] = {}
        for layer in calibration["methods"][m].values():
            for head in layer["heads"]:
                for init, c in head.get("curves", {}).items():
                    if c:
                        curves.setdefault(init, []).append(c)
        plotted = []
        for init, cs in sorted(curves.items()):
            steps = sorted({int(p[0]) for c in cs for p in c})
            vals = [_carry(c, steps) for c in cs]
            mean = [sum(v[i] for v in vals) / len(vals) for i in range(len(steps))]
            ax.plot(steps, mean, marker="o", ms=3, label=init)
            plotted += mean
        ax.set_title(f"{_name(m)}: calibration (Eq. 20)")
        ax.set_xlabel("update")
        _auto_scale(ax, plotted, "validation output MSE (mean over heads)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)
    return True


def adaptation_figure(run_dir: Path, methods: list[str], path: Path) -> bool:
    runs = {m: _load(run_dir / "adapter" / m / "adapt.json") for m in methods}
    runs = {m: r for m, r in runs.items() if r}
    if not runs:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for m in _ordered(runs):
        hist = runs[m]["history"]
        steps, loss = [h["step"] for h in hist], [h["loss"] for h in hist]
        k = max(1, len(loss) // 20)  # moving average over ~5% of the updates
        smooth = [sum(loss[max(0, i - k + 1) : i + 1]) / len(loss[max(0, i - k + 1) : i + 1]) for i in range(len(loss))]
        ax1.plot(steps, smooth, label=_name(m))
        val = runs[m]["validation"]
        ax2.plot([v["step"] for v in val], [v["val_nll"] for v in val], marker="o", label=_name(m))
    ax1.set(title="Adaptation: training loss (moving average)", xlabel="update", ylabel="next-token NLL (nats)")
    ax2.set(title="Validation NLL (checkpoint selection)", xlabel="update", ylabel="next-token NLL (nats)")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)
    return True


def perplexity_figure(metrics: dict, path: Path) -> bool:
    ppl = metrics.get("perplexity", {})
    if not ppl:
        return False
    methods = _ordered(ppl)
    pre = metrics.get("perplexity_no_adapt", {})
    std = metrics.get("perplexity_std", {})
    fig, ax = plt.subplots(figsize=(1.6 * len(methods) + 2, 3.8))
    x = range(len(methods))
    if pre:
        ax.bar([i - 0.2 for i in x], [pre.get(m, float("nan")) for m in methods], 0.4, label="before adaptation",
               color="#bbbbbb")
    ax.bar([i + 0.2 for i in x], [ppl[m] for m in methods], 0.4, yerr=[std.get(m, 0.0) for m in methods],
           label="after LoRA adaptation", color="#3a6ea5")
    ax.set_xticks(list(x), [_name(m) for m in methods], rotation=15)
    _auto_scale(ax, list(ppl.values()) + list(pre.values()), "test perplexity")
    ax.set_title("Test perplexity (App. F.3 protocol)")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)
    return True


# ----------------------------------------------------------------------------------------------- markdown


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _provenance(config: dict) -> list[str]:
    out = ["## Configuration and provenance", ""]
    cfg = config.get("config", {})
    out.append(f"- model: `{cfg.get('model')}`, preset `{cfg.get('preset')}`, dtype {cfg.get('dtype')}, "
               f"seed {cfg.get('seed')}")
    out.append(f"- methods: {', '.join(cfg.get('methods', []))}; converted layers: {config.get('converted_layers')}")
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
                _table(["role", "corpus", "split", "block length L", "block indices", "blocks used"], rows), ""]
    out += ["<details><summary>effective configuration (config.json)</summary>", "", "```json",
            json.dumps(cfg, indent=2, sort_keys=True), "```", "", "</details>", ""]
    return out


def _analysis(run_dir: Path, figures: list[str]) -> list[str]:
    out = ["## Contribution analysis and grouping (Sections 3, 4.2; App. B)", ""]
    summary = _load(run_dir / "analysis.json")
    if summary:
        ng = summary.get("n_groups", {})
        conc = summary.get("concentration", {}).get("mean", {})
        out.append(f"- group-count histogram over heads: {ng.get('histogram')} "
                   f"(isotropic Gaussian control: {ng.get('gaussian_histogram')})")
        if summary.get("procedure", "app_b") != "app_b":
            out.append(f"- groups used: `{summary['procedure']}`, Fig. 2(b)'s fixed budget per head, a departure "
                       f"from the paper's App. B protocol (App. B would give {ng.get('app_b_histogram')})")
        if conc:
            out.append(f"- mean top-5 contribution concentration: {conc.get('real_top5', float('nan')):.3f} "
                       f"(Gaussian control {conc.get('gaussian_top5', float('nan')):.3f})")
        out.append("")
        out += _stability(summary)
    if not figures:
        out += ["No analysis figures in this run directory.", ""]
    for f in figures:
        out += [f"![{f}](figures/{f})", ""]
    return out


def _stability(summary: dict) -> list[str]:
    """App. A.3: calibration vs held-out contributions, and the top-5 dims' share across prefix lengths (Table 4)."""
    out = []
    inputs, lengths = summary.get("stability_inputs"), summary.get("stability_lengths")
    if inputs:
        rep = inputs["representative"]
        out += ["Stability across inputs (App. A.3, Fig. 6): Spearman rho between calibration and held-out chi "
                f"{inputs['mean_spearman']:.3f} on average (minimum {inputs['min_spearman']:.3f}), top-5 overlap "
                f"{inputs['mean_top5_overlap']:.2f} of 5; representative head: rho {rep['spearman']:.3f}, "
                f"overlap {rep['top5_overlap']} of 5.", ""]
    if lengths:
        rep = lengths["representative"]
        dims = [f"r = {d}" for d in rep["dims"]]
        rows = [[str(n)] + [f"{p:.2f}" for p in row] for n, row in zip(lengths["lengths"], rep["percent"], strict=True)]
        out += ["Stability across sequence lengths (Table 4 layout): normalised contribution (%) of the representative "
                "head's top-5 dimensions at each prefix length.", "", _table(["length"] + dims, rows), ""]
    return out


def _regime_and_budget(run_dir: Path, prefix: str) -> list[str]:
    """The attention regime (oal.analysis.regime) and the group-budget curve beside App. B (Fig. 2(b))."""
    from .analysis.regime import REGIME_FILE, regime_markdown
    from .diagnostics.budget import BUDGET_FILE, budget_markdown

    out = []
    regime, analysis = _load(run_dir / REGIME_FILE), _load(run_dir / "analysis.json")
    if regime or (analysis and "regime" in analysis):
        where = ("on the held-out fidelity blocks, with the calibrated kernels" if regime
                 else "on the grouping prompts (before calibration)")
        out += ["## Attention regime: can a quadratic kernel follow this softmax?", ""]
        out += regime_markdown(regime or analysis["regime"], where)
    budget = _load(run_dir / BUDGET_FILE)
    if budget:
        out += ["## Group budget beside App. B (Fig. 2(b))", "", *budget_markdown(budget)]
        if (run_dir / "figures" / "group_budget.png").is_file():
            out += [f"![group budget]({prefix}figures/group_budget.png)", ""]
    return out


def _calibration(calibration: dict | None, has_fig: bool) -> list[str]:
    out = ["## Calibration (Eq. 20, App. B)", ""]
    if not calibration:
        return out + ["Calibration did not run.", ""]
    rows = []
    for m in _ordered(calibration.get("methods", {})):
        heads = [h for layer in calibration["methods"][m].values() for h in layer.get("heads", [])]
        if not heads:
            rows.append([_name(m), "-", "-", "no trainable parameters"])
            continue
        chosen: dict[str, int] = {}
        for h in heads:
            chosen[h["init"]] = chosen.get(h["init"], 0) + 1
        finite = [h["val_mse"] for h in heads if h["val_mse"] is not None]  # null: no finite validation MSE
        mean = f"{sum(finite) / len(finite):.5f}" if finite else "-"
        inits = ", ".join(f"{k}: {v}" for k, v in sorted(chosen.items()))
        rows.append([_name(m), str(len(heads)), mean, inits])
    out += [_table(["method", "units (heads or layers)", "mean validation MSE", "chosen initialisation"], rows), ""]
    if has_fig:
        out += ["![calibration curves](figures/calibration_curves.png)", ""]
    return out


def _fidelity(metrics: dict) -> list[str]:
    out = ["## Frozen-attention fidelity (paper Table 2 layout; Eq. 21-22)", ""]
    fid = metrics.get("fidelity") or {}
    std = metrics.get("fidelity_std") or {}
    if not fid:
        return out + ["Fidelity was not evaluated in this run.", ""]
    keys = ("mse", "relmse", "mse_post_o", "relmse_post_o")
    rows = []
    for m in _ordered(fid):
        cells = []
        for k in keys:
            cell = _fmt(fid[m].get(k))
            if std.get(m, {}).get(k) is not None and len(metrics.get("seeds", [])) > 1:
                cell += f" ± {std[m][k]:.4f}"
            cells.append(cell)
        rows.append([_name(m), *cells])
    header = ["Method", "Before W_o MSE", "Before W_o RelMSE", "After W_o MSE", "After W_o RelMSE"]
    out += [f"This run: layers {metrics.get('converted_layers')}, all query heads, fidelity blocks of the split plan.",
            "", _table(header, rows), ""]
    if "oal" in fid and "global" in fid and fid["oal"].get("per_layer") and fid["global"].get("per_layer"):
        rows = []
        for layer, o in fid["oal"]["per_layer"].items():
            g = fid["global"]["per_layer"].get(layer)
            if g:
                rel = 100 * (g["relmse"] - o["relmse"]) / g["relmse"]
                rows.append([layer, _fmt(o["relmse"]), _fmt(g["relmse"]), f"{rel:+.1f}%",
                             "yes" if o["relmse"] < g["relmse"] else "no"])
        what = " (mean over seeds)" if len(metrics.get("seeds", [])) > 1 else ""
        out += [f"Per layer, OAL against the learned global quadratic (RelMSE before W_o{what}):", "",
                _table(["layer", "OAL", "global", "reduction", "OAL better"], rows), ""]
    ref = [[_name(m), *(f"{v:.3f}" for v in vals)] for m, vals in PAPER_TABLE2_QWEN.items()]
    out += ["Reference, **paper Table 2** (Qwen2.5-0.5B, layers 4/12/20, N = 4096; not comparable in scale with a "
            "different model):", "", _table(header, ref), ""]
    return out


def _perplexity(metrics: dict, has_fig: bool) -> list[str]:
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
        for m in _ordered(set(ppl) | set(pre)):
            cell = _fmt(ppl.get(m), 4)
            if m in std and len(seeds) > 1:
                cell += f" ± {std[m]:.3f}"
            row = [_name(m), cell, _fmt(pre.get(m), 4)]
            if len(seeds) > 1:
                row.append(", ".join(_fmt(metrics["per_seed"][str(s)]["perplexity"].get(m), 4) for s in seeds))
            rows.append(row)
        label = f"This run ({metrics.get('model')}, test split of the run's corpus"
        label += f", mean ± sample std over seeds {seeds})" if len(seeds) > 1 else ")"
        out += [label + ":", "", _table(header, rows), ""]
        if "oal" in ppl and "global" in ppl:
            verdict = "beats" if ppl["oal"] < ppl["global"] else "does NOT beat"
            rel = 100 * (ppl["global"] - ppl["oal"]) / ppl["global"]
            line = (f"OAL {verdict} the learned global quadratic in adapted test PPL: {ppl['oal']:.4f} vs "
                    f"{ppl['global']:.4f} ({rel:+.3f}% relative to global)")
            if "oal" in std and "global" in std and len(seeds) > 1:
                line += f"; sample std over seeds {std['oal']:.4f} (OAL) and {std['global']:.4f} (global)"
            out += [line + ".", ""]
    else:
        out += ["Perplexity was not evaluated in this run.", ""]
    ref = [[_name(m), *(f"{v:.2f}" for v in vals)] for m, vals in PAPER_TABLE3_QWEN.items()]
    out += ["Reference row group, **paper Table 3, Qwen2.5-0.5B** (WikiText-103 test PPL, zero-shot normalised "
            "accuracy %); reported by the paper, not measured here:", "",
            _table(["Method (paper)", "PPL", "PIQA", "HellaSwag", "ARC-E"], ref), ""]
    if has_fig:
        out += ["![perplexity](figures/perplexity.png)", ""]
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


def _zeroshot(metrics: dict) -> list[str]:
    out = ["## Zero-shot accuracy (paper Table 3 columns; App. F.3)", ""]
    zs, std = metrics.get("zeroshot") or {}, metrics.get("zeroshot_std") or {}
    skipped = metrics.get("zeroshot_skipped") or {}
    data = metrics.get("zeroshot_data") or {}
    tasks = [t for t in DISPLAY_NAMES if any(t in z for z in zs.values())]
    if not zs:
        out += ["Zero-shot accuracy was not evaluated in this run; the PIQA, HellaSwag and ARC-E columns are missing."]
        out += [f"- {DISPLAY_NAMES.get(t, t)}: {why}" for t, why in skipped.items()] + [""]
        return out
    multi = len(metrics.get("seeds", [])) > 1

    def cell(m, t, key="acc_norm"):
        row = zs.get(m, {}).get(t)
        if row is None:
            return "-"
        s = f"{row[key]:.2f}"
        return s + (f" ± {std[m][t][key]:.2f}" if multi and t in std.get(m, {}) else "")

    ppl = metrics.get("perplexity") or {}
    rows = [[_name(m), _fmt(ppl.get(m), 4), *(cell(m, t) if t in tasks else "-" for t in DISPLAY_NAMES)]
            for m in _ordered(zs)]
    what = f", mean ± sample std over seeds {metrics['seeds']}" if multi else ""
    out += [f"This run ({metrics.get('model')}{what}): test PPL after adaptation and zero-shot normalised accuracy "
            "(%; the paper's normalisation: log-likelihood per candidate token for PIQA and HellaSwag, per option "
            "character for ARC-E), on the selected adapted checkpoint:", "",
            _table(["Method", "PPL (LoRA)", *DISPLAY_NAMES.values()], rows), ""]
    missing = [t for t in DISPLAY_NAMES if t not in tasks]
    if missing:
        out += ["Missing columns: " + "; ".join(
            f"{DISPLAY_NAMES[t]} ({skipped.get(t, 'not selected (--tasks)')})" for t in missing) + ".", ""]
    limits = {t: data[t]["limit"] for t in tasks if data.get(t, {}).get("limit")}
    if limits:
        out += ["**Quick run**: only the first " + ", ".join(f"{n} {DISPLAY_NAMES[t]}" for t, n in limits.items())
                + " examples (`--limit`); these numbers are not comparable with the paper's full sets.", ""]
    out += ["Data:", "", *(_data_line(t, data[t]) for t in tasks if t in data), ""]
    detail = [[_name(m), DISPLAY_NAMES[t], cell(m, t, "acc"), cell(m, t), cell(m, t, "acc_norm_lmeval"),
               str(zs[m][t]["n"])] for m in _ordered(zs) for t in tasks if t in zs[m]]
    out += ["Per task (%): `acc` ranks candidates by summed log-likelihood; `acc_norm` is the paper's normalisation; "
            "`acc_norm (lm-eval)` is lm-eval's, which divides by the option's character count for every task (the "
            "same as the paper's on ARC-E, characters instead of tokens on PIQA and HellaSwag).", "",
            _table(["Method", "task", "acc", "acc_norm (paper)", "acc_norm (lm-eval)", "n"], detail), ""]
    return out


def _adaptation(run_dir: Path, metrics: dict, has_fig: bool) -> list[str]:
    out = ["## Adaptation (App. F.2)", ""]
    ad = metrics.get("adapt") or {}
    if not ad:
        return out + ["Adaptation did not run.", ""]
    rows = [[_name(m), str(a["steps"]), _blocks_per_update(a), str(a["best_step"]), f"{a['best_val_nll']:.4f}",
             str(a["n_lora_params"]), str(a["n_kernel_params"]), f"{a['kernel_change']:.4g}"] for m, a in
            ((m, ad[m]) for m in _ordered(ad))]
    if metrics.get("seeds"):
        out += [f"Seed {metrics['seeds'][0]} shown; the other seeds are in metrics.json `per_seed`.", ""]
    out += [_table(["method", "updates", "blocks per update", "selected update", "best validation NLL",
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


def _timing(metrics: dict) -> list[str]:
    el = metrics.get("elapsed_s") or {}
    order = sorted(el, key=lambda k: _stage_order(k, metrics.get("methods", [])))
    rows = [[k, f"{el[k]:.1f}"] for k in order]
    rows.append(["total", f"{sum(el.values()):.1f}"])
    note = ("Wall-clock seconds of the process that completed each stage (a skipped stage keeps its original "
            "time; a stage resumed mid-way counts only the resuming process).")
    if metrics.get("seeds"):
        note += f" Summed over seeds {metrics['seeds']}."
    return ["## Time per stage", "", note, "", _table(["stage", "seconds"], rows), ""]


def figure_references(markdown: str) -> list[str]:
    """Relative paths of every image the report embeds."""
    import re

    return re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)


def write_report(run_dir: str | Path, *, console=None) -> Path:
    """Write DIR/report.md (and DIR/figures/*.png) from config.json, metrics.json, calibration.json etc."""
    run_dir = Path(run_dir)
    metrics = _load(run_dir / "metrics.json")
    if metrics is None:
        raise ValueError(f"run_dir: {run_dir} has no metrics.json (run `oal run --out {run_dir}` first)")
    config = _load(run_dir / "config.json") or {}
    fig_dir = run_dir / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    # --layers auto:K keeps every candidate layer's calibration in candidates/
    calibration = _load(run_dir / "calibration.json") or _load(run_dir / "candidates" / "calibration.json")
    if calibration is None and metrics.get("seeds"):
        calibration = _load(run_dir / f"seed-{metrics['seeds'][0]}" / "calibration.json")
    has_cal = bool(calibration) and calibration_figure(calibration, fig_dir / "calibration_curves.png")
    adapt_dir = run_dir if not metrics.get("seeds") else run_dir / f"seed-{metrics['seeds'][0]}"
    has_adapt = adaptation_figure(adapt_dir, metrics.get("methods", []), fig_dir / "adaptation_curves.png")
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
    lines += _provenance(config)
    analysis = _analysis(analysis_dir, analysis_figs)
    if prefix:
        analysis = [ln.replace("](figures/", f"]({prefix}figures/") for ln in analysis]
        analysis = [ln.replace(f"![{prefix}", "![") for ln in analysis]
    lines += analysis
    lines += _calibration(calibration, has_cal)
    lines += _fidelity(metrics)
    lines += _regime_and_budget(adapt_dir, prefix)
    lines += _perplexity(metrics, has_ppl)
    lines += _zeroshot(metrics)
    lines += selection_section(metrics, fig_dir, _table)
    lines += passkey_section(metrics, fig_dir, _table)
    lines += _adaptation(adapt_dir, metrics, has_adapt)
    lines += _timing(metrics)
    return write_markdown(run_dir, lines, console=console)


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
