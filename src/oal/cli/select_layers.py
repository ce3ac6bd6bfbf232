"""`oal select-layers`: calibrate every layer, rank by fidelity and by the one-layer swap probe, print the choice."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from oal.cli.app import app
from oal.cli.consoles import notes_console
from oal.cli.modes import refuse_run_options
from oal.cli.options import (
    BatchSizeOpt,
    DataOpt,
    DeviceOpt,
    DtypeOpt,
    GradAccumOpt,
    GroupingOpt,
    LoraDropoutOpt,
    Max,
    ProgressOpt,
    SinksOpt,
    StepsOpt,
    ThreadsOpt,
    ValEveryOpt,
    WindowOpt,
    set_threads,
)
from oal.errors import InputError, SelectionSizeError
from oal.pipeline.inputs import grouping_or_fail, layer_selection


@app.command("select-layers")
def select_layers_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Run directory (as for `oal run`; `oal run --layers auto:K` with the "
                             "same options continues it)."),
    k: int = typer.Option(..., "--k", min=1, max=Max.LAYERS, help="Number of layers to convert."),
    by: str = typer.Option("probe", help="Rank layers by 'fidelity' (frozen-attention RelMSE after W_o) or 'probe' "
                           "(validation perplexity with that layer alone converted)."),
    model: str = typer.Option(None, help="Model name or local path (default: the preset's; 'default' = embedded)."),
    data: DataOpt = None,
    data_dir: str = typer.Option(None, help="Local WikiText folder (manifest-checked) for the paper presets."),
    methods: str = typer.Option("oal,global,softmax", help="Comma-separated methods (calibrated on every layer)."),
    preset: str = typer.Option("default", help="default | smollm2-135m (a real LM, fetched offline; CPU budget) | "
                               "qwen2.5-0.5b | llama-3.2-1b (the paper's protocol)."),
    seed: int = typer.Option(42, min=0, max=Max.SEED, help="Seed."),
    # the calibration that the selection ranks is made with these
    grouping: GroupingOpt = "app-b", window: WindowOpt = None, sinks: SinksOpt = None,
    # only recorded in config.json, as `oal run` records them: `oal run` with the same options continues the run
    steps: StepsOpt = None, val_every: ValEveryOpt = None, batch_size: BatchSizeOpt = None,
    grad_accum: GradAccumOpt = None, lora_dropout: LoraDropoutOpt = None,
    force: bool = typer.Option(False, "--force", help="Replace a run of another configuration in OUT (another --k "
                               "or --by needs none: the calibration and scores are reused)."),
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
    threads: ThreadsOpt = 1,
    progress: ProgressOpt = True,
) -> None:
    """Calibrate every layer, rank the layers by frozen-attention RelMSE after W_o and by the swap probe (validation
    perplexity with that layer alone converted, no training), and write DIR/selection.json with the K best by
    --by and the perplexity curves. Beyond the paper, which fixes a middle range."""
    from oal.pipeline.config import RunConfig, parse_methods
    from oal.pipeline.runs import run_selection
    from oal.pipeline.selection import SELECTION_COLUMNS, selection_rows

    set_threads(threads)
    refuse_run_options(ctx, layers=f"auto:{k}", passkey=None, methods=methods, tasks="all")
    adapt = {name: v for name, v in (("steps", steps), ("val_every", val_every), ("batch_size", batch_size),
                                     ("grad_accum", grad_accum), ("lora_dropout", lora_dropout)) if v is not None}
    cfg = RunConfig.from_preset(preset, model=model, data=data, data_dir=data_dir, methods=parse_methods(methods),
                                **layer_selection(f"auto:{k}", by, "--by"), seed=seed, device=device, dtype=dtype,
                                adapt=adapt, grouping=grouping_or_fail(grouping), window=window, sinks=sinks)
    try:
        sel = run_selection(cfg, out, console=notes_console(), progress=progress, force=force)
    except SelectionSizeError as exc:  # the run words it as `--layers auto:K`; this command takes K as --k
        raise InputError(f"expected K <= {exc.limit} (the candidate layers), got {exc.k}", "--k") from None
    table = Table(title=f"layer selection: the {sel['k']} best by {sel['by']} -> {sel['chosen']} "
                        f"(paper range {sel['paper_layers']})")
    for col in SELECTION_COLUMNS:
        table.add_column(col, justify="right")
    for row in selection_rows(sel):
        table.add_row(*row)
    Console().print(table)
