"""`oal calibrate`: fit kernel coefficients per head by output matching into a run directory."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from oal.cli.app import app
from oal.cli.consoles import notes_console
from oal.cli.modes import refuse_unless
from oal.cli.options import (
    DataDirOpt,
    DataOpt,
    DeviceOpt,
    DtypeOpt,
    Max,
    ModelOpt,
    ProgressOpt,
    SinksOpt,
    WindowOpt,
    main_console,
)
from oal.errors import InputError, message_of
from oal.launch import process_device, ranks
from oal.pipeline.inputs import blocks_or_fail, load_model_or_fail, parse_layers


@app.command("calibrate")
def calibrate_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Directory holding groups.json (from `oal analyze`)."),
    model: ModelOpt = "default",
    data: DataOpt = "builtin",
    data_dir: DataDirOpt = None,
    layers: str = typer.Option(None, help="'3-20' or '1,4,7' (default: every layer in groups.json)."),
    methods: str = typer.Option("oal,global", help="Comma-separated trainable methods to calibrate."),
    preset: str = typer.Option(None, help="Split-plan preset (default: detected from the model)."),
    paper: bool = typer.Option(False, help="App. B budgets: 1000 updates, validation every 100, patience 400."),
    max_steps: int = typer.Option(None, min=1, max=Max.STEPS, help="Updates per start (default 200, --paper 1000)."),
    val_every: int = typer.Option(None, min=1, max=Max.STEPS, help="Updates per validation (default 25, --paper 100)."),
    patience: int = typer.Option(None, min=1, max=Max.STEPS, help="Early-stopping patience in updates (default 100, "
                                 "--paper 400)."),
    window: WindowOpt = 64,
    sinks: SinksOpt = 4,
    seed: int = typer.Option(0, min=0, max=Max.SEED,
                             help="Seed of the sampled sequences/positions and perturbed initialisations."),
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
    progress: ProgressOpt = True,
) -> None:
    """Fit kernel coefficients by output matching on frozen attention (paper Eq. 20, App. B); resumes per layer."""
    from oal.analysis import check_groups_model, load_groups
    from oal.calibration.data import CalibConfig
    from oal.calibration.resume import calibrate_directory
    from oal.methods import get_method, method_names
    from oal.methods.base import unknown_method
    from oal.models.registry import default_layers
    from oal.rundir.claim import refuse_run_dir
    from oal.rundir.files import check_out_dir
    from oal.rundir.lock import own_dir

    console = notes_console()  # under torchrun the processes share the layers out; the main one reports
    wanted = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in method_names()]
    if not wanted or unknown:
        raise typer.BadParameter(unknown_method(unknown[0], some=True) if unknown else "expected at least one method",
                                 param_hint="--methods")
    refuse_unless(ctx, any(get_method(m).settings for m in wanted), ("window", "sinks"),
                  "the sliding-window methods (swa, oal-swa, global-swa)")
    check_out_dir(out)
    refuse_run_dir(out, "calibration")
    # held from here: a second calibration into OUT would delete this one's capture files
    with own_dir(out, ranks(process_device(device))):
        grouped = [m for m in wanted if get_method(m).uses_groups]  # oal, oal-swa
        try:
            groups = load_groups(out) if grouped else {}
        except ValueError as exc:
            raise typer.BadParameter(f"{exc} (run `oal analyze --out {out}` first)", param_hint="--out") from None
        mdl, tok, prov = load_model_or_fail(model, device, dtype)
        if groups:  # groups of another model would calibrate nonsense
            try:
                check_groups_model(out, mdl, prov)
            except InputError:
                raise  # a record of this model in another dtype: the check names --dtype
            except ValueError as exc:  # another model's groups
                raise InputError(message_of(exc), "--model") from None
        layer_list = parse_layers(layers, mdl.config.num_hidden_layers) if layers is not None else (
            sorted(groups) if groups else default_layers(mdl))
        missing = [i for i in layer_list if grouped and i not in groups]
        if missing:
            raise typer.BadParameter(f"groups.json has no groups for layers {missing}", param_hint="--layers")
        overrides = {k: v for k, v in (("max_steps", max_steps), ("val_every", val_every), ("patience", patience))
                     if v is not None}
        cfg = CalibConfig.preset("paper" if paper else "default", seed=seed, **overrides)
        blocks, plan, preset = blocks_or_fail(tok, mdl, data, data_dir, preset)
        report = calibrate_directory(out, mdl, blocks, layer_list, wanted, groups=groups, cfg=cfg, seed=seed,
                                     base_model=model, provenance=prov, extra={"seed": seed, "preset": preset},
                                     progress=progress, console=console, options={"window": window, "sinks": sinks})
    table = Table(title="calibration: validation MSE (mean over heads)")
    for col in ("layer", *wanted):
        table.add_column(col, justify="right")
    for layer in layer_list:
        cells = []
        for m in wanted:
            heads = report[m][str(layer)]["heads"]
            cells.append(f"{sum(h['val_mse'] for h in heads) / len(heads):.4g}" if heads else "-")
        table.add_row(str(layer), *cells)
    main_console().print(table)
    console.print(f"wrote {out / 'kernels.safetensors'} and {out / 'calibration.json'}")
