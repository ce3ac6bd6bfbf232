"""`oal convert`: load a run's converted model (adapted when the run has an adapter), check it, optionally export."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from oal.cli.app import app
from oal.cli.export import export_or_fail
from oal.cli.options import AdapterOpt, BaseModelOpt, DeviceOpt, RunDtypeOpt
from oal.pipeline.inputs import converted_or_fail


@app.command("convert")
def convert_cmd(
    out: Path = typer.Option(..., "--out", help="Run directory with calibrated kernels (`oal calibrate`)."),
    model: BaseModelOpt = None,
    method: str = typer.Option("oal", help="Which calibrated kernels to load (oal, global, ...)."),
    adapter: AdapterOpt = None,
    export: Path = typer.Option(None, help="Also write the converted model as one folder, as `oal export` does."),
    device: DeviceOpt = "auto",
    dtype: RunDtypeOpt = None,
) -> None:
    """Load the converted model, check a forward pass, print the converted layers."""
    import torch

    from oal.models.attention import converted_methods

    mdl, tok, info = converted_or_fail(out, model, method, device, adapter, dtype)
    ids = torch.randint(0, mdl.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        res = mdl(ids.to(mdl.device))
    logits = getattr(res, "logits", None)  # an encoder's run: its hidden states
    if not bool(torch.isfinite(res.last_hidden_state if logits is None else logits).all()):
        raise typer.BadParameter("the converted model produced non-finite outputs", param_hint="--out")
    table = Table(title=f"{info['base_model']}: converted layers ({method}, "
                        f"{'adapted' if info['adapter'] else 'calibrated kernels'})")
    for col in ("layer", "method", "groups per head", "kernel params"):
        table.add_column(col, justify="right")
    for i, m in converted_methods(mdl).items():
        groups = getattr(m, "groups", None)
        g = "-" if groups is None else ",".join(str(int(x.max()) + 1) for x in groups)
        table.add_row(str(i), m.name, g, str(sum(p.numel() for p in m.parameters())))
    Console().print(table)
    if export is not None:
        export_or_fail(out, method, export, adapter=info["adapter"] is not None, model=model)
