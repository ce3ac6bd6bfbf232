"""The study `benchmarks.budget collect` writes: the arms' learning curves and test perplexities (mean over seeds),
the gap ratios (m - softmax) / (global - softmax) at every validation and at the end of each budget (number of
updates), Table 2 with OAL's ratio to the best of the paper's other five methods, the issue's two goals, a figure and
a markdown table. Inputs come from `benchmarks._budget_records` (verified records only)."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks._budget_records import RecordError, read_arms, read_table2

__all__ = ["GOALS", "OTHERS", "collect", "markdown", "plot"]

OTHERS = ("performer", "spectraformer", "dijiang", "taylorshift", "global")  # Table 2's other five (the paper's)
GOALS = {"frozen_ratio": 0.9, "gap_ratio": 0.85}  # issue 47's acceptance


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _std(values: list[float]) -> float | None:
    if len(values) < 2:
        return None
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def _gap(a: float, soft: float, glob: float) -> float | None:
    return (a - soft) / (glob - soft) if glob != soft else None


def _budget(arms: list) -> dict:
    """One budget's (one number of updates) curves, test PPL, arms and gap ratios; each the mean over seeds."""
    by_method: dict[str, list] = {}
    for a in arms:
        by_method.setdefault(a.method, []).append(a)
    curves, by_seed, test_ppl, summary = {}, {}, {}, {}
    for m, group in by_method.items():
        steps = [s for s, _ in group[0].curve]
        if any([s for s, _ in a.curve] != steps for a in group):
            raise RecordError(f"--runs: the seeds of {m} validated at different updates")
        curves[m] = [[s, _mean([a.curve[i][1] for a in group])] for i, s in enumerate(steps)]
        by_seed[m] = {str(a.seed): a.curve for a in group}
        test_ppl[m] = _mean([a.test_ppl for a in group])
        calibrated = [a.test_ppl_calibrated for a in group if a.test_ppl_calibrated is not None]
        summary[m] = {"seeds": [a.seed for a in group], "test_ppl_by_seed": [a.test_ppl for a in group],
                      "test_ppl_std": _std([a.test_ppl for a in group]),
                      "test_ppl_calibrated": _mean(calibrated) if calibrated else None,
                      "layers": group[0].layers, "steps": group[0].steps, "best_step": [a.best_step for a in group],
                      "run_dirs": sorted({a.run_dir for a in group})}
    return {"curves": curves, "curves_by_seed": by_seed, "test_ppl": test_ppl, "arms": summary,
            "gap_ratio": _gap_ratios(curves, test_ppl, summary)}


def collect(runs: list[tuple[Path, list[str] | None]], tables: list[Path], device: str | None = None) -> dict:
    """The study's JSON from verified records (see the module doc). Arms adapted with different numbers of updates
    are budgets of one study: the largest gives the schema's keys, each is under "budgets"."""
    arms, seen = [], {}
    for path, only in runs:
        for arm in read_arms(path, only):
            key = (arm.method, arm.seed, arm.steps)
            if key in seen:
                raise RecordError(f"--runs: arm {arm.method} (seed {arm.seed}, {arm.steps} updates) is in both "
                                  f"{seen[key]} and {arm.run_dir}; name the arms to take with DIR:arm,arm")
            seen[key] = arm.run_dir
            arms.append(arm)
    if not arms:
        raise RecordError("--runs: no adapted arm in the run directories given")
    tokens = {a.tokens_per_update for a in arms}
    if len(tokens) > 1:
        raise RecordError(f"--runs: the arms adapted with different tokens per update ({sorted(tokens)}): "
                          "collect one study at a time")
    budgets = {s: _budget([a for a in arms if a.steps == s]) for s in sorted({a.steps for a in arms})}
    top = budgets[max(budgets)]
    out = {"frozen": {}, "curves": top["curves"], "test_ppl": top["test_ppl"], "tokens_per_update": tokens.pop(),
           "device": device or _device(arms), "updates": max(budgets), "arms": top["arms"],
           "curves_by_seed": top["curves_by_seed"], "gap_ratio": top["gap_ratio"],
           "budgets": {str(s): b for s, b in budgets.items()},
           "gap_ratio_by_budget": {str(s): b["gap_ratio"]["test"] for s, b in budgets.items() if b["gap_ratio"]},
           "frozen_runs": {a.run_dir: a.extra["fidelity"] for a in arms if a.extra["fidelity"]},
           "eval_blocks": {"val": arms[0].extra["val_blocks"], "test": arms[0].extra["test_blocks"]}}
    out["frozen_tables"] = [read_table2(t) for t in tables]
    for t in out["frozen_tables"]:
        t["oal_over_best_other"] = _frozen_ratio(t["methods"])
    if out["frozen_tables"]:
        out["frozen"] = out["frozen_tables"][0]["methods"]
    else:  # the runs' own fidelity stage (their calibrated methods only)
        out["frozen"] = next(iter(out["frozen_runs"].values()), {})
    out["goals"] = _goals(out)
    return out


