"""`oal evaluate`: frozen-attention fidelity (Table 2) of calibrated kernels, or with --zeroshot the zero-shot
PIQA / HellaSwag / ARC-E accuracies (Table 3, App. F.3) of a run's methods, into DIR/metrics.json."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..io import kernel_dir
from ..runio import atomic_write_json
from ._common import (
    BaseModelOpt,
    DataDirOpt,
    DeviceOpt,
    LimitOpt,
    TaskFileOpt,
    TasksOpt,
    ZeroshotDirOpt,
    base_model_name,
    blocks_or_fail,
    load_model_or_fail,
)
from .app import app


@app.command("evaluate")
def evaluate_cmd(
    out: Path = typer.Option(..., "--out", help="Run directory with calibrated kernels."),
    model: BaseModelOpt = None,
    data: str = typer.Option("builtin", help="Corpus of the held-out fidelity blocks."),
    data_dir: DataDirOpt = None,
    methods: str = typer.Option("oal,global", help="Comma-separated calibrated methods in DIR."),
    preset: str = typer.Option(None, help="Split-plan preset (default: detected from the model)."),
    blocks_limit: int = typer.Option(None, "--blocks", help="Use only the first N fidelity blocks."),
    zeroshot: bool = typer.Option(False, "--zeroshot", help="Zero-shot accuracies instead of fidelity, on each "
                                  "method's adapted model (base + kernels + DIR/adapter/<method> when present)."),
    tasks: TasksOpt = "all",
    task_file: TaskFileOpt = None,
    zeroshot_dir: ZeroshotDirOpt = None,
    limit: LimitOpt = None,
    device: DeviceOpt = "cpu",
) -> None:
    """Frozen-attention fidelity (Table 2, App. C) on the plan's held-out blocks -> DIR/metrics.json["fidelity"];
    with --zeroshot: PIQA / HellaSwag / ARC-E (App. F.3) -> DIR/metrics.json["zeroshot"][method][task]."""
    from ..evaluate.fidelity import fidelity
    from ..io import load_kernels, model_fingerprint

    wanted = [m.strip() for m in methods.split(",") if m.strip()]
    if zeroshot:
        _zeroshot(out, model, wanted, tasks, task_file, zeroshot_dir, limit, device)
        return
    name = base_model_name(kernel_dir(out, wanted[0]) if wanted else out, model)
    mdl, tok, _ = load_model_or_fail(name, device)
    sets = {}
    for m in wanted:
        try:
            sets[m], _ = load_kernels(kernel_dir(out, m), fingerprint=model_fingerprint(mdl))
        except ValueError as exc:
            raise typer.BadParameter(f"{m}: {exc}", param_hint="--methods") from None
    blocks, _, _ = blocks_or_fail(tok, mdl, data, data_dir, preset)
    held_out = blocks["fidelity"][:blocks_limit] if blocks_limit else blocks["fidelity"]
    res = fidelity(mdl, held_out.to(device), sets, progress=True)
    metrics_path = out / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    metrics.setdefault("fidelity", {}).update(res)  # merge: other stages add their own keys
    metrics.setdefault("model", name)
    metrics.setdefault("converted_layers", sorted(next(iter(sets.values()))) if sets else [])
    atomic_write_json(metrics_path, metrics)
    table = Table(title=f"frozen-attention fidelity, {held_out.shape[0]} held-out blocks x {held_out.shape[1]}")
    for col in ("method", "MSE", "RelMSE", "MSE post-o", "RelMSE post-o"):
        table.add_column(col, justify="right")
    for m, r in res.items():
        table.add_row(m, *(f"{r[k]:.4g}" for k in ("mse", "relmse", "mse_post_o", "relmse_post_o")))
    Console().print(table)


def _method_model(out: Path, model: str | None, method: str, device: str):
    """Base model + `method`'s kernels (none for softmax) + the run's adapter for it, when there is one."""
    from ..adapt import load_adapter
    from ..io import load

    config = out / "config.json"
    recorded = json.loads(config.read_text()).get("config", {}).get("model") if config.is_file() else None
    name = model or (base_model_name(kernel_dir(out, method), None) if method != "softmax" else None) or recorded \
        or "default"
    mdl, tok, _ = load_model_or_fail(name, device)
    try:
        if method != "softmax":
            mdl = load(kernel_dir(out, method), mdl)
        if (out / "adapter" / method / "adapter_config.json").is_file():
            mdl = load_adapter(mdl, out / "adapter" / method)
    except ValueError as exc:
        raise typer.BadParameter(f"{method}: {exc}", param_hint="--methods") from None
    return mdl, tok


def _zeroshot(out: Path, model, methods: list[str], tasks: str, task_file, zeroshot_dir, limit, device) -> None:
    from ..data.zeroshot import DISPLAY_NAMES, parse_task_files
    from ..evaluate.zeroshot import evaluate_tasks, load_tasks, merge_metrics

    if not out.is_dir():
        raise typer.BadParameter(f"no such run directory: {out}", param_hint="--out")
    try:
        sets, skipped = load_tasks(tasks, data_dir=zeroshot_dir, task_files=parse_task_files(task_file), limit=limit)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tasks/--task-file/--zeroshot-dir/--limit") from None
    console = Console()
    for reason in skipped.values():
        console.print(f"[yellow]skip zero-shot {reason}[/yellow]")
    metrics_path = out / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    if not sets:  # nothing to score: record why the columns are missing, and say so by the exit code
        atomic_write_json(metrics_path, merge_metrics(metrics, "", {}, {}, skipped))
        raise typer.Exit(code=1)
    table = Table(title="zero-shot accuracy (%; acc_norm: the paper's normalisation)")
    for col in ("method", "task", "acc", "acc_norm", "acc_norm (lm-eval)", "n"):
        table.add_column(col, justify="right")
    for m in methods:
        mdl, tok = _method_model(out, model, m, device)
        res = evaluate_tasks(mdl, tok, sets, progress=True, description=f"zeroshot:{m}")
        merge_metrics(metrics, m, res, {t: prov for t, (_, prov) in sets.items()}, skipped)
        atomic_write_json(metrics_path, metrics)  # after each method: a killed command keeps what it finished
        for t, r in res.items():
            table.add_row(m, DISPLAY_NAMES[t], *(f"{r[k]:.2f}" for k in ("acc", "acc_norm", "acc_norm_lmeval")),
                          str(r["n"]))
    console.print(table)
