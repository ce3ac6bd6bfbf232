"""The headline of `report.md`, the first thing a reader sees: does each converted arm match softmax? Adapted test
perplexity against softmax's (the ratio), frozen-attention fidelity, zero-shot accuracy where measured, and what
the run did not measure (speed). Built from metrics.json alone."""

from __future__ import annotations

from oal.data.zeroshot import DISPLAY_NAMES
from oal.pipeline.report_format import display_name, distinct_digits, fmt, fmt_pm, markdown_table, ordered

__all__ = ["ppl_ratio", "summary_section"]


def ppl_ratio(metrics: dict, method: str) -> float | None:
    """Adapted test perplexity of `method` over softmax's (both adapted alike); None where either is missing."""
    ppl = metrics.get("perplexity") or {}
    if method == "softmax" or not ppl.get("softmax") or ppl.get(method) is None:
        return None
    return ppl[method] / ppl["softmax"]


def _zeroshot_mean(metrics: dict, method: str) -> str:
    z = (metrics.get("zeroshot") or {}).get(method) or {}
    vals = [z[t]["acc_norm"] for t in DISPLAY_NAMES if t in z and "acc_norm" in z[t]]
    return f"{sum(vals) / len(vals):.2f} ({len(vals)} tasks)" if vals else "-"


def _caveats(metrics: dict, config: dict) -> list[str]:
    """What makes this run a quick one, said in the headline: adaptation cut below the preset's budget, zero-shot on
    the first N examples, or no zero-shot task selected."""
    from oal.pipeline.config import PRESETS

    cfg = (config or {}).get("config") or {}
    out = []
    budget = (PRESETS.get(cfg.get("preset")) or {}).get("adapt", {}).get("steps")
    steps = sorted({a.get("steps") for a in (metrics.get("adapt") or {}).values()} - {None})
    if budget and steps and max(steps) < budget:
        out.append(f"- **Quick run**: {', '.join(map(str, steps))} adaptation updates per arm against the "
                   f"`{cfg['preset']}` preset's {budget} (`--steps`); the PPLs are of briefly adapted models.")
    data = metrics.get("zeroshot_data") or {}
    limits = sorted({d["limit"] for t, d in data.items() if d.get("limit") and any(
        t in z for z in (metrics.get("zeroshot") or {}).values())})
    if limits:
        out.append(f"- **Quick run**: zero-shot on the first {', '.join(map(str, limits))} examples of each task "
                   "(`--limit`), not comparable with the paper's full sets.")
    layers = metrics.get("converted_layers_per_seed")
    if layers:
        out.append("- **Seeds converted different layers** (" + "; ".join(f"seed {s}: {v}" for s, v in layers.items())
                   + "): each mean is over those different conversions; per-layer fidelity covers the layers every "
                   "seed converted.")
    missing = metrics.get("not_averaged")
    if missing:
        out.append("- **Not averaged** (some seeds lack the number, or measured it on other examples; metrics.json "
                   "`per_seed` has what each measured): " + "; ".join(f"{k} (seeds {v})" for k, v in missing.items())
                   + ".")
    return out


def summary_section(metrics: dict, config: dict | None = None) -> list[str]:
    """`## Summary`: one row per arm and a sentence per converted arm, with units and what each is compared to."""
    ppl, pre = metrics.get("perplexity") or {}, metrics.get("perplexity_no_adapt") or {}
    std, fid = metrics.get("perplexity_std") or {}, metrics.get("fidelity") or {}
    pre_std = metrics.get("perplexity_no_adapt_std") or {}
    fid_std = metrics.get("fidelity_std") or {}
    methods = ordered(metrics.get("methods") or sorted(set(ppl) | set(fid)))
    if not methods:
        return []
    seeds = metrics.get("seeds") or []
    multi = len(seeds) > 1
    out = ["## Summary", ""]
    # as many decimals as it takes to tell the arms apart (two arms within 0.005 PPL must not print alike)
    d_ppl, d_pre = distinct_digits(ppl.values(), 2), distinct_digits(pre.values(), 2)
    d_fid = distinct_digits([f.get("relmse_post_o") for f in fid.values()], 4)
    ratios = {m: ppl_ratio(metrics, m) for m in methods}
    d_ratio = distinct_digits(list(ratios.values()) + [1.0], 3)
    rows = []
    for m in methods:
        cell = fmt_pm(ppl.get(m), std.get(m) if multi else None, d_ppl)
        ratio = ratios[m]
        shown = ("1.000x (reference)" if m == "softmax" and ppl.get(m) else
                 "-" if ratio is None else f"{ratio:.{d_ratio}f}x")
        f = fid.get(m, {})
        rows.append([display_name(m), cell, shown, fmt_pm(pre.get(m), pre_std.get(m) if multi else None, d_pre),
                     fmt_pm(f.get("relmse_post_o"), fid_std.get(m, {}).get("relmse_post_o") if multi else None,
                            d_fid), _zeroshot_mean(metrics, m)])
    over = f", mean ± sample std over seeds {seeds}" if multi else ""
    reference = ("softmax adapted with LoRA too (updates per arm: the Adaptation section); **PPL / softmax** is the "
                 "arm's adapted PPL over softmax's (1.000x: the converted model matches softmax)" if "softmax" in
                 methods else "no softmax arm in this run (`--methods` without softmax), so no **PPL / softmax**")
    out += [f"Model `{metrics.get('model')}`, converted layers {metrics.get('converted_layers')}{over}. Test "
            f"perplexity (PPL, lower is better) on the test split of the run's corpus, {reference}. Fidelity: "
            "held-out relative MSE of the "
            "attention output after W_o against the softmax attention it replaces, kernels as calibrated (0: "
            "identical; lower is better).", "",
            markdown_table(["method", "test PPL (LoRA)", "PPL / softmax", "test PPL before adaptation",
                            "fidelity: RelMSE after W_o", "zero-shot acc_norm % (mean)"], rows), ""]
    for m in methods:
        ratio = ratios[m]
        if ratio is not None:
            gap = 100 * (ratio - 1)
            out.append(f"- {display_name(m)}: adapted test PPL {fmt(ppl[m], d_ppl)} against softmax's "
                       f"{fmt(ppl['softmax'], d_ppl)}, {ratio:.{d_ratio}f}x ({gap:+.{max(1, d_ratio - 2)}f}%: "
                       f"{'worse' if gap > 0 else 'no worse'} than softmax).")
    out += _caveats(metrics, config)
    if not metrics.get("zeroshot"):
        out.append("- Zero-shot accuracy: not measured in this run (see the zero-shot section for why).")
    out += ["- Speed: `oal run` measures quality, not speed (its time per stage, at the end, is the protocol's "
            "wall clock); the operator's timings: docs/performance/benchmarks.md.", ""]
    return out
