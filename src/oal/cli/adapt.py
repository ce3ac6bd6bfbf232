"""`oal adapt`: joint LoRA + kernel adaptation (App. F.2) of one arm in an existing run directory, resumable."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from ._common import DeviceOpt, DtypeOpt, ThreadsOpt, set_threads
from .app import app


@app.command("adapt")
def adapt_cmd(
    out: Path = typer.Option(..., "--out", help="An existing run directory (after `oal run` or `oal calibrate`)."),
    method: str = typer.Option("oal", help="The arm to adapt: a method name or softmax."),
    steps: int = typer.Option(None, help="Override the number of adaptation updates."),
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    threads: ThreadsOpt = 1,
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """Joint LoRA + kernel adaptation (App. F.2) of one arm, then its test perplexity; resumable.

    --dtype defaults to the run's own; another dtype than the run was made with is refused.
    """
    set_threads(threads)
    from ..config import RunConfig
    from ..pipeline import REFERENCE, Run
    from ..runio import load_json

    cfg_path = out / "config.json"
    if not cfg_path.is_file():
        raise typer.BadParameter(f"{out} has no config.json; run `oal run --out {out}` first", param_hint="--out")
    try:
        d = load_json(cfg_path)["config"]
        if steps is not None:
            d["adapt"] = {**d.get("adapt", {}), "steps": steps}
        if dtype is not None and dtype != d.get("dtype", "float32"):
            raise ValueError(f"--dtype {dtype}: the run was made with {d.get('dtype', 'float32')}")
        d["device"] = device
        if method not in d["methods"]:
            d["methods"] = [*d["methods"], method]
        cfg = RunConfig.from_dict(d)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    console = Console()
    r = Run(cfg, out, console=console, progress=progress)
    try:
        r.setup()
        if method != REFERENCE:
            rec = r.log.stages.get("calibrate")
            if rec is None:
                raise typer.BadParameter(f"{out} has no calibrated kernels; run `oal run --out {out}` first",
                                         param_hint="--out")
            r.keys["calibrate"] = rec["key"]
        if method != REFERENCE and not (r.kernel_dir(method) / "kernels.safetensors").is_file():
            raise typer.BadParameter(f"{out} has no calibrated kernels for {method!r}; run "
                                     f"`oal run --out {out} --methods ...,{method}` first", param_hint="--method")
        if r.adapt(method):
            r.perplexity(method, adapted=True)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    ppl = r.metrics()["perplexity"].get(method)
    console.print(f"{method}: test PPL after adaptation = {ppl:.4f}" if ppl is not None else f"{method}: no PPL")