def _device(arms) -> str:
    a = arms[0]
    return f"{a.device} ({a.platform})" if a.platform else a.device


def _gap_ratios(curves: dict, test_ppl: dict, summary: dict) -> dict:
    """(m - softmax) / (global - softmax) of every converted arm m but global: at each validation (val PPL), on the
    test PPL after adaptation, and on the calibrated test PPL."""
    if "softmax" not in curves or "global" not in curves:
        return {}
    out: dict = {"val": {}, "test": {}, "test_calibrated": {}}
    soft, glob = dict(map(tuple, curves["softmax"])), dict(map(tuple, curves["global"]))
    for m in curves:
        if m in ("softmax", "global"):
            continue
        out["val"][m] = [[s, _gap(v, soft[s], glob[s])] for s, v in curves[m] if s in soft and s in glob]
        out["test"][m] = _gap(test_ppl[m], test_ppl["softmax"], test_ppl["global"])
        cal = [summary[k]["test_ppl_calibrated"] for k in (m, "softmax", "global")]
        out["test_calibrated"][m] = _gap(*cal) if None not in cal else None
    return out


def _frozen_ratio(methods: dict) -> dict | None:
    """OAL's RelMSE over the best of the paper's other five (before and after W_o)."""
    others = [m for m in OTHERS if m in methods]
    if "oal" not in methods or not others:
        return None
    out = {"others": others}
    for key in ("relmse", "relmse_post_o"):
        best = min(others, key=lambda m: methods[m][key])
        out[key] = {"ratio": methods["oal"][key] / methods[best][key], "best_other": best}
    return out


def _goals(out: dict) -> dict:
    goals = {}
    table = out["frozen_tables"][0] if out["frozen_tables"] else None
    ratio = table and table["oal_over_best_other"]
    if ratio:
        value = ratio["relmse"]["ratio"]
        goals["frozen_ratio"] = {"value": value, "best_other": ratio["relmse"]["best_other"],
                                 "others": ratio["others"], "target": GOALS["frozen_ratio"],
                                 "met": value <= GOALS["frozen_ratio"] and len(ratio["others"]) == len(OTHERS)}
    reached = [int(s) for s, g in out["gap_ratio_by_budget"].items() if g.get("oal") is not None]
    if reached:  # at the largest budget that adapted oal, global and softmax
        gap = out["gap_ratio_by_budget"][str(max(reached))]["oal"]
        goals["gap_ratio"] = {"value": gap, "updates": max(reached), "target": GOALS["gap_ratio"],
                              "met": gap <= GOALS["gap_ratio"]}
    return goals


