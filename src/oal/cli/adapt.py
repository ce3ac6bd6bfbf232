"""`oal adapt`: joint LoRA + kernel adaptation (App. F.2) of one arm in an existing run directory, resumable."""

from __future__ import annotations

from pathlib import Path

import typer

from oal.cli.app import app
from oal.cli.options import (
    BatchSizeOpt,
    DeviceOpt,
    GradAccumOpt,
    LoraDropoutOpt,
    Max,
    ProgressOpt,
    RunDtypeOpt,
    SinksOpt,
    ThreadsOpt,
    WindowOpt,
    set_threads,
)


@app.command("adapt")
def adapt_cmd(
    out: Path = typer.Option(..., "--out", help="An existing run directory (after `oal run`)."),
    method: str = typer.Option("oal", help="The arm to adapt: a calibrated method of the run, or softmax."),
    steps: int = typer.Option(None, min=1, max=Max.STEPS,
                              help="Adaptation updates for this arm (recorded in config.json)."),
    batch_size: BatchSizeOpt = None,
    grad_accum: GradAccumOpt = None,
    lora_dropout: LoraDropoutOpt = None,
    window: WindowOpt = None,
    sinks: SinksOpt = None,
    device: DeviceOpt = "auto",
    dtype: RunDtypeOpt = None,
    threads: ThreadsOpt = 1,
    progress: ProgressOpt = True,
) -> None:
    """Joint LoRA + kernel adaptation (App. F.2) of one arm, then its test perplexity; metrics.json and report.md
    are rewritten to match. Resumable. --dtype defaults to the run's own; another dtype is refused. Settings given
    here are recorded in config.json for this arm. --window / --sinks change the run's sliding windows (recorded in
    config.json): calibration reruns, and the other window arms' results leave metrics.json until they are adapted
    again with the new window. Data-parallel under torchrun / accelerate launch (docs/guides/distributed.md)."""
    from oal.cli.consoles import notes_console
    from oal.cli.options import main_console
    from oal.pipeline.runs import adapt_arm

    set_threads(threads)
    metrics = adapt_arm(out, method, steps=steps, batch_size=batch_size, grad_accum=grad_accum,
                        lora_dropout=lora_dropout, window=window, sinks=sinks, device=device, dtype=dtype,
                        console=notes_console(), progress=progress)
    ppl = metrics["perplexity"].get(method)
    main_console().print(f"{method}: test PPL after adaptation = {ppl:.4f}" if ppl is not None else f"{method}: no PPL")
