
import statistics

from rich.table import Table

from oal.data.zeroshot import DISPLAY_NAMES


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def aggregate_seeds(per_seed: dict[int, dict]) -> dict:
    """Mean and sample std (n-1) over seeds of every perplexity and fidelity number; per-seed values kept."""
    seeds = sorted(per_seed)
    first = per_seed[seeds[0]]
    out = {"model": first["model"], "converted_layers": first["converted_layers"], "seeds": seeds,
           "methods": first["methods"], "per_seed": {str(s): per_seed[s] for s in seeds},
           "perplexity": {}, "perplexity_std": {}, "perplexity_no_adapt": {}, "fidelity": {}, "fidelity_std": {},
           "seed": seeds[0]}
    for key in ("perplexity", "perplexity_no_adapt"):
        for m in first[key]:
            vals = [per_seed[s][key][m] for s in seeds if m in per_seed[s][key]]
            if len(vals) == len(seeds):
                mean, std = _mean_std(vals)
                out[key][m] = mean
                if key == "perplexity":
                    out["perplexity_std"][m] = std
    for m in first["fidelity"]:
        out["fidelity"][m], out["fidelity_std"][m] = {}, {}
        for metric in ("mse", "relmse", "mse_post_o", "relmse_post_o"):
            vals = [per_seed[s]["fidelity"][m][metric] for s in seeds if m in per_seed[s]["fidelity"]]
            if len(vals) == len(seeds):
                out["fidelity"][m][metric], out["fidelity_std"][m][metric] = _mean_std(vals)
        layers = first["fidelity"][m].get("per_layer", {})
        if layers and all("per_layer" in per_seed[s]["fidelity"].get(m, {}) for s in seeds):
            out["fidelity"][m]["per_layer"] = {
                layer: {k: statistics.fmean(per_seed[s]["fidelity"][m]["per_layer"][layer][k] for s in seeds)
                        for k in row} for layer, row in layers.items()}
        subsets = first["fidelity"][m].get("subsets", {})
        if subsets and all("subsets" in per_seed[s]["fidelity"].get(m, {}) for s in seeds):
            out["fidelity"][m]["subsets"] = {
                label: {k: v if k == "layers" else statistics.fmean(
                    per_seed[s]["fidelity"][m]["subsets"][label][k] for s in seeds) for k, v in row.items()}
                for label, row in subsets.items()}
    for m, tasks in first.get("zeroshot", {}).items():
        for t, row in tasks.items():
            per = [per_seed[s].get("zeroshot", {}).get(m, {}).get(t) for s in seeds]
            if all(per):
                mean_std = {k: _mean_std([p[k] for p in per]) for k in row if k != "n"}
                out.setdefault("zeroshot", {}).setdefault(m, {})[t] = {k: v[0] for k, v in mean_std.items()} | {
                    "n": row["n"]}
                out.setdefault("zeroshot_std", {}).setdefault(m, {})[t] = {k: v[1] for k, v in mean_std.items()}
    for key in ("zeroshot_data", "zeroshot_skipped"):
        if key in first:
            out[key] = first[key]
    out["adapt"] = first.get("adapt", {})  # curves and selection of the first seed (see per_seed for the rest)
    out["elapsed_s"] = {}
    for s in seeds:
        for stage, sec in per_seed[s]["elapsed_s"].items():
            out["elapsed_s"][stage] = out["elapsed_s"].get(stage, 0.0) + sec
    return out


def summary_table(metrics: dict) -> Table:
    """methods x (fidelity, PPL, PPL against softmax, zero-shot) for the terminal, its caption naming each column's
    unit and what it is compared against."""
    from oal.pipeline.report_summary import ppl_ratio

    multi = "perplexity_std" in metrics
    tasks = [t for t in DISPLAY_NAMES if any(t in z for z in metrics.get("zeroshot", {}).values())]
    has_ratio = bool(metrics.get("perplexity", {}).get("softmax"))
    caption = ["RelMSE: held-out attention-output error against softmax, before / after W_o (0 = identical). "
               "PPL: test perplexity, lower is better" + (" (mean ± sample std over seeds)" if multi else "") + "."]
    if has_ratio:
        caption.append("PPL / softmax: adapted PPL over softmax's (1.000x = matches softmax).")
    if tasks:
        caption.append("PIQA / HellaSwag / ARC-E: zero-shot acc_norm %.")
    if metrics.get("zeroshot_skipped"):
        skipped = ", ".join(DISPLAY_NAMES.get(t, t) for t in metrics["zeroshot_skipped"])
        caption.append(f"Zero-shot not measured: {skipped} (report.md says why).")
    table = Table(title=f"oal run: {metrics.get('model')} (layers {metrics.get('converted_layers')})",
                  caption=" ".join(caption))
    ratio_col = ("PPL / softmax",) if has_ratio else ()
    cols = ("method", "RelMSE", "RelMSE post-o", "PPL no adapt", "PPL (LoRA)", *ratio_col,
            *(DISPLAY_NAMES[t] for t in tasks))
    for col in cols:
        table.add_column(col, justify="right")
    for m in metrics.get("methods", []):
        f = metrics.get("fidelity", {}).get(m, {})
        ppl = metrics.get("perplexity", {}).get(m)
        cell = "-" if ppl is None else f"{ppl:.3f}"
        if multi and ppl is not None:
            cell += f" ± {metrics['perplexity_std'][m]:.3f}"
        pre = metrics.get("perplexity_no_adapt", {}).get(m)
        z = metrics.get("zeroshot", {}).get(m, {})
        ratio = ppl_ratio(metrics, m)
        ratio_cell = ("1.000x" if m == "softmax" else "-" if ratio is None else f"{ratio:.3f}x",) if has_ratio else ()
        table.add_row(m, f"{f['relmse']:.4f}" if "relmse" in f else "-",
                      f"{f['relmse_post_o']:.4f}" if "relmse_post_o" in f else "-",
                      "-" if pre is None else f"{pre:.3f}", cell, *ratio_cell,
                      *(f"{z[t]['acc_norm']:.2f}" if t in z else "-" for t in tasks))
    return table
