"""Fig. 2(b): held-out attention-output MSE vs trainable coefficients per head over fixed group budgets.

One chosen (layer, head); for each budget G, `oal.analysis.fixed_budget_groups` cuts the same sorted
contribution profile at its G - 1 largest adjacent gaps (App. B), so larger budgets only subdivide. Each
budget is calibrated with the same protocol (`oal.calibration.fit`: the learned global quadratic once, then OAL from
its three starts, selection by validation MSE) and scored by pooled held-out output MSE over all tokens and
output dimensions. Trainable coefficients per head: the lower triangle of L, (G + 1)(G + 2) / 2.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from oal.rundir.files import atomic_save_figure

__all__ = ["RUN_BUDGETS", "budget_curve", "budget_markdown", "coefficients_per_head", "plot_budget", "run_budget"]

BUDGET_FILE = "budget.json"
RUN_BUDGETS = (1, 2, 3, 4, 6, 8)  # the curve `oal run` draws for its representative head


def coefficients_per_head(n_groups: int) -> int:
    """Entries of the lower-triangular (G+1) x (G+1) factor L (Section 4.3)."""
    return (n_groups + 1) * (n_groups + 2) // 2


def budget_curve(train, val, heldout, chi: torch.Tensor, head: int, budgets: Sequence[int] = tuple(range(1, 17)),
                 cfg=None, *, layer: int = 0, on_budget: Callable[[dict], None] | None = None) -> dict:
    """train/val/heldout: `oal.calibration.data.LayerData` of one layer; chi [d] the head's calibration contribution
    scores. Returns {"layer", "head", "points": [{G, coefficients, heldout_mse, val_mse, groups}], ...}."""
    from oal.analysis import fixed_budget_groups
    from oal.calibration.data import CalibConfig
    from oal.calibration.fit import calibrate_layer, global_inits, oal_inits
    from oal.methods import build_method

    cfg = cfg or CalibConfig()
    rep = train.q.shape[1] // train.k.shape[1]
    if not 0 <= head < train.q.shape[1]:
        raise ValueError(f"head: expected 0 <= head < {train.q.shape[1]}, got {head}")
    d = train.q.shape[-1]
    if chi.shape != (d,):
        raise ValueError(f"chi: expected shape [{d}], got {tuple(chi.shape)}")
    tr, va, ho = train.head(head, rep), val.head(head, rep), heldout.head(head, rep)
    glob = build_method("global", 1, 1, d, layer_idx=layer)
    g_res = calibrate_layer(glob, tr, va, cfg, global_inits(1, cfg), layer=layer)  # shared by every budget
    points = []
    for n_groups in budgets:
        groups = fixed_budget_groups(chi, n_groups).reshape(1, d)
        g = int(groups.max()) + 1  # == n_groups unless chi has fewer distinct gaps
        if g == 1:
            method, res = g_res.apply(build_method("global", 1, 1, d, layer_idx=layer)), g_res
        else:
            method = build_method("oal", 1, 1, d, groups=groups, n_groups=g, layer_idx=layer)
            res = calibrate_layer(method, tr, va, cfg, oal_inits(g_res.params["factor"], g, cfg), layer=layer)
            method = res.apply(method)
        with torch.no_grad():
            dt = ho.q.dtype
            y = method.to(device=ho.q.device, dtype=dt)(ho.q, ho.k, ho.v, causal=True)  # where the data is
            mse = float((y.double() - ho.out.double()).pow(2).mean())  # pooled over tokens and dims
        point = {"G": g, "coefficients": coefficients_per_head(g), "heldout_mse": mse,
                 "val_mse": res.heads[0].val_mse, "init": res.heads[0].init, "groups": groups[0].tolist()}
        points.append(point)
        if on_budget is not None:
            on_budget(point)
    return {"layer": layer, "head": head, "points": points, "calibration": cfg.to_dict()}


def run_budget(model, blocks: dict, groups_file: str | Path, layer: int, head: int, cfg, out_dir: str | Path,
               budgets: Sequence[int] = RUN_BUDGETS) -> dict:
    """`oal run`'s group-budget curve: Fig. 2(b) for one head (calibration on the plan's calib_train / calib_val
    blocks, held-out MSE on its fidelity blocks), with the G App. B chose for that head and the G the run used.
    Writes DIR/budget.json and DIR/figures/group_budget.png; returns the result."""
    from oal.diagnostics.fidelity_table import capture_layers
    from oal.rundir.files import atomic_write_json, load_json

    data = load_json(groups_file)
    row = next(h for h in data["heads"][str(layer)] if h["head"] == head)
    train, val, held = (capture_layers(model, blocks[r], [layer], where, batch_size=1)[layer] for r, where in
                        (("calib_train", "the calibration training blocks"),
                         ("calib_val", "the calibration validation blocks"),
                         ("fidelity", "the held-out fidelity blocks")))
    res = budget_curve(train, val, held, torch.tensor(row["chi"], dtype=torch.float64), head, budgets, cfg,
                       layer=layer)
    res["app_b_groups"] = row.get("app_b", row)["n_groups"]
    res["run_groups"] = row["n_groups"]
    res["procedure"] = data.get("procedure", "app_b")
    atomic_write_json(Path(out_dir) / BUDGET_FILE, res)
    plot_budget(res, Path(out_dir) / "figures" / "group_budget.png")
    return res


def budget_markdown(res: dict) -> list[str]:
    """The report's group-budget section: held-out MSE per budget G beside App. B's choice for the same head."""
    pts = res["points"]
    best = min(pts, key=lambda p: p["heldout_mse"])
    rows = []
    for p in pts:
        marks = [m for m, g in (("App. B", res.get("app_b_groups")), ("this run", res.get("run_groups")))
                 if g == p["G"]]
        rows.append(f"| {p['G']} | {p['coefficients']} | {p['heldout_mse']:.6f} | {p['val_mse']:.6f} | "
                    f"{', '.join(marks)} |")
    out = [f"Fig. 2(b) procedure on layer {res['layer']}, head {res['head']}: the G - 1 largest gaps of the sorted "
           "contribution profile become group boundaries, each budget is calibrated by the run's protocol, and the "
           "held-out (fidelity-block) output MSE is pooled over tokens and dims. App. B chose "
           f"G = {res.get('app_b_groups')} for this head; the best budget on the curve is G = {best['G']}."
           + ("" if len(pts) > len(RUN_BUDGETS) else f" A run draws {len(pts)} budgets; the paper's axis runs to 16 "
              "(`oal diagnose --parts budget` draws G = 1-16)."), "",
           "| G | coefficients / head | held-out MSE | validation MSE | |", "|---|---|---|---|---|", *rows, ""]
    if res.get("procedure", "app_b") != "app_b":
        out += [f"This run converted with `--grouping {res['procedure']}`: a fixed budget per head instead of "
                "App. B's stable-gap groups, a departure from the paper's protocol.", ""]
    return out


def plot_budget(result: dict, path: str | Path) -> Path:
    """Fig. 2(b)-style PNG: held-out MSE (left axis) and coefficients per head (right axis) vs G; App. B's G for
    the head (and the run's, when it used a fixed budget) marked when the result records them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result["points"]
    gs = [p["G"] for p in pts]
    fig, ax = plt.subplots(figsize=(5.2, 3.9), dpi=150)
    ax.plot(gs, [p["heldout_mse"] for p in pts], "o-", color="tab:blue", label="held-out output MSE (left)")
    ax.set_xlabel("group budget G")
    ax.set_ylabel("held-out attention-output MSE", color="tab:blue")
    ax2 = ax.twinx()
    ax2.plot(gs, [p["coefficients"] for p in pts], "s--", color="tab:orange", label="coefficients / head (right)")
    ax2.set_ylabel("trainable coefficients per head", color="tab:orange")
    for label, key, style in (("App. B choice", "app_b_groups", ":"), ("this run", "run_groups", "-.")):
        g = result.get(key)
        if g is not None and (key == "app_b_groups" or g != result.get("app_b_groups")):
            ax.axvline(g, color="gray", ls=style, lw=1, label=f"{label} (G = {g})")
    # one legend for both axes, under the panel: inside it covered the top-right points (the coefficient curve
    # ends there) and left the right axis's curve out
    handles, labels = (sum(pair, []) for pair in zip(ax.get_legend_handles_labels(),
                                                     ax2.get_legend_handles_labels(), strict=True))
    ax.legend(handles, labels, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    ax.set_title(f"Group budget, layer {result['layer']} head {result['head']}")
    ax.set_xticks(gs)
    fig.tight_layout()
    return atomic_save_figure(fig, path)
