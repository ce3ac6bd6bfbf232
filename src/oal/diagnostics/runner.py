"""`diagnose`: Table 1, Fig. 2(b) and Table 2 written into a run directory (resumable per part).

DIR/diagnostics/table1.json, table1.md    retained-error ratios, Gaussian control, matched-control test;
                                          DIR/figures/retained_error.png
DIR/diagnostics/budget.json               group-budget points;  DIR/figures/group_budget.png
                                          (in an `oal run` directory both figures go to DIR/figures/diagnostics/:
                                          its figures/ are its report's)
DIR/diagnostics/table2.json, table2.md    fidelity of every method; merged into DIR/metrics.json["fidelity"]
                                          (not in an `oal run` directory: its metrics are its own kernels')
DIR/diagnostics/groups.json               the groups used (from DIR/groups.json when `oal analyze` ran)
DIR/diagnostics/offset.json, offset.md    the planted per-query offset experiment (`diagnostics.offset_part`);
                                          DIR/figures/offset/relmse.png

A part whose JSON already holds the same settings is skipped, so a killed run resumes at the next part (the
offset part also at its next offset size).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from rich.console import Console

from oal.device import module_device, to_device
from oal.diagnostics.budget import budget_curve, plot_budget
from oal.diagnostics.fidelity_table import (
    TABLE2_METHODS,
    calibrate_methods,
    capture_chi,
    capture_layers,
    capture_sequences,
)
from oal.diagnostics.fidelity_table import table2 as run_table2
from oal.diagnostics.parts import done_part, write_part
from oal.diagnostics.retained_error import RetainedErrorConfig, gaussian_control, retained_error, work_units
from oal.diagnostics.tables import plot_table1, table1_markdown, table2_markdown
from oal.errors import InputError
from oal.launch import log_console, progress_bar
from oal.methods.base import newer_versions
from oal.models.provenance import weights_record
from oal.rundir.claim import is_run_dir
from oal.rundir.files import atomic_write_json, atomic_write_text, load_json
from oal.rundir.hashes import tensor_hash

__all__ = ["DEFAULT_PARTS", "PARTS", "TABLE1_METHODS", "check_outputs", "diagnose", "resolve_groups"]

log = logging.getLogger("oal")
TABLE1_METHODS = ("performer", "spectraformer", "dijiang", "taylorshift")
BUDGET_METHODS = ("global", "oal")  # what Fig. 2(b) calibrates (`budget.budget_curve`)
PARTS = ("table1", "budget", "table2", "offset")
DEFAULT_PARTS = PARTS[:3]  # the paper's; the offset experiment runs when asked for


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def check_outputs(out_dir: str | Path, parts: Sequence[str]) -> None:
    """InputError on --out now, before any part runs, where a folder `parts` write into cannot be made or written
    (a file in its way, a read-only folder): a figure or record that could not be written failed after the minutes
    of its part. Creates nothing (a temporary file in the nearest folder that exists, removed at once)."""
    out = Path(out_dir)
    figures = out / "figures" / ("diagnostics" if is_run_dir(out) else "")
    folders = [out / "diagnostics", *([figures] if {"table1", "budget"} & set(parts) else []),
               *([out / "figures" / "offset"] if "offset" in parts else [])]
    if "table2" in parts and not is_run_dir(out):  # merged into metrics.json, recorded under .oal/
        folders.append(out / ".oal" / "evaluate")
        if (out / "metrics.json").exists() and not (out / "metrics.json").is_file():
            raise InputError(f"{out / 'metrics.json'} is not a file, so Table 2 cannot be merged into it; use "
                             "another --out", "--out", "out_dir")
    for folder in folders:
        near = folder
        while not near.exists() and near != near.parent:
            near = near.parent
        if not near.is_dir():
            below = "" if near == folder else f", so {folder} cannot be made"
            raise InputError(f"{near} is not a folder{below}; move it, or use another --out", "--out", "out_dir")
        try:
            tempfile.TemporaryFile(dir=near).close()
        except OSError as exc:
            raise InputError(f"cannot write in {near} ({exc.strerror or exc}); use another --out", "--out",
                             "out_dir") from None


def resolve_groups(model, grouping_blocks: torch.Tensor, layers: Sequence[int], run_dir: Path, grouping: dict,
                   seed: int = 0) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor], str]:
    """Groups [Hq, d] and mean chi [Hq, d] per layer: from DIR/groups.json if `oal analyze` wrote it for
    these layers, else computed here with the App. B procedure on the grouping prompts."""
    groups, chi, source, _ = _resolve_groups(model, grouping_blocks, layers, run_dir, grouping, seed)
    return groups, chi, source


def _resolve_groups(model, grouping_blocks, layers, run_dir: Path, grouping: dict, seed: int):
    """`resolve_groups`, and App. B's groups beside the groups used: a run grouped with `--grouping budget:G` or
    `app-b-pairs` keeps App. B's in each head's "app_b" record (Table 1's S_h is App. B's non-bulk groups)."""
    from oal.analysis import stable_gap_groups

    path = run_dir / "groups.json"
    if path.is_file():
        from oal.analysis import check_groups_model, load_groups

        data = load_json(path)
        groups = load_groups(path)
        if set(layers) <= set(groups):
            check_groups_model(path, model)  # groups of another model would give another model's diagnostics
            rows = {int(li): sorted(r, key=lambda h: h["head"]) for li, r in data["heads"].items() if int(li) in layers}
            chi = {li: torch.tensor([h["chi"] for h in r], dtype=torch.float64) for li, r in rows.items()}
            app_b = {li: torch.tensor([(h.get("app_b") or h)["groups"] for h in r], dtype=torch.long)
                     for li, r in rows.items()}
            return {i: groups[i] for i in layers}, chi, "groups.json", app_b
    chi_pp = capture_chi(model, grouping_blocks, layers)
    groups, chi = {}, {}
    for i in layers:
        res = stable_gap_groups(chi_pp[i], seed=seed, **grouping)
        groups[i], chi[i] = res.groups, res.chi
    return groups, chi, "computed", groups


def diagnose(
    model,
    blocks: Mapping[str, torch.Tensor],
    layers: Sequence[int],
    out_dir: str | Path,
    *,
    parts: Sequence[str] = DEFAULT_PARTS,
    table1_methods: Sequence[str] = TABLE1_METHODS,
    table2_methods: Sequence[str] = TABLE2_METHODS,
    grouping: dict | None = None,
    table1_cfg: RetainedErrorConfig | None = None,
    calib_cfg=None,
    budget_head: tuple[int, int] | None = None,
    budgets: Sequence[int] = tuple(range(1, 17)),
    table1_sequences: int | None = None,
    seed: int = 0,
    offset=None,
    console: Console | None = None,
    tables: Console | None = None,
    model_name: str | None = None,
    method_options: Mapping | None = None,
) -> dict:
    """Run the requested diagnostics on `model` with token `blocks` per role ("grouping", "calib_train",
    "calib_val", "fidelity") for `layers`; returns {part: result}. See the module doc for the files.
    `offset`: the `diagnostics.offset_part.OffsetSettings` of the offset part (the run's calibration, grouping and
    seed; required for it). `console`: progress and notes (default: stderr); `tables`: Table 1 and Table 2 (default:
    `console`). `model_name`: what the tables and JSON name as the measured model (default: its config's path).
    `method_options`: a run's method settings ({"window": W, "sinks": S}) for Table 2's windowed methods."""
    from oal.calibration.data import CalibConfig

    bad = set(parts) - set(PARTS)
    if bad:
        raise ValueError(f"parts: unknown {sorted(bad)}; expected a subset of {PARTS}")
    if table1_sequences is not None and (isinstance(table1_sequences, bool) or not isinstance(table1_sequences, int)
                                         or table1_sequences < 1):
        raise InputError(f"expected a number of held-out sequences >= 1, got {table1_sequences!r}", "--sequences",
                         "table1_sequences")
    console = console or log_console()
    out = Path(out_dir)
    check_outputs(out, parts)  # before any capture or calibration
    cfg = model.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    bad = [g for g in budgets if isinstance(g, bool) or not isinstance(g, int) or not 1 <= g <= dim]
    if "budget" in parts and (bad or not budgets):
        # a budget above d failed once the smaller ones had been calibrated (after Table 1, with the default parts)
        raise InputError(f"expected group budgets in [1, {dim}] (the head dim: each dimension is in one group), got "
                         f"{bad[-1] if bad else 'none'!r}", "--max-budget", "budgets")
    diag = out / "diagnostics"
    # an `oal run` directory's figures/ are its report's (figures/group_budget.png is its budget stage's, and the
    # report shows every other figures/*.png as the contribution analysis'): diagnose keeps to figures/diagnostics/
    fig_dir = out / "figures" / ("diagnostics" if is_run_dir(out) else "")
    diag.mkdir(parents=True, exist_ok=True)
    layers = sorted(int(i) for i in layers)
    grouping = grouping or dict(tail_fraction=0.25, min_support=0.9, min_ratio=1.5, min_groups=2, n_bootstrap=1000)
    t1cfg = copy.copy(table1_cfg or RetainedErrorConfig(seed=seed))
    t1cfg.grouping = dict(grouping)  # the Gaussian control groups with the same App. B procedure and settings
    if "grouping" in blocks:  # ... on as many prompts of the same length as the real grouping (App. A.1)
        t1cfg.gaussian_prompts, t1cfg.gaussian_prompt_len = (int(n) for n in blocks["grouping"].shape)
    ccfg = calib_cfg or CalibConfig(seed=seed)
    results: dict = {}
    blocks = to_device(dict(blocks), module_device(model))  # the stage's boundary: every part runs where the model is
    fid_blocks = blocks["fidelity"]
    if "offset" in parts:
        from oal.diagnostics.offset_part import run_offset

        if offset is None:
            raise ValueError("offset: the offset part needs its settings (diagnostics.offset_part.OffsetSettings)")
        results["offset"] = run_offset(model, blocks, layers, out, offset, console=console)
        if set(parts) == {"offset"}:
            return results
    groups, chi, source, app_b = _resolve_groups(model, blocks["grouping"], layers, out, grouping, seed)
    procedure = _procedure(out) if source == "groups.json" else "app_b"
    atomic_write_json(diag / "groups.json", {"source": source, "procedure": procedure, "grouping": grouping,
                                             "groups": {str(i): g.tolist() for i, g in groups.items()},
                                             "app_b_groups": {str(i): g.tolist() for i, g in app_b.items()}})

    model_sha = weights_record(model)["state_dict_sha256"]  # in every part's key: another model recomputes
    name = model_name or str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    about = {"model": name, "model_sha256": model_sha}  # what a part's JSON says it measured
    # every block a part reads is in its key: another corpus or split plan recomputes it
    data_key = {r: tensor_hash(blocks[r]) for r in ("calib_train", "calib_val", "fidelity") if r in blocks}
    if "table1" in parts:
        n_seq = fid_blocks.shape[0] if table1_sequences is None else min(table1_sequences, fid_blocks.shape[0])
        # S_h is App. B's non-bulk groups (App. A.2), also where the run converted with another procedure
        settings = {"cfg": t1cfg.to_dict(), "methods": list(table1_methods), "layers": layers, "model": model_sha,
                    "groups": {str(i): g.tolist() for i, g in app_b.items()}, "sequences": n_seq,
                    "blocks": fid_blocks[:n_seq].tolist()}
        if versions := newer_versions(table1_methods):
            settings["versions"] = versions
        key = _key(settings)
        done = done_part(diag / "table1.json", key)
        if done is None:
            t0 = time.perf_counter()
            data = capture_sequences(model, fid_blocks[:n_seq], layers)
            real, gauss = _table1(data, app_b, t1cfg, table1_methods, console)
            done = {"settings_key": key, **about, "config": t1cfg.to_dict(), "layers": layers, "sequences": n_seq,
                    "sequence_length": int(fid_blocks.shape[1]), "high_contribution": real, "gaussian": gauss,
                    "elapsed_s": time.perf_counter() - t0}
            done = write_part(diag / "table1.json", done)
            atomic_write_text(diag / "table1.md", "# Table 1\n\n" + f"Model `{name}`, layers {layers}, {n_seq} "
                              f"held-out sequences of {fid_blocks.shape[1]} tokens; S_h: the non-bulk groups of App. "
                              "B.\n\n" + table1_markdown(real, gauss))
        plot_table1(done["high_contribution"], done["gaussian"], fig_dir / "retained_error.png")
        results["table1"] = done
        (tables or console).print(table1_markdown(done["high_contribution"], done["gaussian"]))

    need_calib = "budget" in parts or "table2" in parts
    if need_calib:
        train = capture_layers(model, blocks["calib_train"], layers, "the calibration training blocks")
        val = capture_layers(model, blocks["calib_val"], layers, "the calibration validation blocks")

    if "budget" in parts:
        layer, head = budget_head or (layers[0], 0)
        if layer not in layers:
            raise ValueError(f"budget_head: layer {layer} is not among the evaluated layers {layers}")
        settings = {"cfg": ccfg.to_dict(), "layer": layer, "head": head, "budgets": list(budgets), "model": model_sha,
                    "chi": chi[layer][head].tolist(), "data": data_key, "app_b": app_b[layer][head].tolist()}
        if versions := newer_versions(BUDGET_METHODS):  # a new construction recomputes; version-1 keys stay as were
            settings["versions"] = versions
        key = _key(settings)
        done = done_part(diag / "budget.json", key)
        if done is None:
            held = capture_layers(model, fid_blocks, [layer], "the held-out fidelity blocks")[layer]
            with progress_bar(console=console) as bar:
                task = bar.add_task(f"Fig. 2(b): layer {layer} head {head}", total=len(budgets))
                res = budget_curve(train[layer], val[layer], held, chi[layer][head], head, budgets, ccfg,
                                   layer=layer, on_budget=lambda _p: bar.advance(task))
            done = {"settings_key": key, **about, **res, "app_b_groups": int(app_b[layer][head].max()) + 1}
            done = write_part(diag / "budget.json", done)
        plot_budget(done, fig_dir / "group_budget.png")
        results["budget"] = done

    if "table2" in parts:
        settings = {"cfg": ccfg.to_dict(), "methods": list(table2_methods), "layers": layers, "seed": seed,
                    "model": model_sha, "data": data_key,
                    "groups": {str(i): g.tolist() for i, g in groups.items()}, "blocks": fid_blocks.tolist()}
        if versions := newer_versions(table2_methods):
            settings["versions"] = versions
        if method_options:
            settings["options"] = dict(method_options)
        key = _key(settings)
        done = done_part(diag / "table2.json", key)
        if done is None:
            t0 = time.perf_counter()
            with progress_bar(console=console) as bar:
                task = bar.add_task("Table 2: calibration", total=len(table2_methods) * len(layers))
                methods, summaries = calibrate_methods(table2_methods, train, val, groups, ccfg, seed=seed,
                                                       options=method_options,
                                                       on_done=lambda *_: bar.advance(task))
            fid = run_table2(model, fid_blocks, methods, progress=False if console.quiet else None)  # -q, --no-progress
            done = {"settings_key": key, **about, "fidelity": fid, "calibration": summaries, "layers": layers,
                    "groups_procedure": procedure, "elapsed_s": time.perf_counter() - t0}
            done = write_part(diag / "table2.json", done)
            atomic_write_text(diag / "table2.md", "# Table 2\n\n" + table2_markdown(
                done["fidelity"], f"Frozen-attention fidelity of model `{name}`, layers {layers}, "
                f"{fid_blocks.shape[0]} held-out blocks of {fid_blocks.shape[1]} tokens; OAL with {procedure} groups. "
                "Lower is better."))
        _merge_metrics(out / "metrics.json", done["fidelity"])
        results["table2"] = done
        (tables or console).print(table2_markdown(done["fidelity"]))
    return results


def _procedure(run_dir: Path) -> str:
    """The grouping procedure DIR/groups.json records ("app_b", "budget:G", "app_b_pairs")."""
    data = load_json(run_dir / "groups.json")
    return str(data.get("procedure", "app_b")) if isinstance(data, dict) else "app_b"


def _table1(data: dict, groups: dict, cfg: RetainedErrorConfig, methods: Sequence[str], console: Console):
    """Table 1's two columns ({method: result} of the real data and of the Gaussian control) under one progress bar
    over the whole part, counted in the units of `work_units` (each method's real data and control), so its
    estimate of the time left holds from the first method on."""
    pairs = sum(len(seqs) for seqs in data.values())
    total = sum(work_units(m, pairs, cfg) + work_units(m, pairs, cfg, controls=False) for m in methods)
    real, gauss = {}, {}
    with progress_bar(console=console) as bar:
        task = bar.add_task("Table 1", total=total)

        def advance(n: int) -> None:
            bar.advance(task, n)

        for i, name in enumerate(methods, 1):
            bar.update(task, description=f"Table 1: {name} ({i}/{len(methods)})")
            real[name] = retained_error(name, data, groups, cfg, progress=advance)
            bar.update(task, description=f"Table 1: {name} ({i}/{len(methods)}), Gaussian control")
            gauss[name] = gaussian_control(name, data, cfg, progress=advance)
    return real, gauss


def _merge_metrics(path: Path, fidelity: dict) -> None:
    """metrics.json["fidelity"][method] = {mse, relmse, mse_post_o, relmse_post_o}; other keys untouched.

    Not in an `oal run` directory: its metrics describe its own kernels, and Table 2's are calibrated here."""
    from oal.rundir.hashes import sha256_file
    from oal.rundir.metrics import publish_evaluations, record_evaluation

    if is_run_dir(path.parent):
        log.info("Table 2 kept in diagnostics/table2.json: %s is an `oal run` directory whose metrics.json "
                 "describes its own kernels", path.parent)
        return
    table = {"diagnostics/table2.json": sha256_file(path.parent / "diagnostics" / "table2.json")}  # the numbers' file
    for name, r in fidelity.items():
        record_evaluation(path.parent, f"fidelity:{name}", [(("fidelity", name), {
            k: r[k] for k in ("mse", "relmse", "mse_post_o", "relmse_post_o")})], table)
    publish_evaluations(path.parent)
