"""`oal evaluate`: frozen-attention fidelity (Table 2) of calibrated kernels into DIR/metrics.json."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..io import kernel_dir
from ..runio import atomic_write_json
from ._common import BaseModelOpt, DataDirOpt, DeviceOpt, DtypeOpt, base_model_name, blocks_or_fail, load_model_or_fail
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
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
) -> None:
    """Frozen-attention fidelity (Table 2, App. C) on the plan's held-out blocks -> DIR/metrics.json["fidelity"]."""
    from ..evaluate.fidelity import fidelity
    from ..io import load_kernels, model_fingerprint

    wanted = [m.strip() for m in methods.split(",") if m.strip()]
    name = base_model_name(kernel_dir(out, wanted[0]) if wanted else out, model)
    mdl, tok, _ = load_model_or_fail(name, device, dtype)
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
