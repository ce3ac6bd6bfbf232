"""`oal evaluate`: frozen-attention fidelity (Table 2) of a run's converted models, with --zeroshot the zero-shot
PIQA / HellaSwag / ARC-E accuracies (Table 3, App. F.3) of its arms, or with --passkey their passkey retrieval,
into DIR/metrics.json."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from oal.cli.app import app
from oal.cli.consoles import notes_console
from oal.cli.modes import decoder_run, refuse_other_modes
from oal.cli.options import (
    AdapterOpt,
    BaseModelOpt,
    DataDirOpt,
    DeviceOpt,
    LimitOpt,
    Max,
    ProgressOpt,
    RunDtypeOpt,
    TaskFileOpt,
    TasksOpt,
    ZeroshotDirOpt,
    parse_numbers,
)


@app.command("evaluate")
def evaluate_cmd(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", callback=decoder_run, help="Run directory with calibrated kernels."),
    model: BaseModelOpt = None,
    data: str = typer.Option(None, help="Corpus of the held-out fidelity blocks (default: the run's, or builtin)."),
    data_dir: DataDirOpt = None,
    methods: str = typer.Option(None, help="Comma-separated methods in DIR (default: the run's; fidelity: its "
                                "calibrated ones, or oal,global)."),
    preset: str = typer.Option(None, help="Split-plan preset (default: the run's plan, or detected from the model)."),
    blocks_limit: int = typer.Option(None, "--blocks", min=1, max=Max.COUNT, help="The first N fidelity blocks only."),
    zeroshot: bool = typer.Option(False, "--zeroshot", help="Zero-shot accuracies instead of fidelity, on each "
                                  "method's model (base + kernels + DIR/adapter/<method> unless --no-adapter)."),
    tasks: TasksOpt = "all",
    task_file: TaskFileOpt = None,
    zeroshot_dir: ZeroshotDirOpt = None,
    limit: LimitOpt = None,
    log_samples: bool = typer.Option(False, "--log-samples", help="--zeroshot: also write each example's per-"
                                     "candidate log-likelihoods to DIR/zeroshot_samples/<method>.json."),
    adapter: AdapterOpt = None,
    device: DeviceOpt = "auto",
    dtype: RunDtypeOpt = None,
    passkey: bool = typer.Option(False, "--passkey", help="Passkey retrieval instead of fidelity: greedy recall of a "
                                 "number hidden at several depths, for softmax and every method, before and after "
                                 "adaptation (--no-adapter / --adapter: one of the two only)."),
    lengths: str = typer.Option(None, help="--passkey: comma-separated context lengths in tokens (default: powers "
                                "of two from 1k to the model's maximum)."),
    depths: str = typer.Option(None, help="--passkey: comma-separated needle depths in [0, 1] (default: "
                               "0,0.25,0.5,0.75,1)."),
    trials: int = typer.Option(4, min=1, max=Max.TRIALS, help="--passkey: prompts (keys) per length and depth."),
    progress: ProgressOpt = True,
) -> None:
    """Frozen-attention fidelity (Table 2, App. C) on the plan's held-out blocks -> DIR/metrics.json (and report.md,
    in an `oal run` directory); with --zeroshot: PIQA / HellaSwag / ARC-E (App. F.3) -> metrics.json["zeroshot"];
    with --passkey: passkey retrieval accuracy by context length and depth -> metrics.json["passkey"].

    Calibrated kernels on the base model go to metrics.json["fidelity"]; a method with the run's adapter is measured
    as adapted (trained kernels against the softmax attention of the LoRA-merged weights) into ["fidelity_adapted"].
    """
    if zeroshot and passkey:
        raise typer.BadParameter("choose one of --zeroshot and --passkey (run `oal evaluate` once for each)",
                                 param_hint="--zeroshot / --passkey")
    wanted = None if methods is None else [m.strip() for m in methods.split(",") if m.strip()]
    console = notes_console()  # progress on stderr; the tables are the results (stdout)
    refuse_other_modes(ctx, "zeroshot" if zeroshot else "passkey" if passkey else "fidelity")
    if zeroshot and tasks.strip().lower() == "none":
        raise typer.BadParameter("'none' leaves nothing for --zeroshot to evaluate", param_hint="--tasks")
    if passkey:
        _passkey(out, model, wanted, parse_numbers(lengths, int, "--lengths", 16, Max.TOKENS),
                 parse_numbers(depths, float, "--depths", 0.0, 1.0), trials, adapter, device, dtype, console, progress)
        return
    if zeroshot:
        _zeroshot(out, model, wanted, tasks, task_file, zeroshot_dir, limit, adapter, device, dtype, console,
                  log_samples, progress)
        return
    from oal.pipeline.evaluate_fidelity import evaluate_fidelity, fidelity_table

    res = evaluate_fidelity(out, wanted, model=model, data=data, data_dir=data_dir, preset=preset,
                            blocks=blocks_limit, adapter=adapter, device=device, dtype=dtype, console=console,
                            progress=progress)
    Console().print(fidelity_table(res))


def _passkey(out: Path, model, methods, lengths, depths, trials, adapter, device, dtype, console, progress) -> None:
    from oal.device import resolve_dtype
    from oal.pipeline.evaluate_passkey import evaluate_passkey_run, passkey_rich_table
    from oal.pipeline.inputs import run_methods

    res = evaluate_passkey_run(out, run_methods(out, methods, ["softmax", "oal"]), model=model, lengths=lengths,
                               depths=depths, trials=trials, adapter=adapter, device=device,
                               dtype=resolve_dtype(dtype) if dtype else None, console=console, progress=progress)
    Console().print(passkey_rich_table(res))


def _zeroshot(out: Path, model, methods, tasks, task_file, zeroshot_dir, limit, adapter, device, dtype,
              console, log_samples: bool, progress: bool) -> None:
    from oal.data.zeroshot import parse_task_files
    from oal.device import resolve_dtype
    from oal.pipeline.evaluate_zeroshot import evaluate_zeroshot, zeroshot_table
    from oal.pipeline.inputs import run_methods

    scores = evaluate_zeroshot(out, run_methods(out, methods, ["oal"]), model=model, tasks=tasks,
                               task_files=parse_task_files(task_file), zeroshot_dir=zeroshot_dir, limit=limit,
                               adapter=adapter, device=device, dtype=resolve_dtype(dtype) if dtype else None,
                               console=console, log_samples=log_samples, progress=progress)
    if not scores:  # nothing to score: metrics.json records why the columns are missing; say so, and by the exit code
        console.print(f"no zero-shot task was scored: see {out / 'metrics.json'} (zeroshot_skipped)")
        raise typer.Exit(code=1)
    Console().print(zeroshot_table(scores))
