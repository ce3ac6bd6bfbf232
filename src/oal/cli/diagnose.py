"""`oal diagnose`: Table 1 (retained-error ratio + controls), Fig. 2(b) (group budget), Table 2 (all methods) and the
planted per-query offset experiment."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from oal.cli.app import app
from oal.cli.consoles import notes_console
from oal.cli.diagnose_parts import budget_head as pick_head
from oal.cli.diagnose_parts import refuse_unread
from oal.cli.options import DataDirOpt, DataOpt, DeviceOpt, DtypeOpt, Max, ModelOpt, comma_names
from oal.pipeline.inputs import load_model_or_fail, parse_layers, registry_preset


@app.command("diagnose")
def diagnose_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Output or `oal run` directory (then its corpus, split plan, layers, "
                             "and for calibration (Table 2, Fig. 2(b), offset part) its settings and seed are used, "
                             "unless --paper / --seed). Writes diagnostics/, figures/ and metrics.json['fidelity'] "
                             "outside run directories."),
    model: ModelOpt = "default",
    data: DataOpt = "builtin",
    data_dir: DataDirOpt = None,
    layers: str = typer.Option(None, help="'all', '3-20' or '1,4,7'. Default: Qwen2.5-0.5B's 4, 12, 20 (the paper's "
                               "Tables 1-2); else a run's layers or the preset's conversion layers."),
    preset: str = typer.Option(None, help="Data/grouping preset (default: detected from the model)."),
    parts: str = typer.Option("table1,budget,table2", help="Comma list of: table1, budget, table2, offset."),
    methods: str = typer.Option("all", help="Table 2 methods: 'all' or a comma list."),
    controls: int = typer.Option(None, min=0, max=Max.COUNT, help="Table 1's random subsets B (default 100)."),
    paper: bool = typer.Option(False, help="Paper settings: B = 1000 controls, App. B calibration protocol."),
    sequences: int = typer.Option(None, min=1, max=Max.COUNT, help="Held-out sequences for Table 1 and the offset "
                                  "part (default: all fidelity blocks)."),
    head: str = typer.Option(None, help="Fig. 2(b) head 'LAYER:HEAD' (default: the paper's, Qwen2.5-0.5B's 4:0; "
                             "else the first layer's head 0)."),
    max_budget: int = typer.Option(16, min=1, max=Max.DIM, help="Largest group budget G for Fig. 2(b), at most the "
                                   "head dim."),
    layer: int = typer.Option(None, min=0, max=Max.LAYERS, help="Offset part: the layer (default: the run's "
                              "representative layer)."),
    offsets: str = typer.Option("0,1,2,3,6", help="Offset part: planted per-query offset stds in logits, at most 1000 "
                                 "(with 0)."),
    steps: int = typer.Option(None, min=1, max=Max.STEPS, help="Offset part: calibration updates per start "
                              "(default: the run's, else the preset's)."),
    seed: int = typer.Option(None, min=0, max=Max.SEED, help="Seed of query positions, controls, Gaussian draws "
                             "and calibration (default 0; calibration on a run directory: the run's; the offset part: "
                             "the run's, 42 without a run directory)."),
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
) -> None:
    """Write the paper's diagnostics for a model into a directory (resumable per part). On the embedded model with the
    defaults, on 2 quiet CPU cores: table1 about 6 minutes (its bar counts every subset evaluated; --controls and
    --sequences shrink it), the offset part about half a minute, every offset size included."""
    from oal.calibration.data import CalibConfig
    from oal.data import default_plan, load_corpus, plan_blocks
    from oal.diagnostics.fidelity_table import TABLE2_METHODS
    from oal.diagnostics.offset_part import OffsetSettings, parse_stds
    from oal.diagnostics.retained_error import RetainedErrorConfig
    from oal.diagnostics.run_inputs import read_run, run_blocks
    from oal.diagnostics.runner import PARTS, check_outputs, diagnose
    from oal.models.registry import PRESETS, default_layers, representative_head, table_layers
    from oal.pipeline.config import RunConfig
    from oal.rundir.files import check_out_dir
    from oal.rundir.lock import own_dir

    console = notes_console()  # progress and notes on stderr; the tables are the results (stdout)
    check_out_dir(out)
    part_list = comma_names(parts, PARTS, "--parts")
    check_outputs(out, part_list)  # before the model loads (and minutes of work), not when a part writes
    method_list = list(TABLE2_METHODS) if methods.strip().lower() == "all" else comma_names(methods, TABLE2_METHODS,
                                                                                       "--methods")
    stds = parse_stds(offsets)
    run = read_run(out)
    refuse_unread(ctx, part_list, run is not None)  # before the model loads
    if run is not None and run["model"] != model:
        raise typer.BadParameter(f"{out} is an `oal run` directory of model {run['model']!r}; pass that model",
                                 param_hint="--model")
    mdl, tok, _prov = load_model_or_fail(model, device, dtype)
    preset = registry_preset(preset or (run or {}).get("preset"), mdl)  # a run's own: its grouping and plan
    spec = PRESETS[preset]
    n_layers = mdl.config.num_hidden_layers
    if layer is not None and layer >= n_layers:  # before the blocks are built
        raise typer.BadParameter(f"expected a layer in [0, {n_layers}), got {layer}", param_hint="--layer")
    layer_list = (parse_layers(layers, n_layers) if layers is not None else table_layers(preset, range(n_layers))
                  or (run["layers"] if run and run["layers"] else default_layers(mdl)))  # Qwen: the paper's 4, 12, 20
    budget_head = pick_head(head, layer_list, mdl.config.num_attention_heads, representative_head(preset, layer_list))
    try:
        blocks = (run_blocks(run, tok) if run else
                  plan_blocks(load_corpus(data, data_dir=data_dir), tok, default_plan(spec["plan"]), data_dir=data_dir))
    except (RuntimeError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--data") from None
    t1 = RetainedErrorConfig.preset("paper" if paper else "default", seed=seed or 0,
                                    **({} if controls is None else {"n_controls": controls}))
    ref = RunConfig.from_preset(preset, calib=run["calib"], grouping=run["grouping"], seed=run["seed"]) if run \
        else RunConfig.from_preset(preset)  # what `oal run` grouped and calibrated (or would) with
    grouping = {k: v for k, v in ref.grouping.items() if k not in ("budget", "pairs")}  # App. B's settings
    o_seed = ref.seed if seed is None else seed
    calib = (CalibConfig(**{**ref.calib, "seed": o_seed}) if run and not paper  # Table 2's OAL = the run's kernels
             else CalibConfig.preset("paper" if paper else "default", seed=seed or 0))
    o_cfg = CalibConfig(**{**ref.calib, "seed": o_seed, **({"max_steps": steps} if steps else {})})
    offset = OffsetSettings(cfg=o_cfg, grouping=ref.grouping, seed=o_seed, layer=layer, stds=stds,
                            sequences=sequences)
    console.print(f"diagnose: model {model}, layers {layer_list}, parts {part_list}"
                  + (f", B = {t1.n_controls} matched controls" if "table1" in part_list else ""))
    with own_dir(out):  # not while `oal run` / `oal adapt` writes this run (its report would mix the two)
        diagnose(mdl, blocks, layer_list, out, parts=part_list, table2_methods=method_list, grouping=grouping,
                 table1_cfg=t1, calib_cfg=calib, budget_head=budget_head, budgets=tuple(range(1, max_budget + 1)),
                 table1_sequences=sequences, seed=seed or 0, offset=offset, console=console, tables=Console(),
                 model_name=model, method_options=(run or {}).get("options"))
        if run is not None and (out / "metrics.json").is_file():  # the run's report shows the new diagnostics
            from oal.pipeline.report import write_report

            write_report(out, console=console)
    console.print(f"[green]wrote {out / 'diagnostics'}")
