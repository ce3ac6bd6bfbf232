"""`oal diagnose`: Table 1 (retained-error ratio + controls), Fig. 2(b) (group budget), Table 2 (all methods)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from oal.cli.app import app
from oal.cli.options import DataDirOpt, DataOpt, DeviceOpt, DtypeOpt, LayersOpt, ModelOpt
from oal.pipeline.inputs import load_model_or_fail, registry_preset


@app.command("diagnose")
def diagnose_cmd(
    out: Path = typer.Option(..., "--out", help="Run directory (reads groups.json if present; writes "
                             "diagnostics/, figures/group_budget.png, metrics.json['fidelity'])."),
    model: ModelOpt = "default",
    data: DataOpt = "builtin",
    data_dir: DataDirOpt = None,
    layers: LayersOpt = None,
    preset: str = typer.Option(None, help="Data/grouping preset (default: detected from the model)."),
    parts: str = typer.Option("table1,budget,table2", help="Comma list of: table1, budget, table2."),
    methods: str = typer.Option("all", help="Table 2 methods: 'all' or a comma list."),
    controls: int = typer.Option(None, help="Matched random subsets B for Table 1 (default 100; paper 1000)."),
    paper: bool = typer.Option(False, help="Paper settings: B = 1000 controls, App. B calibration protocol."),
    sequences: int = typer.Option(None, min=1, help="Held-out sequences for Table 1 (default: all fidelity "
                                  "blocks)."),
    head: str = typer.Option(None, help="Fig. 2(b) head 'LAYER:HEAD' (default: first layer, head 0)."),
    max_budget: int = typer.Option(16, help="Largest group budget G for Fig. 2(b)."),
    seed: int = typer.Option(0, help="Seed of query positions, controls, Gaussian draws and calibration."),
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
) -> None:
    """Write the paper's diagnostics for a model into a run directory (resumable per part)."""
    from oal.calibration.data import CalibConfig
    from oal.data import default_plan, load_corpus, plan_blocks
    from oal.diagnostics.fidelity_table import TABLE2_METHODS
    from oal.diagnostics.retained_error import RetainedErrorConfig
    from oal.diagnostics.runner import PARTS, diagnose
    from oal.models.registry import PRESETS, default_layers
    from oal.pipeline.inputs import parse_layers
    from oal.rundir.files import check_out_dir

    console = Console()
    check_out_dir(out)
    part_list = [p.strip() for p in parts.split(",") if p.strip()]
    if not part_list or set(part_list) - set(PARTS):
        raise typer.BadParameter(f"expected a comma list of {', '.join(PARTS)}, got {parts!r}", param_hint="--parts")
    if methods.strip().lower() == "all":
        method_list = list(TABLE2_METHODS)
    else:
        method_list = [m.strip() for m in methods.split(",") if m.strip()]
        unknown = set(method_list) - set(TABLE2_METHODS)
        if not method_list or unknown:
            raise typer.BadParameter(f"expected 'all' or names from {', '.join(TABLE2_METHODS)}, got {methods!r}",
                                     param_hint="--methods")
    if controls is not None and controls < 0:
        raise typer.BadParameter(f"expected >= 0, got {controls}", param_hint="--controls")
    if max_budget < 1:
        raise typer.BadParameter(f"expected >= 1, got {max_budget}", param_hint="--max-budget")
    mdl, tok, _prov = load_model_or_fail(model, device, dtype)
    preset = registry_preset(preset, mdl)
    spec = PRESETS[preset]
    layer_list = parse_layers(layers, mdl.config.num_hidden_layers) if layers is not None else default_layers(mdl)
    budget_head = None
    if head:
        try:
            budget_head = tuple(int(x) for x in head.split(":"))
            assert len(budget_head) == 2 and budget_head[0] in layer_list
            assert 0 <= budget_head[1] < mdl.config.num_attention_heads
        except (ValueError, AssertionError):
            raise typer.BadParameter(f"expected 'LAYER:HEAD' with LAYER in {layer_list}, got {head!r}",
                                     param_hint="--head") from None
    try:
        corpus = load_corpus(data, data_dir=data_dir)
        blocks = plan_blocks(corpus, tok, default_plan(spec["plan"]), data_dir=data_dir)
    except (ValueError, RuntimeError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--data") from None
    t1 = RetainedErrorConfig.preset("paper" if paper else "default", seed=seed)
    if controls is not None:
        t1.n_controls = controls
    calib = CalibConfig.preset("paper" if paper else "default", seed=seed)
    grouping = dict(tail_fraction=spec["alpha"], min_support=spec["gamma"], min_ratio=spec["tau"],
                    min_groups=spec["min_groups"], n_bootstrap=spec["n_bootstrap"])
    console.print(f"diagnose: model {model}, layers {layer_list}, parts {part_list}, "
                  f"B = {t1.n_controls} matched controls")
    diagnose(mdl, blocks, layer_list, out, parts=part_list, table2_methods=method_list, grouping=grouping,
             table1_cfg=t1, calib_cfg=calib, budget_head=budget_head, budgets=tuple(range(1, max_budget + 1)),
             table1_sequences=sequences, seed=seed, console=console)
    console.print(f"[green]wrote {out / 'diagnostics'}")
