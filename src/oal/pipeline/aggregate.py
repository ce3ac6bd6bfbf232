
import statistics

from rich.table import Table

from oal.data.zeroshot import DISPLAY_NAMES


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def _lacking(per_seed: dict[int, dict], seeds: list[int], has) -> list[int]:
    return [s for s in seeds if not has(per_seed[s])]


def aggregate_seeds(per_seed: dict[int, dict]) -> dict:
    """Mean and sample std (n-1) over seeds of every perplexity and fidelity number; per-seed values kept.

    A number some seed lacks is not averaged over the others: it is left out, and `not_averaged` names it with the
    seeds that lack it. Seeds that converted different layers (`--layers auto:K` selects per seed) are listed in
    `converted_layers_per_seed`, and per-layer fidelity is averaged over the layers every seed converted."""
    seeds = sorted(per_seed)
    first = per_seed[seeds[0]]
    out = {"model": first["model"], "converted_layers": first["converted_layers"], "seeds": seeds,
           "methods": first["methods"], "per_seed": {str(s): per_seed[s] for s in seeds},
           "perplexity": {}, "perplexity_std": {}, "perplexity_no_adapt": {}, "perplexity_no_adapt_std": {},
           "fidelity": {}, "fidelity_std": {}}  # no top-level "seed": each seed's is in per_seed
    not_averaged = {}
    if any(per_seed[s]["converted_layers"] != first["converted_layers"] for s in seeds):
        out["converted_layers_per_seed"] = {str(s): per_seed[s]["converted_layers"] for s in seeds}
    for key in ("perplexity", "perplexity_no_adapt"):
        for m in sorted(set().union(*(per_seed[s][key] for s in seeds))):
            lack = _lacking(per_seed, seeds, lambda p, m=m, key=key: m in p[key])
            if lack:
                not_averaged[f"{key}:{m}"] = lack
                continue
            out[key][m], out[f"{key}_std"][m] = _mean_std([per_seed[s][key][m] for s in seeds])
    for m in sorted(set().union(*(per_seed[s]["fidelity"] for s in seeds))):
        lack = _lacking(per_seed, seeds, lambda p, m=m: m in p["fidelity"])
        if lack:
            not_averaged[f"fidelity:{m}"] = lack
            continue
        out["fidelity"][m], out["fidelity_std"][m] = {}, {}
        for metric in ("mse", "relmse", "mse_post_o", "relmse_post_o"):
            vals = [per_seed[s]["fidelity"][m][metric] for s in seeds if metric in per_seed[s]["fidelity"][m]]
            if len(vals) == len(seeds):
                out["fidelity"][m][metric], out["fidelity_std"][m][metric] = _mean_std(vals)
        rows = [per_seed[s]["fidelity"][m].get("per_layer") or {} for s in seeds]
        layers = [layer for layer in rows[0] if all(layer in r for r in rows)]  # converted by every seed
        if layers:
            out["fidelity"][m]["per_layer"] = {
                layer: {k: statistics.fmean(r[layer][k] for r in rows) for k in rows[0][layer]} for layer in layers}
        subs = [per_seed[s]["fidelity"][m].get("subsets") or {} for s in seeds]
        same = {label: row for label, row in subs[0].items()  # the same layers in every seed
                if all(sub.get(label, {}).get("layers") == row.get("layers") for sub in subs)}
        if same:
            out["fidelity"][m]["subsets"] = {
                label: {k: v if k == "layers" else statistics.fmean(sub[label][k] for sub in subs)
                        for k, v in row.items()} for label, row in same.items()}
    for m in sorted(set().union(*(per_seed[s].get("zeroshot", {}) for s in seeds))):
        for t in sorted(set().union(*(per_seed[s].get("zeroshot", {}).get(m, {}) for s in seeds))):
            per = [per_seed[s].get("zeroshot", {}).get(m, {}).get(t) for s in seeds]
            row = next(p for p in per if p)
            # the examples: their count, and the file's SHA256 (another --task-file of as many rows is other data)
            data = [((per_seed[s].get("zeroshot_data") or {}).get(t) or {}).get("sha256") for s in seeds]
            want = data[per.index(row)]
            other = [s for s, p, d in zip(seeds, per, data, strict=True) if not p or p["n"] != row["n"] or d != want]
            if other:  # unmeasured, or on other examples
                not_averaged[f"zeroshot:{m}:{t}"] = other
            else:
                mean_std = {k: _mean_std([p[k] for p in per]) for k in row if k != "n"}
                out.setdefault("zeroshot", {}).setdefault(m, {})[t] = {k: v[0] for k, v in mean_std.items()} | {
                    "n": row["n"]}
                out.setdefault("zeroshot_std", {}).setdefault(m, {})[t] = {k: v[1] for k, v in mean_std.items()}
    _passkey(per_seed, seeds, out, not_averaged)
    for key in ("zeroshot_data", "zeroshot_skipped"):
        if key in first:
            out[key] = first[key]
    if not_averaged:
        out["not_averaged"] = not_averaged
    out["adapt"] = first.get("adapt", {})  # curves and selection of the first seed (see per_seed for the rest)
    out["elapsed_s"] = {}
    for s in seeds:
        for stage, sec in per_seed[s]["elapsed_s"].items():
            out["elapsed_s"][stage] = out["elapsed_s"].get(stage, 0.0) + sec
    return out


