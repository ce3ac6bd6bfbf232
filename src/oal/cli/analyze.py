"""`oal analyze`: contribution scores, stable-gap groups and the App. A diagnostics for a model's layers."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from oal.cli.app import app
from oal.cli.consoles import notes_console
from oal.cli.options import DataDirOpt, DataOpt, DeviceOpt, DtypeOpt, GroupingOpt, LayersOpt, Max, ModelOpt, ProgressOpt
from oal.pipeline.inputs import load_model_or_fail, parse_layers, registry_preset


@app.command("analyze")
def analyze_cmd(
    out: Path = typer.Option(..., "--out", help="Output directory (groups.json, analysis.json, figures/)."),
    model: ModelOpt = "default",
    data: DataOpt = "builtin",
    data_dir: DataDirOpt = None,
    layers: LayersOpt = None,
    preset: str = typer.Option(None, help="Grouping/data preset (default: detected from the model)."),
    tail_fraction: float = typer.Option(None, help="alpha, candidate tail fraction (default: preset)."),
    min_support: float = typer.Option(None, help="gamma, minimum bootstrap support (default: preset)."),
    min_ratio: float = typer.Option(None, help="tau, minimum gap ratio (default: preset)."),
    min_groups: int = typer.Option(None, min=1, max=Max.DIM, help="G_min, minimum groups per head (default: preset)."),
    n_bootstrap: int = typer.Option(None, min=1, max=Max.COUNT, help="B, bootstrap replicates (default: preset)."),
    grouping: GroupingOpt = "app-b",
    seed: int = typer.Option(0, min=0, max=Max.SEED, help="Seed of the bootstrap and the Gaussian controls."),
    head: str = typer.Option(None, help="Representative head 'LAYER:HEAD' for single-head figures (default: the "
                             "paper's, Qwen2.5-0.5B's 4:0; else the first layer's head 0)."),
    heldout: int = typer.Option(40, min=0, max=Max.COUNT,
                                help="Held-out prompts (validation split) for the stability check; "
                                "0 skips."),
    long_len: int = typer.Option(None, min=1, max=Max.TOKENS,
                                 help="Tokens of the sequence for the length-stability table "
                                 "(Table 4)."),
    batch_size: int = typer.Option(8, min=1, max=Max.BATCH, help="Prompts per forward pass."),
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
    figures: bool = typer.Option(True, help="Write figures."),
    progress: ProgressOpt = True,
) -> None:
    """Find each head's high-contribution dimensions and group them (paper Sec. 3, 4.2, App. A, B)."""
    from oal.analysis import analyze, parse_grouping
    from oal.analysis.inputs import analysis_inputs
    from oal.data import default_plan, load_corpus
    from oal.models.registry import PRESETS, default_layers, representative_head
    from oal.pipeline.config import grouping_preset
    from oal.rundir.claim import refuse_run_dir
    from oal.rundir.files import check_out_dir
    from oal.rundir.lock import own_dir

    console = notes_console()  # progress and notes on stderr; the summary table is the result (stdout)
    results = Console(soft_wrap=True)  # redirected to a file: whole lines
    try:
        procedure = parse_grouping(grouping)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--grouping") from None
    check_out_dir(out)
    refuse_run_dir(out, "analysis")
    mdl, tok, provenance = load_model_or_fail(model, device, dtype)
    preset = registry_preset(preset, mdl)
    spec = PRESETS[preset]
    n_layers = mdl.config.num_hidden_layers
    layer_list = parse_layers(layers, n_layers) if layers is not None else default_layers(mdl)
    rep = representative_head(preset, layer_list)  # the paper's Fig. 2 head where the preset has one
    if head:
        parts = head.split(":")
        if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
            raise typer.BadParameter(f"expected 'LAYER:HEAD', got {head!r}", param_hint="--head")
        rep = (int(parts[0]), int(parts[1]))
    positions = getattr(mdl.config, "max_position_embeddings", None)
    if long_len is not None and positions is not None and long_len > positions:  # before any text is read
        raise typer.BadParameter(f"{long_len} tokens exceed the model's {positions} positions", param_hint="--long-len")
    try:
        corpus = load_corpus(data, data_dir=data_dir)
    except (ValueError, RuntimeError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--data") from None

    try:
        inputs = analysis_inputs(corpus, tok, default_plan(spec["plan"]), n_heldout=heldout, long_len=long_len,
                                 max_len=getattr(mdl.config, "max_position_embeddings", None), data_dir=data_dir)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--data") from None
    if heldout > 0 and inputs["heldout"] is None:
        console.print("[yellow]validation split too short for held-out prompts; stability check skipped")
    prompts = inputs["prompts"]
    kw = grouping_preset(preset)
    for key, val in (("tail_fraction", tail_fraction), ("min_support", min_support), ("min_ratio", min_ratio),
                     ("min_groups", min_groups), ("n_bootstrap", n_bootstrap)):
        if val is not None:
            kw[key] = val
    kw.update(procedure)
    meta = dict(model=model, provenance=provenance, preset=preset, data=inputs["meta"])
    console.print(f"[bold]oal analyze[/]: {provenance.get('architecture')} '{model}', layers {layer_list}, "
                  f"{prompts.shape[0]} prompts x {prompts.shape[1]} tokens, preset {preset} {kw}")
    with own_dir(out):  # two analyses into one folder would mix their groups.json and analysis.json
        summary = analyze(mdl, tok, prompts, layer_list, out, heldout=inputs["heldout"],
                          long_sequence=inputs["long_sequence"], seed=seed, representative=rep, progress=progress,
                          batch_size=batch_size, figures=figures, console=console, results=results, meta=meta, **kw)
    conc = summary["concentration"]["mean"]
    line = (f"top-5 share {100 * conc['real_top5']:.1f}% vs Gaussian {100 * conc['gaussian_top5']:.1f}% "
            f"(at real coords {100 * conc['gaussian_at_real_top5']:.1f}%)")
    if "stability_inputs" in summary:
        s = summary["stability_inputs"]
        line += f"; held-out Spearman {s['mean_spearman']:.3f}, top-5 overlap {s['mean_top5_overlap']:.2f}/5"
    results.print(line)
    wrote = [Path(out) / "groups.json", Path(out) / "analysis.json", *([Path(out) / "figures"] if figures else [])]
    console.print(f"wrote {', '.join(map(str, wrote[:-1]))} and {wrote[-1]}")
