"""The headline of `report.md`, the first thing a reader sees: does each converted arm match softmax? Adapted test
perplexity against softmax's (the ratio), frozen-attention fidelity, zero-shot accuracy where measured, and what
the run did not measure (speed). Built from metrics.json alone."""

from __future__ import annotations

from oal.data.zeroshot import DISPLAY_NAMES
from oal.pipeline.report_format import display_name, fmt, markdown_table, ordered

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


def summary_section(metrics: dict) -> list[str]:
    """`## Summary`: one row per arm and a sentence per converted arm, with units and what each is compared to."""
    ppl, pre = metrics.get("perplexity") or {}, metrics.get("perplexity_no_adapt") or {}
    std, fid = metrics.get("perplexity_std") or {}, metrics.get("fidelity") or {}
    methods = ordered(metrics.get("methods") or sorted(set(ppl) | set(fid)))
    if not methods:
        return []
    seeds = metrics.get("seeds") or []
    out = ["## Summary", ""]
    rows = []
    for m in methods:
        cell = fmt(ppl.get(m), 2)
        if len(seeds) > 1 and m in std:
            cell += f" ± {std[m]:.2f}"
        ratio = ppl_ratio(metrics, m)
        shown = "1.000x (reference)" if m == "softmax" and ppl.get(m) else "-" if ratio is None else f"{ratio:.3f}x"
        rows.append([display_name(m), cell, shown, fmt(pre.get(m), 2),
                     fmt(fid.get(m, {}).get("relmse_post_o"), 4), _zeroshot_mean(metrics, m)])
    over = f", mean ± sample std over seeds {seeds}" if len(seeds) > 1 else ""
    out += [f"Model `{metrics.get('model')}`, converted layers {metrics.get('converted_layers')}{over}. Test "
            "perplexity (PPL, lower is better) on the test split of the run's corpus, softmax adapted with LoRA "
            "too (updates per arm: the Adaptation section); **PPL / softmax** is the arm's adapted PPL over "
            "softmax's (1.000x: the converted model matches softmax). Fidelity: held-out relative MSE of the "
            "attention output after W_o against the softmax attention it replaces, kernels as calibrated (0: "
            "identical; lower is better).", "",
            markdown_table(["method", "test PPL (LoRA)", "PPL / softmax", "test PPL before adaptation",
                            "fidelity: RelMSE after W_o", "zero-shot acc_norm % (mean)"], rows), ""]
    for m in methods:
        ratio = ppl_ratio(metrics, m)
        if ratio is not None:
            gap = 100 * (ratio - 1)
            out.append(f"- {display_name(m)}: adapted test PPL {ppl[m]:.2f} against softmax's {ppl['softmax']:.2f}, "
                       f"{ratio:.3f}x ({gap:+.1f}%: {'worse' if gap > 0 else 'no worse'} than softmax).")
    if not metrics.get("zeroshot"):
        out.append("- Zero-shot accuracy: not measured in this run (see the zero-shot section for why).")
    out += ["- Speed: `oal run` measures quality, not speed (its time per stage, at the end, is the protocol's "
            "wall clock); the operator's timings: docs/performance/benchmarks.md.", ""]
    return out
