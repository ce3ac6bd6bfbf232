"""The report's own figures: calibration curves, adaptation curves, per-layer fidelity and the perplexity bars
(written atomically; a figure that has nothing to show is not drawn and the report says so)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from oal.pipeline.report_format import display_name, ordered, read_optional  # noqa: E402
from oal.rundir.files import atomic_save_figure  # noqa: E402

__all__ = ["METHOD_COLORS", "adaptation_figure", "calibration_figure", "fidelity_figure", "method_color",
           "perplexity_figure"]

# One colour per method in every figure (report, benchmarks): a reader matches curves across figures by colour.
METHOD_COLORS = {"global": "tab:blue", "oal": "tab:orange", "softmax": "tab:green", "oal-swa": "tab:red",
                 "swa": "tab:purple", "global-swa": "tab:brown", "performer": "tab:pink", "spectraformer": "tab:gray",
                 "dijiang": "tab:olive", "taylorshift": "tab:cyan"}


def method_color(method: str) -> str | None:
    """The method's colour (None for an unknown name: matplotlib's cycle picks one)."""
    return METHOD_COLORS.get(method)


def _seed_std(metrics: dict, value) -> dict[str, float]:
    """Per method, the sample std over seeds of `value(seed_metrics, method)` (a multi-seed run's metrics.json
    keeps each seed's numbers in per_seed); {} for one seed, and no entry for a method a seed lacks."""
    per = [metrics["per_seed"][str(s)] for s in metrics.get("seeds") or []] if metrics.get("per_seed") else []
    if len(per) < 2:
        return {}
    out = {}
    for m in metrics.get("methods", []):
        vals = [value(p, m) for p in per]
        if all(v is not None for v in vals):
            mean = sum(vals) / len(vals)
            out[m] = (sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
    return out


def _seeds_note(metrics: dict) -> str:
    seeds = metrics.get("seeds") or []
    return f"\nmean ± sample std over {len(seeds)} seeds" if len(seeds) > 1 else ""


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
    ax.set_ylabel(label + ("\n(log scale)" if log else ""))  # own line: one line ran past a short panel


def _legend_above_bars(ax, n_entries: int) -> None:
    """The legend in a band of its own above the tallest bar (and its error bar): bars that fill the axes left
    "best" no free corner, and it covered them."""
    ncol = min(n_entries, 3)
    frac = 0.11 * -(-n_entries // ncol) + 0.04  # share of the axes height the legend's rows take
    lo, hi = ax.get_ylim()
    if ax.get_yscale() == "log":
        ax.set_ylim(lo, lo * (hi / lo) ** (1 / (1 - frac)))
    else:
        ax.set_ylim(lo, lo + (hi - lo) / (1 - frac))
    ax.legend(fontsize=8, ncol=ncol, loc="upper center")


def calibration_figure(calibration: dict, path: Path, note: str = "") -> bool:
    """Per method: mean validation MSE over heads and layers against updates, one line per initialisation; `note`
    (a multi-seed run's "seed S of [...]") heads the figure."""
    methods = [m for m in ordered(calibration.get("methods", {}))
               if any(v.get("heads") for v in calibration["methods"][m].values())]
    if not methods:
        return False
    fig, axes = plt.subplots(1, len(methods), figsize=(4.5 * len(methods), 3.6), squeeze=False)
    inits = sorted({i for m in methods for layer in calibration["methods"][m].values() for h in layer["heads"]
                    for i in h.get("curves", {})})
    colors = {init: f"C{k % 10}" for k, init in enumerate(inits)}  # an initialisation keeps its colour across panels
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
            ax.plot(steps, mean, marker="o", ms=3, label=init, color=colors[init])
            plotted += mean
        ax.set_title(f"{display_name(m)}:\ncalibration (Eq. 20)")  # one line ran past a 4.5-inch panel
        ax.set_xlabel("update")
        _auto_scale(ax, plotted, "validation output MSE (mean over heads)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if note:
        fig.suptitle(note)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)
    return True


def adaptation_figure(run_dir: Path, methods: list[str], path: Path, note: str = "") -> bool:
    runs = {m: read_optional(run_dir / "adapter" / m / "adapt.json") for m in methods}
    runs = {m: r for m, r in runs.items() if r}
    if not runs:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for m in ordered(runs):
        hist = runs[m]["history"]
        steps, loss = [h["step"] for h in hist], [h["loss"] for h in hist]
        k = max(1, len(loss) // 20)  # moving average over ~5% of the updates
        smooth = [sum(loss[max(0, i - k + 1) : i + 1]) / len(loss[max(0, i - k + 1) : i + 1]) for i in range(len(loss))]
        ax1.plot(steps, smooth, label=display_name(m), color=method_color(m))
        val = runs[m]["validation"]
        ax2.plot([v["step"] for v in val], [v["val_nll"] for v in val], marker="o", label=display_name(m),
                 color=method_color(m))
    ax1.set(title="Adaptation: training loss (moving average)", xlabel="update", ylabel="next-token NLL (nats)")
    ax2.set(title="Validation NLL (checkpoint selection)", xlabel="update", ylabel="next-token NLL (nats)")
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # updates are whole: a short run showed 1.2, 1.4
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if note:
        fig.suptitle(note)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)
    return True


def perplexity_figure(metrics: dict, path: Path) -> bool:
    ppl = metrics.get("perplexity", {})
    if not ppl:
        return False
    methods = ordered(ppl)
    pre = metrics.get("perplexity_no_adapt", {})
    # error bars wherever seeds exist: before adaptation too (aggregate keeps only the adapted PPL's std)
    std = _seed_std(metrics, lambda p, m: p.get("perplexity", {}).get(m))
    std_pre = _seed_std(metrics, lambda p, m: p.get("perplexity_no_adapt", {}).get(m))
    fig, ax = plt.subplots(figsize=(1.6 * len(methods) + 2, 3.8))
    x = range(len(methods))
    if pre:
        ax.bar([i - 0.2 for i in x], [pre.get(m, float("nan")) for m in methods], 0.4, label="before adaptation",
               color="#bbbbbb", yerr=[std_pre.get(m, 0.0) for m in methods] if std_pre else None, capsize=3)
    ax.bar([i + 0.2 for i in x], [ppl[m] for m in methods], 0.4, yerr=[std.get(m, 0.0) for m in methods] if std
           else None, label="after LoRA adaptation", color="#3a6ea5", capsize=3)
    ax.set_xticks(list(x), [display_name(m) for m in methods], rotation=15)
    _auto_scale(ax, list(ppl.values()) + list(pre.values()), "test perplexity")
    ax.set_title("Test perplexity (App. F.3 protocol)" + _seeds_note(metrics))
    ax.grid(alpha=0.3, axis="y")
    _legend_above_bars(ax, 2 if pre else 1)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)
    return True


def fidelity_figure(metrics: dict, path: Path) -> bool:
    """Held-out RelMSE of each converted layer, one bar per method, before and after W_o (Eq. 21-22)."""
    fid = {m: f["per_layer"] for m, f in (metrics.get("fidelity") or {}).items() if f.get("per_layer")}
    if not fid:
        return False
    methods = ordered(fid)
    layers = sorted({int(k) for rows in fid.values() for k in rows})
    rows = -(-len(methods) // 3)  # legend rows (3 columns): each gets its own height above the bars
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.1 * len(layers) * len(methods) ** 0.5 + 4, 3.8 * min(3, len(
        methods)) + 1), 3.6 + 0.35 * (rows - 1)))
    width = 0.8 / len(methods)

    def per_layer(p: dict, m: str, layer: int, key: str):
        return p.get("fidelity", {}).get(m, {}).get("per_layer", {}).get(str(layer), {}).get(key)

    std_by_layer = {(key, layer): _seed_std(metrics, lambda p, m, layer=layer, key=key: per_layer(p, m, layer, key))
                    for key in ("relmse", "relmse_post_o") for layer in layers}
    for ax, key, where in zip(axes, ("relmse", "relmse_post_o"), ("before W_o", "after W_o"), strict=True):
        values = []
        for j, m in enumerate(methods):
            ys = [fid[m].get(str(layer), {}).get(key, float("nan")) for layer in layers]
            errs = [std_by_layer[(key, layer)].get(m) for layer in layers]
            yerr = [e or 0.0 for e in errs] if any(e is not None for e in errs) else None
            ax.bar([i - 0.4 + width * (j + 0.5) for i in range(len(layers))], ys, width, label=display_name(m),
                   color=method_color(m), yerr=yerr, capsize=2)
            values += ys
        ax.set_xticks(range(len(layers)), [str(layer) for layer in layers])
        # two lines: on one, the left title ran into the right panel's y label
        ax.set(title=f"Attention fidelity per layer,\n{where}" + _seeds_note(metrics), xlabel="converted layer")
        _auto_scale(ax, values, "held-out RelMSE vs softmax (lower is better)")
        ax.grid(alpha=0.3, axis="y")
        _legend_above_bars(ax, len(methods))
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)
    return True
