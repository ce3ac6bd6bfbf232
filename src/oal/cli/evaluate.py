"""`oal evaluate`: frozen-attention fidelity (Table 2) of a run's converted models into DIR/metrics.json."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..runio import atomic_write_json
from ._common import AdapterOpt, BaseModelOpt, DataDirOpt, DeviceOpt, blocks_or_fail
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
    adapter: AdapterOpt = None,
    device: DeviceOpt = "cpu",
) -> None:
    """Frozen-attention fidelity (Table 2, App. C) on the plan's held-out blocks -> DIR/metrics.json.

    Calibrated kernels on the base model go to metrics.json["fidelity"]; a method with the run's adapter is measured
    as adapted (trained kernels against the softmax attention of the LoRA-merged weights) into ["fidelity_adapted"].
    """
    from ..evaluate.fidelity import run_fidelity

    wanted = [m.strip() for m in methods.split(",") if m.strip()]
    if not wanted:
        raise typer.BadParameter("expected at least one method", param_hint="--methods")

    def held_out(tok, mdl):
        blocks = blocks_or_fail(tok, mdl, data, data_dir, preset)[0]["fidelity"]
        return blocks[:blocks_limit] if blocks_limit else blocks

    try:
        res = run_fidelity(out, wanted, held_out, adapter=adapter, model=model, device=device, progress=True)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--out") from None
    metrics_path = out / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    kinds = {"fidelity": "calibrated", "fidelity_adapted": "adapted"}
    for key in kinds:
        if res[key]:
            metrics.setdefault(key, {}).update(res[key])  # merge: other stages add their own keys
    metrics.setdefault("model", res["model"])
    metrics.setdefault("converted_layers", res["converted_layers"])
    atomic_write_json(metrics_path, metrics)
    table = Table(title="frozen-attention fidelity on the held-out blocks")
    for col in ("method", "kernels", "MSE", "RelMSE", "MSE post-o", "RelMSE post-o"):
        table.add_column(col, justify="right")
    for key, kind in kinds.items():
        for m, r in res[key].items():
            table.add_row(m, kind, *(f"{r[k]:.4g}" for k in ("mse", "relmse", "mse_post_o", "relmse_post_o")))
    Console().print(table)