PASSKEY_SETTINGS = ("lengths", "depths", "trials", "digits", "seed")  # the same prompts in every seed


def _passkey(per_seed: dict[int, dict], seeds: list[int], out: dict, not_averaged: dict) -> None:
    """out["passkey"][method][variant]: each cell's accuracy averaged over the seeds that measured it with the same
    prompts (out["passkey_std"]: the sample std of each length's accuracy and of the mean); any other variant is in
    `not_averaged` with the seeds that lack it or measured other prompts."""
    pk = {s: per_seed[s].get("passkey") or {} for s in seeds}
    for m in sorted(set().union(*pk.values())):
        for v in sorted(set().union(*(pk[s].get(m) or {} for s in seeds))):
            per = [(pk[s].get(m) or {}).get(v) for s in seeds]
            row = next(p for p in per if p)
            differs = [s for s, p in zip(seeds, per, strict=True)
                       if not p or any(p.get(k) != row.get(k) for k in PASSKEY_SETTINGS)]
            if differs:
                not_averaged[f"passkey:{m}:{v}"] = differs
                continue
            acc = {n: {d: statistics.fmean(p["accuracy"][n][d] for p in per) for d in cells}
                   for n, cells in row["accuracy"].items()}
            by_length = {n: _mean_std([p["by_length"][n] for p in per]) for n in row["by_length"]}
            mean = _mean_std([p["mean"] for p in per])
            out.setdefault("passkey", {}).setdefault(m, {})[v] = {
                **{k: row[k] for k in PASSKEY_SETTINGS if k in row}, "accuracy": acc,
                "by_length": {n: ms[0] for n, ms in by_length.items()},
                "by_depth": {d: statistics.fmean(p["by_depth"][d] for p in per) for d in row["by_depth"]},
                "mean": mean[0]}
            out.setdefault("passkey_std", {}).setdefault(m, {})[v] = {
                "by_length": {n: ms[1] for n, ms in by_length.items()}, "mean": mean[1]}


def summary_table(metrics: dict) -> Table:
    """methods x (fidelity, PPL, PPL against softmax, zero-shot) for the terminal, its caption naming each column's
    unit and what it is compared against."""
    from oal.pipeline.report_format import fmt_pm
    from oal.pipeline.report_summary import ppl_ratio

    multi = "perplexity_std" in metrics
    tasks = [t for t in DISPLAY_NAMES if any(t in z for z in metrics.get("zeroshot", {}).values())]
    has_ratio = bool(metrics.get("perplexity", {}).get("softmax"))
    caption = ["RelMSE: held-out attention-output error against softmax, before / after W_o (0 = identical). "
               "PPL: test perplexity, lower is better."
               + (" Every number: mean ± sample std over seeds." if multi else "")]
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

    def cell(key: str, m: str, *path: str, digits: int = 3) -> str:  # mean, and ± the seeds' spread where known
        mean, std = metrics.get(key, {}).get(m), metrics.get(f"{key}_std", {}).get(m)
        for k in path:
            mean, std = (mean or {}).get(k), (std or {}).get(k)
        return "-" if mean is None else fmt_pm(mean, std if multi else None, digits)

    for m in metrics.get("methods", []):
        ratio = ppl_ratio(metrics, m)
        ratio_cell = ("1.000x" if m == "softmax" else "-" if ratio is None else f"{ratio:.3f}x",) if has_ratio else ()
        table.add_row(m, cell("fidelity", m, "relmse", digits=4), cell("fidelity", m, "relmse_post_o", digits=4),
                      cell("perplexity_no_adapt", m), cell("perplexity", m), *ratio_cell,
                      *(cell("zeroshot", m, t, "acc_norm", digits=2) for t in tasks))
    return table