def plot(data: dict, path: Path) -> None:
    """Validation PPL against updates, one colour per arm and one line style per budget (the largest solid); and
    the gap ratio on validation PPL per budget, with the test PPL's gap ratio at the end of each budget."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._common import finish_figure
    from oal.pipeline.report_figures import method_color

    fig, (ax, gx) = plt.subplots(1, 2, figsize=(12, 4.6))
    budgets = sorted(data["budgets"], key=int, reverse=True)
    colours = {m: method_color(m) or f"C{i}" for i, m in
               enumerate(sorted({m for b in data["budgets"].values() for m in b["curves"]}))}
    styles = dict(zip(budgets, ["-", "--", ":", "-."] * 4, strict=False))
    for n in budgets:
        b = data["budgets"][n]
        for m, pts in sorted(b["curves"].items()):
            seeds = list(b.get("curves_by_seed", {}).get(m, {}).values())
            spread = f", {len(seeds)} seeds" if len(seeds) > 1 else ""
            ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o", ms=3, ls=styles[n], color=colours[m],
                    label=f"{m}, {n} updates{spread} (test {b['test_ppl'][m]:.2f})")
            if spread:  # the mean over seeds, with their sample std as a band (a mean alone hides the spread)
                sd = [_std([c[i][1] for c in seeds]) for i in range(len(pts))]
                ax.fill_between([s for s, _ in pts], [v - e for (_, v), e in zip(pts, sd, strict=True)],
                                [v + e for (_, v), e in zip(pts, sd, strict=True)], color=colours[m], alpha=0.15,
                                lw=0)
            calibrated = b["arms"][m]["test_ppl_calibrated"]
            if calibrated is not None and n == budgets[0]:  # the start (test blocks, not validation: a cross)
                ax.plot([0], [calibrated], marker="x", color=colours[m], ls="none")
        for m, pts in sorted(b["gap_ratio"].get("val", {}).items()):
            line, = gx.plot([s for s, _ in pts], [g for _, g in pts], marker="o", ms=3, ls=styles[n],
                            label=f"{n} updates: validation PPL")
            test = b["gap_ratio"]["test"][m]
            if test is not None:
                gx.plot([int(n)], [test], marker="s", ms=7, color=line.get_color(), ls="none",
                        label=f"{n} updates: test PPL ({test:.3f})")
    ax.set_yscale("log")
    ax.set_xlabel("LoRA updates")
    ax.set_ylabel("validation PPL (x: test PPL calibrated)" + (
        "\nmean over seeds, band: ± sample std" if any(len(c) > 1 for b in data["budgets"].values()
                                                       for c in b.get("curves_by_seed", {}).values()) else ""))
    if any(b["gap_ratio"] for b in data["budgets"].values()):
        gx.axhline(GOALS["gap_ratio"], color="grey", ls="--", lw=0.8, label=f"goal {GOALS['gap_ratio']}")
        gx.axhline(1.0, color="black", lw=0.6)
    gx.set_xlabel("LoRA updates")
    gx.set_ylabel("gap ratio (oal - softmax) / (global - softmax)")
    # below the panel: an arm and budget per entry make a tall legend, which "best" laid over the curves
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    finish_figure(fig, [ax, gx], f"SmolLM2-135M: adaptation at {data['tokens_per_update']} tokens per update\n"
                  f"({data['device']})", path)


def markdown(data: dict) -> str:
    lines = [f"tokens per update: {data['tokens_per_update']}; device: {data['device']}",
             "| arm | seeds | test PPL calibrated | test PPL adapted | best update | val PPL at each validation |",
             "|---|---|---|---|---|---|"]
    for n, b in sorted(data["budgets"].items(), key=lambda kv: int(kv[0])):
        for m, a in b["arms"].items():
            cal = f"{a['test_ppl_calibrated']:.2f}" if a["test_ppl_calibrated"] is not None else "-"
            curve = ", ".join(f"{s}: {v:.2f}" for s, v in b["curves"][m])
            lines.append(f"| {m} ({n} updates) | {len(a['seeds'])} | {cal} | {b['test_ppl'][m]:.2f} | "
                         f"{a['best_step']} | {curve} |")
    for n, g in data["gap_ratio_by_budget"].items():
        lines.append(f"gap ratio on test PPL after {n} updates: " + ", ".join(
            f"{m} {v:.3f}" for m, v in g.items() if v is not None))
    for t in data["frozen_tables"]:
        lines += ["", f"Table 2, layers {t['layers']}, fidelity blocks {t['blocks']}, calibration blocks "
                  f"{t['calib_blocks']}:",
                  "| method | MSE | RelMSE | MSE after W_o | RelMSE after W_o |", "|---|---|---|---|---|"]
        lines += [f"| {m} | {r['mse']:.4g} | {r['relmse']:.4f} | {r['mse_post_o']:.4g} | {r['relmse_post_o']:.4f} |"
                  for m, r in t["methods"].items()]
    for name, g in data["goals"].items():
        lines.append(f"goal {name}: {g['value']:.3f} (target <= {g['target']}): {'met' if g['met'] else 'not met'}")
    return "\n".join(lines)


