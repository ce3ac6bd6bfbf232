"""Analysis figures (paper Fig. 1, 2(a), 5, 6 and Table 4 as a plot), PNG via matplotlib's Agg backend."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.colors import BoundaryNorm  # noqa: E402

from oal.rundir.files import atomic_save_figure  # noqa: E402

_COLORS = ["#b0b0b0", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf"]


def _color(g: int) -> str:
    return _COLORS[g % len(_COLORS)]


def _save(fig, path: Path) -> Path:
    return atomic_save_figure(fig, path, dpi=110, bbox_inches="tight")


def _sorted_bars(ax, head: dict) -> None:
    """Sorted profile; natural cuts dotted black, fallback cuts (added to reach G_min) dashed red."""
    chi, groups = head["chi"], head["groups"]
    order = sorted(range(len(chi)), key=lambda r: chi[r])  # stable ascending, as App. B
    ax.bar(range(len(chi)), [chi[r] for r in order], color=[_color(groups[r]) for r in order], width=1.0)
    fallback = set(head.get("fallback_cuts", []))
    for k in head["cuts"]:
        ax.axvline(k - 0.5, color="#d62728" if k in fallback else "k", lw=0.7, ls="--" if k in fallback else ":")


def layer_profiles(path: Path, layer: int, heads: list[dict]) -> Path:
    """Fig. 2(a)-style sorted contribution profile of every head of one layer, groups coloured."""
    n = len(heads)
    cols = min(n, 4)  # 14 heads (Qwen2.5-0.5B) in 7 columns was 18 inches wide: unreadable at report.md's width
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(2.6 * cols, 2.2 * rows + 0.6), squeeze=False,
                             layout="constrained")
    for i, ax in enumerate(axes.flat):
        if i >= n:
            ax.axis("off")
            continue
        h = heads[i]
        _sorted_bars(ax, h)
        n_fb = len(h.get("fallback_cuts", []))
        ax.set_title(f"head {h['head']}: G={h['n_groups']}" + (f" ({n_fb} fallback)" if n_fb else ""), fontsize=9)
        ax.tick_params(labelsize=7)
        if i % cols == 0:  # each row's first panel names the y axis (the panels share its meaning, not its range)
            ax.set_ylabel("contribution $\\chi_r$", fontsize=8)
    fig.suptitle(f"Layer {layer}: sorted contribution scores $\\chi_r$ (colour = group; cuts: natural dotted, "
                 "fallback dashed red)")
    fig.supxlabel("dimension rank (ascending $\\chi_r$)")
    return _save(fig, path)


def head_panels(path: Path, layer: int, head: dict, mean_abs_q: list[float], mean_abs_k: list[float]) -> Path:
    """Fig. 1 (a-c) + Fig. 2(a) for one head: |q|, |k| (its KV head), chi by dimension, sorted chi with groups."""
    d = len(head["chi"])
    top = sorted(range(d), key=lambda r: -head["chi"][r])[:2]
    # 2 x 2, not 1 x 4: an 18-inch row shrinks its labels to a few pixels at report.md's page width
    fig, grid = plt.subplots(2, 2, figsize=(11, 6.4), layout="constrained")
    axes = grid.flatten()
    for ax, vals, label in (
        (axes[0], mean_abs_q, "mean |query|"),
        (axes[1], mean_abs_k, "mean |key| (KV head)"),
        (axes[2], head["chi"], "contribution $\\chi_r$"),
    ):
        ax.bar(range(d), vals, color=[_color(g) for g in head["groups"]], width=1.0)
        for r in top:
            ax.annotate(f"r={r}", (r, vals[r]), fontsize=8, ha="center", va="bottom")
        ax.margins(y=0.1)  # room above the tallest bar for its label (it ran into the frame)
        ax.set_xlabel("QK dimension")
        ax.set_ylabel(label)
    _sorted_bars(axes[3], head)
    axes[3].set_xlabel("dimension rank (ascending)")
    axes[3].set_ylabel("sorted $\\chi_r$")
    fig.suptitle(f"Layer {layer}, head {head['head']}: G={head['n_groups']} groups (colour), cuts at {head['cuts']}")
    return _save(fig, path)


def heatmap(path: Path, values: list[list[float]], layers: list[int], title: str, cbar: str, fmt: str) -> Path:
    """layers x heads heatmap with the value written in each cell."""
    n_l, n_h = len(values), len(values[0])
    fig, ax = plt.subplots(figsize=(0.55 * n_h + 2.5, 0.35 * n_l + 1.8), layout="constrained")
    norm, ticks = None, None
    if fmt == "d":  # counts: one colour per integer and integer ticks (a continuous bar reads "2.2 groups")
        lo, hi = int(min(map(min, values))), int(max(map(max, values)))
        ticks = list(range(lo, hi + 1))
        norm = BoundaryNorm([t - 0.5 for t in ticks] + [hi + 0.5], plt.get_cmap("viridis").N)
    im = ax.imshow(values, aspect="auto", cmap="viridis", norm=norm)
    for i in range(n_l):
        for j in range(n_h):
            r, g, b, _ = im.to_rgba(values[i][j])
            bright = 0.299 * r + 0.587 * g + 0.114 * b > 0.5  # viridis turns yellow: dark text there
            ax.text(j, i, format(values[i][j], fmt), ha="center", va="center", fontsize=7,
                    color="k" if bright else "w")
    ax.set_xticks(range(n_h))
    ax.set_yticks(range(n_l), [str(layer) for layer in layers])
    ax.set_xlabel("query head")
    ax.set_ylabel("layer")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label=cbar, ticks=ticks)
    return _save(fig, path)


def gaussian_controls(path: Path, rep: dict, mean: dict, label: str) -> Path:
    """Fig. 5: real top-5 share vs Gaussian top-5 share vs Gaussian share at the real top-5 coordinates."""
    keys = ["real_top5", "gaussian_top5", "gaussian_at_real_top5"]
    names = ["Real top-5", "Gaussian top-5", "Gaussian at real coords"]
    fig, ax = plt.subplots(figsize=(7, 3.8), layout="constrained")
    width = 0.38
    for off, data, lab, color in ((-width / 2, rep, label, "#1f77b4"), (width / 2, mean, "mean over all heads",
                                                                     "#aec7e8")):
        bars = ax.bar([i + off for i in range(3)], [100 * data[k] for k in keys], width, label=lab, color=color)
        for b in bars:
            ax.annotate(f"{b.get_height():.1f}%", (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(range(3), names)
    ax.set_ylabel("contribution ratio (%)")
    ax.set_title("Top-5 contribution concentration vs isotropic Gaussian controls")
    ax.legend(fontsize=8)
    return _save(fig, path)


def stability_scatter(path: Path, calib: list[float], heldout: list[float], rho: float, overlap: int,
                      label: str) -> Path:
    """Fig. 6: calibration vs held-out chi for one head, top-5 of calibration highlighted."""
    top = sorted(range(len(calib)), key=lambda r: -calib[r])[:5]
    fig, ax = plt.subplots(figsize=(4.8, 4.6), layout="constrained")
    rest = [r for r in range(len(calib)) if r not in top]
    ax.scatter([calib[r] for r in rest], [heldout[r] for r in rest], s=12, c="#7f7f7f", label="other dimensions")
    ax.scatter([calib[r] for r in top], [heldout[r] for r in top], s=26, c="#d62728", label="calibration top-5")
    hi = max(max(calib), max(heldout)) * 1.05
    # labels left of the diagonal, at least 5% of the axis apart, so that close points do not print over each other
    label_y = -hi
    for r in sorted(top, key=lambda r: heldout[r]):
        label_y = max(heldout[r], label_y + 0.05 * hi)
        ax.annotate(f"r={r}", (calib[r], heldout[r]), xytext=(calib[r] - 0.06 * hi, label_y), fontsize=8,
                    ha="right", va="center", arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "#555555"})
    ax.plot([0, hi], [0, hi], color="k", lw=0.6, ls="--")
    ax.set_xlabel("calibration $\\chi_r$")
    ax.set_ylabel("held-out $\\chi_r$")
    ax.set_title(f"{label}\nSpearman $\\rho$ = {rho:.3f}, top-5 overlap = {overlap}/5", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)


def length_stability(path: Path, lengths: list[int], dims: list[int], shares: list[list[float]], label: str) -> Path:
    """Table 4 as a plot: normalised contribution (%) of the top-5 dims (at the longest length) vs prefix length."""
    fig, ax = plt.subplots(figsize=(5.8, 3.8), layout="constrained")
    for j, r in enumerate(dims):
        ax.plot(lengths, [100 * row[j] for row in shares], marker="o", label=f"r={r}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("$\\chi_r / \\sum_t \\chi_t$ (%)")
    ax.set_title(f"{label}: top-5 dims across sequence lengths", fontsize=10)
    ax.legend(fontsize=8)
    return _save(fig, path)
