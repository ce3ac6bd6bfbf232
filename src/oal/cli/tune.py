"""`oal tune-cpu`: measure the chunked CPU operator's settings on this machine and cache them (`oal.ops.tuning`)."""

from __future__ import annotations

import typer

from oal.cli.app import app
from oal.cli.consoles import notes_console
from oal.cli.options import Max


@app.command("tune-cpu")
def tune_cpu(
    dtypes: str = typer.Option("float32,bfloat16", help="Comma-separated dtypes to tune: float32, bfloat16."),
    threads: int = typer.Option(None, min=1, max=Max.THREADS,
                                help="Torch threads to tune for (default: torch's own choice)."),
    length: int = typer.Option(8192, min=256, max=Max.TOKENS, help="Sequence length timed."),
    repeats: int = typer.Option(2, min=1, max=Max.REPEATS, help="Calls per candidate (the best counts)."),
    force: bool = typer.Option(False, help="Measure again even when cached for this torch version."),
    quiet_only: bool = typer.Option(False, help="Choose by quiet time alone: do not time the serial winner and "
                                    "the best pipelined layout again beside a busy process."),
) -> None:
    """Build the fused CPU kernel for this machine (about two seconds, once), then time a pruned grid of chunk size,
    block length and worker layout and cache the best per CPU, threads and dtype (under a minute per dtype on 2
    quiet cores). Where torch's own threads win quiet, the winner and the best pipelined layout are timed again
    beside one busy process and the smaller mean of both times is kept. The operator reads the cache;
    OAL_NO_TUNE=1 ignores it."""
    import torch

    from oal.ops import autotune, cpu_kernel, tuning

    names = [d.strip() for d in dtypes.split(",") if d.strip()]
    bad = [d for d in names if d not in ("float32", "bfloat16")]
    if bad or not names:
        raise typer.BadParameter(f"expected float32 and/or bfloat16, got {dtypes!r}", param_hint="--dtypes")
    from oal.rundir.user_cache import probe_writable

    probe_writable(tuning.cache_path().parent, "the tuning entries")  # before minutes of timing, not after
    # progress on stderr, the chosen settings on stdout; describe() builds the kernel first (about two seconds), so
    # no timing includes that
    notes = notes_console()  # stderr, silent under `oal --quiet`
    notes.print(cpu_kernel.describe(), markup=False, highlight=False)
    res = autotune.tune([getattr(torch, d) for d in names], threads, length, repeats, force,
                        log=lambda line: notes.print(line, markup=False, highlight=False), contention=not quiet_only)
    for name, entry in res.items():
        default = entry.get("default_time_s") or float("nan")
        how = (f"cached, measured {entry.get('when', '?')}; --force measures again" if entry.get("cached")
               else f"tuning took {entry['tuning_s']:.0f} s")
        typer.echo(f"{name}: {tuning.Settings(**entry['settings']).label()}: {entry['time_s']:.3f} s at "
                   f"N={entry['n']} (fixed defaults {default:.3f} s; {how})")
    typer.echo(f"cache: {tuning.cache_path()}")
