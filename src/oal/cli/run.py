"""`oal run`: the whole protocol (analyze -> calibrate -> convert -> adapt -> evaluate -> report), resumable."""

from __future__ import annotations

from pathlib import Path

import typer

from oal.cli.app import app
from oal.cli.consoles import notes_console
from oal.cli.modes import DECODER_ONLY, refuse_run_options, refuse_unless
from oal.cli.options import (
    BatchSizeOpt,
    DataOpt,
    DeviceOpt,
    DtypeOpt,
    GradAccumOpt,
    GroupingOpt,
    LimitOpt,
    LoraDropoutOpt,
    Max,
    ProgressOpt,
    SelectByOpt,
    SinksOpt,
    StepsOpt,
    TaskFileOpt,
    TasksOpt,
    ThreadsOpt,
    ValEveryOpt,
    WindowOpt,
    ZeroshotDirOpt,
    main_console,
    parse_numbers,
    set_threads,
)
from oal.pipeline.inputs import grouping_or_fail, layer_selection


@app.command()
def run(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Run directory (created; an existing one of the same configuration "
                             "is resumed, another configuration is refused)."),
    model: str = typer.Option(None, help="Model name or local path (default: the preset's; 'default' = embedded; "
                              "a local encoder folder runs the encoder protocol)."),
    data: DataOpt = None,
    data_dir: str = typer.Option(None, help="Local WikiText folder (manifest-checked) for the paper presets."),
    methods: str = typer.Option("oal,global,softmax", help="Comma-separated methods, or 'all' (every method that "
                                "applies: an encoder gets all but the causal sliding windows)."),
    preset: str = typer.Option("default", help="default | smollm2-135m (a real LM, fetched offline; CPU budget) | "
                               "qwen2.5-0.5b | llama-3.2-1b (the paper's protocol)."),
    seeds: str = typer.Option("42", help="Comma-separated seeds; several give mean ± sample std (more seeds "
                                         "than a multi-seed --out holds add the new ones)."),
    layers: str = typer.Option(None, help="Converted layers, e.g. 1-4 (default: the model family's range), or auto:K "
                               "to calibrate every layer and convert the K best (--select-by)."),
    select_by: SelectByOpt = "probe",
    steps: StepsOpt = None,
    val_every: ValEveryOpt = None,
    grouping: GroupingOpt = "app-b",
    window: WindowOpt = None,
    sinks: SinksOpt = None,
    batch_size: BatchSizeOpt = None,
    grad_accum: GradAccumOpt = None,
    lora_dropout: LoraDropoutOpt = None,
    tasks: TasksOpt = "all",
    limit: LimitOpt = None,
    zeroshot_dir: ZeroshotDirOpt = None,
    task_file: TaskFileOpt = None,
    force: bool = typer.Option(False, "--force", help="If OUT holds a run of another configuration (or layout), "
                               "delete its results and start clean."),
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
    threads: ThreadsOpt = 1,
    progress: ProgressOpt = True,
    passkey: str = typer.Option(None, help="After the run, passkey retrieval of every arm (adapted) at these "
                                "comma-separated lengths, e.g. 1024,2048,4096, into metrics.json and report.md."),
    passkey_depths: str = typer.Option(None, help="--passkey: needle depths in [0, 1] (default: 0,0.25,0.5,0.75,1)."),
    passkey_trials: int = typer.Option(4, min=1, max=Max.TRIALS, help="--passkey: keys per length and depth."),
) -> None:
    """Analyze -> group -> calibrate -> convert -> adapt -> evaluate (perplexity, zero-shot) -> report, writing the run
    directory. Zero-shot tasks whose data is neither local nor reachable are skipped with one line. With --model
    PATH to a local BERT-family encoder (BERT, RoBERTa, XLM-R, CamemBERT, ELECTRA), the encoder protocol runs
    instead: non-causal analysis and calibration on padded passages, fidelity and pooled-embedding cosine against
    the original; no adaptation, perplexity or zero-shot. Under torchrun / accelerate launch,
    calibration and adaptation run on every process (docs/guides/distributed.md).
    """
    from oal.data.zeroshot import parse_task_files
    from oal.launch import launched
    from oal.models.encoder import is_encoder_model
    from oal.pipeline.config import RunConfig, parse_methods, parse_seeds
    from oal.pipeline.runs import run as run_pipeline

    set_threads(threads)
    refuse_run_options(ctx, layers=layers, passkey=passkey, methods=methods, tasks=tasks)
    lengths = parse_numbers(passkey, int, "--passkey", 16, Max.TOKENS)
    depths = parse_numbers(passkey_depths, float, "--passkey-depths", 0.0, 1.0)
    procedure = grouping_or_fail(grouping)
    seed_list = parse_seeds(seeds)
    adapt = {k: v for k, v in (("steps", steps), ("val_every", val_every), ("batch_size", batch_size),
                               ("grad_accum", grad_accum), ("lora_dropout", lora_dropout)) if v is not None}
    cfg = RunConfig.from_preset(preset, model=model, data=data, data_dir=data_dir, methods=parse_methods(methods),
                                **layer_selection(layers, select_by), seed=seed_list[0],
                                device=device, dtype=dtype, adapt=adapt, zeroshot_tasks=tasks, zeroshot_limit=limit,
                                zeroshot_dir=zeroshot_dir, zeroshot_files=parse_task_files(task_file),
                                grouping=procedure, window=window, sinks=sinks)
    if lengths and (len(seed_list) > 1 or launched()):  # before the run, not after it (one process, one seed)
        where = f"{out}/seed-<s>" if len(seed_list) > 1 else str(out)
        raise typer.BadParameter("one seed, in one process: after the run, measure it with `oal evaluate --passkey "
                                 f"--out {where}` (without a launch)", param_hint="--passkey")
    refuse_unless(ctx, not is_encoder_model(cfg.model), DECODER_ONLY, "a causal LM's run, not an encoder's")
    from oal.pipeline.evaluate_passkey import passkey_after_run, passkey_check, passkey_rich_table
    run_pipeline(cfg, out, seed_list, console=notes_console(), results=main_console(), progress=progress, force=force,
                 check=passkey_check(lengths, depths, passkey_trials) if lengths else None)  # lengths before the run
    if lengths:
        res = passkey_after_run(out, cfg.methods, lengths=lengths, depths=depths, trials=passkey_trials,
                                device=cfg.device, console=notes_console())
        main_console().print(passkey_rich_table(res))
