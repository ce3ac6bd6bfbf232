"""Markdown tables in the paper's layout (Table 1, Table 2) and the Table 1 figure."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from oal.rundir.files import atomic_save_figure

__all__ = ["METHOD_LABELS", "plot_table1", "table1_markdown", "table2_markdown"]

METHOD_LABELS = {"performer": "Performer", "spectraformer": "SpectraFormer", "dijiang": "DiJiang",
                 "taylorshift": "TaylorShift", "global": "Learned Global (G = 1)", "oal": "OAL",
                 "softmax": "Softmax", "swa": "Sliding window (SWA)", "global-swa": "Window + learned global",
                 "oal-swa": "Window + OAL"}


def _label(name: str) -> str:
    return METHOD_LABELS.get(name, name)


def table1_markdown(results: Mapping[str, dict], gaussian: Mapping[str, dict] | None = None) -> str:
    """Table 1: R_S (%) for the high-contribution subsets, the Gaussian control and the matched-control p."""
    gaussian = gaussian or {}
    first = next(iter(results.values()))
    lines = [
        f"Retained-error ratio R_S (%); subsets cover {100 * first['subset_fraction']:.2f}% of head dimensions "
        f"({first['subset_dims_total']} dims). p: matched-control randomisation test (Eq. 15) with "
        f"B = {first['n_controls']} bulk subsets.",
        "",
        "| Method | High-contrib. error (%) | Gaussian control (%) | Matched controls, mean (%) | p |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        g = gaussian.get(name)
        ctrl = r["controls"]
        mean_ctrl = f"{100 * sum(ctrl) / len(ctrl):.1f}" if ctrl else "n/a"
        p = f"{r['p_value']:.4f}" if r.get("p_value") is not None else "n/a"
        gauss = "n/a" if g is None else f"{100 * g['R_S']:.1f}"
        lines.append(f"| {_label(name)} | {100 * r['R_S']:.1f} | {gauss} | {mean_ctrl} | {p} |")
    return "\n".join(lines) + "\n"


def table2_markdown(fidelity: Mapping[str, dict], title: str = "") -> str:
    """Table 2: MSE / RelMSE before and after W_o for each method (lower is better)."""
    lines = [title, ""] if title else []
    lines += ["| Method | Before W_o MSE | Before W_o RelMSE | After W_o MSE | After W_o RelMSE |",
              "|---|---|---|---|---|"]
    for name, r in fidelity.items():
        lines.append(f"| {_label(name)} | {r['mse']:.4g} | {r['relmse']:.4g} | {r['mse_post_o']:.4g} | "
                     f"{r['relmse_post_o']:.4g} |")
    return "\n".join(lines) + "\n"


def plot_table1(table1: Mapping[str, dict], gaussian: Mapping[str, dict], path: str | Path) -> Path:
    """Per method: the matched-control distribution of R (box), the observed R_S (red) and the Gaussian control
    (grey), in percent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table1)
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(names), 3.6), dpi=150)
    xs = list(range(1, len(names) + 1))
    ctrl = [[100 * r for r in table1[n]["controls"]] or [float("nan")] for n in names]
    ax.boxplot(ctrl, positions=xs, widths=0.5, showfliers=True)
    ax.scatter(xs, [100 * table1[n]["R_S"] for n in names], color="tab:red", zorder=3, label="high-contribution S")
    gx = [x for x, n in zip(xs, names, strict=True) if n in gaussian]
    ax.scatter(gx, [100 * gaussian[n]["R_S"] for n in names if n in gaussian], color="grey", marker="s", zorder=3,
               label="Gaussian control")
    ax.set_xticks(xs, [_label(n) for n in names])
    ax.set_ylabel("retained-error ratio R (%)")
    ax.set_yscale("log")
    ax.set_title("Table 1: error retained by approximating S only (box: matched bulk subsets)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return atomic_save_figure(fig, path)
