"""`oal diagnose --parts offset`: the planted-offset experiment on one layer, cached by its settings, and what the
report shows of it (the table, RelMSE against offset size, and OAL's measured gain per layer beside its offsets).

DIR/diagnostics/offset.json   {"settings_key", "settings", "softmax_max_change", "rows": [...], "complete"}; rows are
                              written as they finish, so a killed run resumes at the next offset size
DIR/diagnostics/offset.md     the table
DIR/figures/offset/relmse.png held-out RelMSE against the planted offset std, OAL and global
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from oal.diagnostics.offset import OFFSET_FILE, OFFSET_STDS, offset_experiment, plot_offset, slowest_rope_pair
from oal.diagnostics.parts import done_part, write_part
from oal.errors import InputError
from oal.models.pretrained import read_json_object
from oal.rundir.files import atomic_save_figure, atomic_write_text, load_json

__all__ = ["GAIN_FIGURE", "OFFSET_FIGURE", "OffsetSettings", "gain_points", "offset_report", "offset_table",
           "parse_stds", "plot_gain", "representative_layer", "run_offset"]

OFFSET_FIGURE = "figures/offset/relmse.png"
GAIN_FIGURE = "figures/offset/gain.png"
FORMAT = "oal.offset/1"


@dataclass
class OffsetSettings:
    """What the experiment runs with: the run's calibration settings (`cfg`, a CalibConfig), grouping (App. B
    keyword arguments) and seed; `layer` None takes the run's representative layer; `sequences` None every held-out
    fidelity block."""

    cfg: object
    grouping: dict
    seed: int
    layer: int | None = None
    stds: Sequence[float] = field(default_factory=lambda: list(OFFSET_STDS))
    sequences: int | None = None

    def to_dict(self) -> dict:
        return {**asdict(self), "cfg": self.cfg.to_dict(), "stds": [float(s) for s in self.stds]}


MAX_STD = 1000.0  # logits; the experiment plants 0-6


def parse_stds(spec: str | Sequence[float]) -> list[float]:
    """Offset stds (logits) from '0,1,2,3,6' or a sequence: values in [0, MAX_STD], with 0 (the unplanted control)."""
    try:
        stds = [float(x) for x in (spec.split(",") if isinstance(spec, str) else spec) if str(x).strip()]
    except ValueError:
        stds = []
    if not stds or 0.0 not in stds or not all(0 <= x <= MAX_STD for x in stds) or len(set(stds)) != len(stds):
        raise InputError(f"expected distinct offset stds in [0, {MAX_STD:g}] logits including 0, got {spec!r} (real "
                         "per-query offsets are a few logits; far larger ones overflow float32 in the planted q/k "
                         "and the kernel's squared scores)", "--offsets", "stds")
    return sorted(stds)


def representative_layer(out_dir: Path, layers: Sequence[int]) -> int:
    """The representative layer `oal analyze` recorded in DIR/analysis.json when it is among `layers`, else the
    first of `layers` (analyze's own default)."""
    path = Path(out_dir) / "analysis.json"
    if path.is_file():
        rep = read_json_object(path, "the analysis record of `oal analyze` / `oal run`").get("representative")
        rep = rep.get("layer") if isinstance(rep, dict) else None
        if rep in layers:
            return int(rep)
    return int(sorted(layers)[0])


def run_offset(model, blocks: Mapping[str, torch.Tensor], layers: Sequence[int], out_dir: str | Path,
               settings: OffsetSettings, *, console=None) -> dict:
    """The experiment of `oal.diagnostics.offset` on the grouping, calib_train, calib_val and fidelity `blocks`,
    written to DIR/diagnostics/offset.json (+ .md, figure). Reuses a complete result with the same settings, and
    the finished rows of an interrupted one."""
    from oal.diagnostics.fidelity_table import capture_layers
    from oal.methods.base import newer_versions
    from oal.models.capture import output_projection
    from oal.models.provenance import weights_record
    from oal.rundir.hashes import config_hash, tensor_hash

    out = Path(out_dir)
    layer = representative_layer(out, layers) if settings.layer is None else int(settings.layer)
    n_layers = model.config.num_hidden_layers
    if not 0 <= layer < n_layers:
        raise InputError(f"expected a layer in [0, {n_layers}), got {layer}", "--layer", "layer")
    parse_stds(settings.stds)
    held_ids = blocks["fidelity"][: settings.sequences] if settings.sequences else blocks["fidelity"]
    dims = slowest_rope_pair(model)
    record = {**settings.to_dict(), "layer": layer, "dims": list(dims), "format": FORMAT,
              "blocks": {r: tensor_hash(blocks[r]) for r in ("grouping", "calib_train", "calib_val")}
              | {"fidelity": tensor_hash(held_ids)},
              "model": weights_record(model)["state_dict_sha256"]}
    if versions := newer_versions(("global", "oal")):  # what it recalibrates: a new construction recomputes
        record["versions"] = versions
    key = config_hash(record)
    path = out / "diagnostics" / OFFSET_FILE
    old = done_part(path, key)
    if old is None or not old.get("complete"):
        t0 = time.perf_counter()
        if console is not None:
            console.print(f"offset experiment: layer {layer}, RoPE pair {dims}, offset std {list(settings.stds)}")
        data = {r: capture_layers(model, ids, [layer], where)[layer] for r, ids, where in
                (("grouping", blocks["grouping"], "the grouping prompts"),
                 ("train", blocks["calib_train"], "the calibration training blocks"),
                 ("val", blocks["calib_val"], "the calibration validation blocks"),
                 ("held", held_ids, "the held-out fidelity blocks"))}

        def write(rows: list[dict], complete: bool = False, **extra) -> dict:
            return write_part(path, {"settings_key": key, "settings": record, "complete": complete, **extra,
                                     "rows": rows})

        def on_row(rows):
            write(rows, elapsed_s=time.perf_counter() - t0 + (old or {}).get("elapsed_s", 0.0))
            if console is not None:
                r = rows[-1]
                console.print(f"  offset std {r['offset_std']:g}: OAL {r['oal_relmse']:.4f}, global "
                              f"{r['global_relmse']:.4f} (ratio {r['ratio']:.3f})")

        res = offset_experiment(data["grouping"], data["train"], data["val"], data["held"], layer=layer, dims=dims,
                                grouping_params=settings.grouping, cfg=settings.cfg, seed=settings.seed,
                                stds=settings.stds, o_proj=output_projection(model, layer),
                                done=(old or {}).get("rows", []), on_row=on_row)
        old = write(res["rows"], True, softmax_max_change=res["softmax_max_change"],
                    softmax_max_change_captured_dtype=res["softmax_max_change_captured_dtype"],
                    elapsed_s=time.perf_counter() - t0 + (old or {}).get("elapsed_s", 0.0))
    atomic_write_text(out / "diagnostics" / "offset.md",
                      "# Planted per-query offsets\n\n" + "\n".join(offset_table(old)))
    plot_offset({"layer": layer, "dims": dims, "rows": old["rows"]}, out / OFFSET_FIGURE)
    return old


def offset_table(res: Mapping) -> list[str]:
    """The experiment's markdown: one row per planted offset size."""
    s = res["settings"]
    rows = []
    for r in res["rows"]:
        real = r["realised_offset_std"]
        iso = sum(g["isolated"] for g in r["groups"])
        rows.append(f"| {r['offset_std']:g} | {sum(real) / len(real):.2f} | {r['oal_relmse']:.4f} | "
                    f"{r['global_relmse']:.4f} | {r['ratio']:.3f} | "
                    f"{', '.join(str(g['n_groups']) for g in r['groups'])} | {iso} of {len(r['groups'])} | "
                    f"{r['softmax_max_change']:.1e} / {r['softmax_max_change_captured_dtype']:.1e} |")
    by = {r["offset_std"]: r for r in res["rows"]}
    lines = [f"Layer {s['layer']}, every head: a per-query offset planted in RoPE's slowest pair {tuple(s['dims'])} "
             "without changing softmax's output (q scaled by c, k by 1/c, plus a key constant); App. B groups "
             "recomputed with the run's grouping settings, global and OAL recalibrated with the run's calibration "
             f"settings ({s['cfg']['max_steps']} updates per start, seed {s['seed']}); RelMSE (Eq. 22, before W_o) on "
             "the held-out fidelity blocks.", "",
             "| offset std (logits) | realised on held-out (mean over heads) | OAL RelMSE | global RelMSE "
             "| OAL / global | groups per head | heads with the planted dims isolated "
             "| softmax max change (float64 / captured dtype) |", "|---|---|---|---|---|---|---|---|", *rows, ""]
    if 0.0 in by and len(by) > 1:
        top = max(by)
        lines += [f"Without an offset OAL's RelMSE is {by[0.0]['ratio']:.3f}x global's; at an offset std of {top:g} "
                  f"logits it is {by[top]['ratio']:.3f}x. Largest change of the softmax output by the planting: "
                  f"{res.get('softmax_max_change', float('nan')):.1e} (float64).", ""]
    return lines


def gain_points(analysis: Mapping | None, metrics: Mapping | None, offset: Mapping | None) -> dict:
    """(isolated offset share, OAL's RelMSE reduction against global) per converted layer of the run, and per row of
    the planted experiment: the relation the report plots."""
    real, planted = [], []
    per_layer = ((metrics or {}).get("fidelity") or {})
    layers = ((analysis or {}).get("offset") or {}).get("layers", {})
    o, g = (per_layer.get(m, {}).get("per_layer", {}) for m in ("oal", "global"))
    for layer, row in layers.items():
        if layer in o and layer in g and g[layer]["relmse"] > 0:
            heads = row["heads"]
            real.append({"layer": int(layer), "x": sum(h["isolated_offset_share"] for h in heads) / len(heads),
                         "gain": 1 - o[layer]["relmse"] / g[layer]["relmse"]})
    for r in (offset or {}).get("rows", []):
        if "isolated_offset_share" in r:
            planted.append({"offset_std": r["offset_std"], "x": sum(r["isolated_offset_share"]) /
                            len(r["isolated_offset_share"]), "gain": 1 - r["ratio"]})
    return {"real": real, "planted": planted}


def plot_gain(points: Mapping, path: str | Path) -> Path:
    """OAL's held-out RelMSE reduction against global, per layer, against the layer's isolated offset share."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 3.4))
    pct = 100.0  # both axes in percent, as the report's table gives the shares
    if points["planted"]:
        pl = points["planted"]
        ax.plot([pct * p["x"] for p in pl], [pct * p["gain"] for p in pl], "o--", color="#ff7f0e", mfc="none",
                label="planted offsets (diagnose)")
        for p in pl:
            ax.annotate(f"{p['offset_std']:g}", (pct * p["x"], pct * p["gain"]), fontsize=7, xytext=(3, -8),
                        textcoords="offset points")
    ax.scatter([pct * p["x"] for p in points["real"]], [pct * p["gain"] for p in points["real"]], color="#1f77b4",
               zorder=3, label="this run, per converted layer")
    for p in points["real"]:
        ax.annotate(f"L{p['layer']}", (pct * p["x"], pct * p["gain"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.axhline(0, color="k", lw=0.6)
    ax.set_xlabel("isolated offset share of the score variance (%, mean over heads)")
    ax.set_ylabel("OAL's RelMSE reduction vs global (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return atomic_save_figure(fig, path, dpi=110, bbox_inches="tight")


def offset_report(run_dir: Path, prefix: str) -> list[str]:
    """The report's offset section: the experiment (when `oal diagnose --parts offset` ran here) and the gain of
    each converted layer beside its offset share (with the figure written into DIR/figures/offset/)."""
    from oal.analysis.offset import offset_markdown

    analysis = load_json(run_dir / "analysis.json") if (run_dir / "analysis.json").is_file() else None
    metrics = load_json(run_dir / "metrics.json") if (run_dir / "metrics.json").is_file() else None
    path = run_dir / "diagnostics" / OFFSET_FILE
    offset = load_json(path) if path.is_file() else None
    offset = offset if isinstance(offset, dict) and offset.get("rows") else None
    if not (analysis and "offset" in analysis) and offset is None:
        return []
    out = ["## Per-query offsets: will OAL beat a global quadratic here?", ""]
    if analysis and "offset" in analysis:
        out += offset_markdown(analysis["offset"], analysis.get("concentration"))
    if offset is not None:
        out += ["Planted offsets (`oal diagnose --parts offset`):", "", *offset_table(offset)]
        if (run_dir / OFFSET_FIGURE).is_file():
            out += [f"![offset experiment]({prefix}{OFFSET_FIGURE})", ""]
    pts = gain_points(analysis, metrics, offset)
    if pts["real"]:
        plot_gain(pts, run_dir / GAIN_FIGURE)
        rows = [f"| {p['layer']} | {100 * p['x']:.2f}% | {100 * p['gain']:+.1f}% |" for p in pts["real"]]
        out += ["OAL's measured gain per converted layer (held-out RelMSE reduction against the learned global, "
                "before W_o) beside the layer's isolated offset share (the share of the score variance that is a "
                "per-query constant carried by isolated groups, mean over heads)"
                + ("; the planted rows show the relation the experiment measured." if pts["planted"] else "."), "",
                "| layer | isolated offset share | OAL's RelMSE reduction |", "|---|---|---|", *rows, "",
                f"![gain against offset share]({prefix}{GAIN_FIGURE})", ""]
    return out
