"""`oal convert`: load calibrated kernels onto the base model, check a forward pass, optionally export."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..io import kernel_dir
from ._common import BaseModelOpt, DeviceOpt, DtypeOpt, converted_or_fail
from .app import app


@app.command("convert")
def convert_cmd(
    out: Path = typer.Option(..., "--out", help="Run directory with calibrated kernels (`oal calibrate`)."),
    model: BaseModelOpt = None,
    method: str = typer.Option("oal", help="Which calibrated kernels to load (oal, global, ...)."),
    export: Path = typer.Option(None, help="Also write a standalone folder: base model + tokenizer + kernels."),
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
) -> None:
    """Load the kernels onto the base model, check a forward pass, print the converted layers."""
    import shutil

    import torch

    from ..io import KERNELS_FILE, META_FILE
    from ..models.convert import converted_methods

    mdl, tok, name = converted_or_fail(out, model, method, device, dtype)
    ids = torch.randint(0, mdl.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = mdl(ids.to(device)).logits
    if not bool(torch.isfinite(logits).all()):
        raise typer.BadParameter("the converted model produced non-finite logits", param_hint="--out")
    table = Table(title=f"{name}: converted layers ({method})")
    for col in ("layer", "method", "groups per head", "kernel params"):
        table.add_column(col, justify="right")
    for i, m in converted_methods(mdl).items():
        groups = getattr(m, "groups", None)
        g = "-" if groups is None else ",".join(str(int(x.max()) + 1) for x in groups)
        table.add_row(str(i), m.name, g, str(sum(p.numel() for p in m.parameters())))
    Console().print(table)
    if export is not None:
        from ..models.registry import load_model

        base, base_tok, _ = load_model(name)
        export.mkdir(parents=True, exist_ok=True)
        base.save_pretrained(export)
        base_tok.save_pretrained(export)
        for f in (KERNELS_FILE, META_FILE):
            shutil.copy2(kernel_dir(out, method) / f, export / f)
        Console().print(f"exported to {export}: `oal.load('{export}', '{export}')` rebuilds the converted model")
