"""`oal evaluate`: frozen-attention fidelity (Table 2) of a run's converted models into DIR/metrics.json."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ._common import AdapterOpt, BaseModelOpt, DataDirOpt, DeviceOpt, DtypeOpt
from .app import app


@app.command("evaluate")
def evaluate_cmd(
    out: Path = typer.Option(..., "--out", help="Run directory with calibrated kernels."),
    model: BaseModelOpt = None,
    data: str = typer.Option(None, help="Corpus of the held-out fidelity blocks (default: the run's, or builtin)."),
    data_dir: DataDirOpt = None,
    methods: str = typer.Option(None, help="Comma-separated calibrated methods in DIR (default: the run's, or "
                                "oal,global)."),
    preset: str = typer.Option(None, help="Split-plan preset (default: the run's plan, or detected from the model)."),
    blocks_limit: int = typer.Option(None, "--blocks", min=1, help="Use only the first N fidelity blocks."),
    adapter: AdapterOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
) -> None:
    """Frozen-attention fidelity (Table 2, App. C) on the plan's held-out blocks -> DIR/metrics.json (and report.md,
    in an `oal run` directory).

    Calibrated kernels on the base model go to metrics.json["fidelity"]; a method with the run's adapter is measured
    as adapted (trained kernels against the softmax attention of the LoRA-merged weights) into ["fidelity_adapted"].
    """
    from ..evaluate.run_fidelity import evaluate_fidelity

    wanted = None if methods is None else [m.strip() for m in methods.split(",") if m.strip()]
    console = Console()
    res = evaluate_fidelity(out, wanted, model=model, data=data, data_dir=data_dir, preset=preset,
                            blocks=blocks_limit, adapter=adapter, device=device, dtype=dtype, console=console)
    table = Table(title="frozen-attention fidelity on the held-out blocks")
    for col in ("method", "kernels", "blocks", "MSE", "RelMSE", "MSE post-o", "RelMSE post-o"):
        table.add_column(col, justify="right")
    for key, kind in (("fidelity", "calibrated"), ("fidelity_adapted", "adapted")):
        for m, r in res[key].items():
            table.add_row(m, kind, f"{r['n_blocks']} x {r['block_len']}",
                          *(f"{r[k]:.4g}" for k in ("mse", "relmse", "mse_post_o", "relmse_post_o")))
    console.print(table)
