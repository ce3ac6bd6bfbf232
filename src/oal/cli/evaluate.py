"""`oal evaluate`: frozen-attention fidelity (Table 2) of a run's converted models, with --zeroshot the zero-shot
PIQA / HellaSwag / ARC-E accuracies (Table 3, App. F.3) of its arms, or with --passkey their passkey retrieval,
into DIR/metrics.json."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ._common import (
    AdapterOpt,
    BaseModelOpt,
    DataDirOpt,
    DeviceOpt,
    DtypeOpt,
    LimitOpt,
    TaskFileOpt,
    TasksOpt,
    ZeroshotDirOpt,
)
from .app import app


@app.command("evaluate")
def evaluate_cmd(
    out: Path = typer.Option(..., "--out", help="Run directory with calibrated kernels."),
    model: BaseModelOpt = None,
    data: str = typer.Option(None, help="Corpus of the held-out fidelity blocks (default: the run's, or builtin)."),
    data_dir: DataDirOpt = None,
    methods: str = typer.Option(None, help="Comma-separated methods in DIR (default: the run's; fidelity: its "
                                "calibrated ones, or oal,global)."),
    preset: str = typer.Option(None, help="Split-plan preset (default: the run's plan, or detected from the model)."),
    blocks_limit: int = typer.Option(None, "--blocks", min=1, help="Use only the first N fidelity blocks."),
    zeroshot: bool = typer.Option(False, "--zeroshot", help="Zero-shot accuracies instead of fidelity, on each "
                                  "method's model (base + kernels + DIR/adapter/<method> unless --no-adapter)."),
    tasks: TasksOpt = "all",
    task_file: TaskFileOpt = None,
    zeroshot_dir: ZeroshotDirOpt = None,
    limit: LimitOpt = None,
    adapter: AdapterOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = None,
    passkey: bool = typer.Option(False, "--passkey", help="Passkey retrieval instead of fidelity: greedy recall of a "
                                 "number hidden at several depths, for softmax and every method, before and after "
                                 "adaptation (--no-adapter / --adapter: one of the two only)."),
    lengths: str = typer.Option(None, help="--passkey: comma-separated context lengths in tokens (default: powers "
                                "of two from 1k to the model's maximum)."),
    depths: str = typer.Option(None, help="--passkey: comma-separated needle depths in [0, 1] (default: "
                               "0,0.25,0.5,0.75,1)."),
    trials: int = typer.Option(4, min=1, help="--passkey: prompts (keys) per length and depth."),
) -> None:
    """Frozen-attention fidelity (Table 2, App. C) on the plan's held-out blocks -> DIR/metrics.json (and report.md,
    in an `oal run` directory); with --zeroshot: PIQA / HellaSwag / ARC-E (App. F.3) -> metrics.json["zeroshot"];
    with --passkey: passkey retrieval accuracy by context length and depth -> metrics.json["passkey"].

    Calibrated kernels on the base model go to metrics.json["fidelity"]; a method with the run's adapter is measured
    as adapted (trained kernels against the softmax attention of the LoRA-merged weights) into ["fidelity_adapted"].
    """
    wanted = None if methods is None else [m.strip() for m in methods.split(",") if m.strip()]
    console = Console()
    if passkey:
        _passkey(out, model, wanted, _numbers(lengths, int, "--lengths"), _numbers(depths, float, "--depths"),
                 trials, adapter, device, dtype, console)
        return
    if zeroshot:
        _zeroshot(out, model, wanted, tasks, task_file, zeroshot_dir, limit, adapter, device, dtype, console)
        return
    from ..evaluate.run_fidelity import evaluate_fidelity

    res = evaluate_fidelity(out, wanted, model=model, data=data, data_dir=data_dir, preset=preset,
                            blocks=blocks_limit, adapter=adapter, device=device, dtype=dtype, console=console)
    table = Table(title="frozen-attention fidelity on the held-out blocks")
    for col in ("method", "kernels", "blocks", "MSE", "RelMSE", "MSE post-o", "RelMSE post-o"):
        table.add_column(col, justify="right")
    for key, kind in (("fidelity", "calibrated"), ("fidelity_adapted", "adapted")):
        for m, r in res[key].items():
            table.add_row(m, kind, f"{r['n_blocks']} x {r['block_len']}",
                          *(f"{r[k]:.4g}" for k in ("mse", "relmse", "mse_post_o", "relmse_post_o")))
    console.print(table)


def _numbers(text: str | None, kind, option: str) -> list | None:
    if text is None:
        return None
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated numbers, got {text!r}", param_hint=option) from None


def _run_methods(out: Path, methods, fallback: list[str]) -> list[str]:
    from ..runio import load_json

    if methods is not None:
        return methods
    config = out / "config.json"
    return (load_json(config).get("config", {}).get("methods") if config.is_file() else None) or fallback


def _passkey(out: Path, model, methods, lengths, depths, trials, adapter, device, dtype, console) -> None:
    from ..device import resolve_dtype
    from ..evaluate.passkey import passkey_table
    from ..evaluate.run_passkey import evaluate_passkey_run

    res = evaluate_passkey_run(out, _run_methods(out, methods, ["softmax", "oal"]), model=model, lengths=lengths,
                               depths=depths, trials=trials, adapter=adapter, device=device,
                               dtype=resolve_dtype(dtype) if dtype else None, console=console)
    _, header, rows = passkey_table(res)
    table = Table(title="passkey retrieval accuracy by context length (greedy, exact match)")
    for col in header:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    console.print(table)


def _zeroshot(out: Path, model, methods, tasks, task_file, zeroshot_dir, limit, adapter, device, dtype,
              console) -> None:
    from ..data.zeroshot import DISPLAY_NAMES, parse_task_files
    from ..device import resolve_dtype
    from ..evaluate.run_zeroshot import evaluate_zeroshot

    methods = _run_methods(out, methods, ["oal"])
    scores = evaluate_zeroshot(out, methods, model=model, tasks=tasks, task_files=parse_task_files(task_file),
                               zeroshot_dir=zeroshot_dir, limit=limit, adapter=adapter, device=device,
                               dtype=resolve_dtype(dtype) if dtype else None, console=console)
    if not scores:  # nothing to score: metrics.json records why the columns are missing; say so by the exit code
        raise typer.Exit(code=1)
    table = Table(title="zero-shot accuracy (%; acc_norm: the paper's normalisation)")
    for col in ("method", "task", "acc", "acc_norm", "acc_norm (lm-eval)", "n"):
        table.add_column(col, justify="right")
    for m, res in scores.items():
        for t, r in res.items():
            table.add_row(m, DISPLAY_NAMES[t], *(f"{r[k]:.2f}" for k in ("acc", "acc_norm", "acc_norm_lmeval")),
                          str(r["n"]))
    console.print(table)
