"""`oal adapt`: joint LoRA + kernel adaptation (App. F.2) of one arm in an existing run directory, resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from oal.cli.app import app
from oal.cli.options import DeviceOpt, Max, ProgressOpt, RunDtypeOpt, ThreadsOpt, set_threads


@app.command("adapt")
def adapt_cmd(
    out: Path = typer.Option(..., "--out", help="An existing run directory (after `oal run`)."),
    method: str = typer.Option("oal", help="The arm to adapt: a calibrated method of the run, or softmax."),
    steps: int = typer.Option(None, min=1, max=Max.STEPS, help="Adaptation updates for this arm (default: the run's; "
                              "recorded in config.json)."),
    # the shared options' help names `oal run`'s defaults; here each one left out keeps the run's own setting
    batch_size: Annotated[int, typer.Option(min=1, max=Max.BATCH, help="Adaptation blocks per process and micro-"
                                            "batch (default: the run's).")] = None,
    grad_accum: Annotated[int, typer.Option(min=1, max=Max.BATCH, help="Micro-batches accumulated per update "
                                            "(default: the run's).")] = None,
    lora_dropout: Annotated[float, typer.Option(min=0.0, max=0.99, help="LoRA dropout (default: the run's).")] = None,
    window: Annotated[int, typer.Option(min=1, max=Max.WINDOW, help="Sliding window W of the window methods "
                                        "(default: the run's; another one reruns their calibration).")] = None,
    sinks: Annotated[int, typer.Option(min=0, max=Max.WINDOW, help="Attention sinks S of the window methods "
                                       "(default: the run's; another number reruns their calibration).")] = None,
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
