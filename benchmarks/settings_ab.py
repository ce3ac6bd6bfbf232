"""Operator settings side by side on this machine: this machine's tuned choice against other machines' (issue 36),
or against another readout of bf16 queries at the tuned settings.

One process, the Qwen head shape (B=1, Hq=14, Hkv=2, d=dv=64, G=5), causal forward at one length. The settings are
timed in interleaved rounds (A, B, C, A, B, C, ...) so that drift in the machine's speed falls on all of them
alike, first quiet, then beside one busy competing process (`oal.ops.autotune.busy_process`). Reports the median
per setting and its ratio to the tuned choice. Writes `--out` (default benchmarks/results/settings_ab.json) and a PNG
beside it, and prints a table.

    python -m benchmarks.settings_ab --n 16384 --settings 64x2,pipeline 64x4,serial
    python -m benchmarks.settings_ab --n 16384 --dtype bfloat16 --readouts dots widened --quiet-only
"""

# ruff: noqa: E402  (the arguments are parsed before the heavy imports)
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks._common import (
    MAX_TOKENS,
    ToolParser,
    add_timing_args,
    check_timing_args,
    int_in,
    output_file,
    run_tool,
    settings_text,
)

RESULTS = Path(__file__).resolve().parent / "results"
# the fused kernel's bf16 readouts by name: (cpu_kernel.AMX, cpu_kernel.BF16_DOTS)
READOUTS = {"dots": (False, True), "widened": (False, False)}
OUTPUTS = ("the JSON of the run (--out; default benchmarks/results/settings_ab.json) and a PNG beside it; the table "
           "on stdout, the load averages on stderr")


def parse_args(argv=None) -> argparse.Namespace:
    parser = ToolParser(__doc__, OUTPUTS)
    parser.add_argument("--n", type=int_in(1, MAX_TOKENS), default=16384, help="sequence length")
    parser.add_argument("--settings", nargs="*", default=[], type=settings_text,
                        metavar="CHUNKxBLOCKS[,serial|pipeline[,kvN]]",
                        help="the other settings to time beside the tuned ones (e.g. another machine's choice)")
    parser.add_argument("--readouts", nargs="*", default=[], choices=tuple(READOUTS),
                        help="other readouts of the fused CPU kernel for bf16 queries, at the tuned settings: dots "
                             "(vector bf16 dot products, not the AMX tiles; OAL_CPU_AMX=0), widened (the fp32 "
                             "kernel)")
    parser.add_argument("--rounds", type=int_in(1, 1000), default=5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--quiet-only", action="store_true", help="skip the rounds beside a busy process")
    parser.add_argument("--out", type=output_file, default=RESULTS / "settings_ab.json")
    add_timing_args(parser)
    args = parser.parse_args(argv)
    check_timing_args(parser, args)
    if not args.settings and not args.readouts:
        parser.error("give --settings or --readouts (what to time beside the tuned settings)")
    return args


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import os
import statistics
import sys
import textwrap

import torch

from benchmarks import _common
from benchmarks._common import apply_timing_args, clock
from benchmarks.operator import _inputs, parse_settings


def _rounds(calls: dict, rounds: int) -> dict[str, list[float]]:
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t0 = clock()
            call()
            times[name].append(clock() - t0)
    return times


def run(n: int, others: list[str], rounds: int, dtype: torch.dtype, loaded: bool = True,
        readouts: tuple[str, ...] = ()) -> dict:
    """Median seconds of the tuned settings ("tuned": the cache, else the fixed defaults) and of each of `others`
    (benchmarks.operator --settings strings) and `readouts` (READOUTS, at the tuned settings: "tuned, dots"), quiet
    and, with `loaded`, beside one busy process."""
    from oal.ops import chunked, cpu_kernel, oal_attention, tuning
    from oal.ops.autotune import busy_process

    load_before = os.getloadavg()[0]
    q, k, v, groups, factor = _inputs(n, "cpu", dtype)
    tuned = chunked.current_settings(dtype)
    pinned = {"tuned": tuned} | {s: parse_settings(s) for s in others}
    flags = {name: (cpu_kernel.AMX, cpu_kernel.BF16_DOTS) for name in pinned}
    for r in readouts:
        pinned[f"tuned, {r}"], flags[f"tuned, {r}"] = tuned, READOUTS[r]

    def make(settings, readout):
        def call():
            kept = cpu_kernel.AMX, cpu_kernel.BF16_DOTS
            cpu_kernel.AMX, cpu_kernel.BF16_DOTS = readout
            try:
                with tuning.forced(settings), torch.no_grad():
                    oal_attention(q, k, v, groups, factor, backend="chunked")
            finally:
                cpu_kernel.AMX, cpu_kernel.BF16_DOTS = kept
        return call

    calls = {name: make(s, flags[name]) for name, s in pinned.items()}
    for call in calls.values():
        call()  # warm-up: each setting's scratch and workers
    result = {"quiet": _rounds(calls, rounds)}
    if loaded:
        with busy_process():
            result["loaded"] = _rounds(calls, rounds)
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "rounds": rounds, "threads": torch.get_num_threads(),
            "clock": _common.CLOCK_NAME, "load_before": load_before, "load_after": os.getloadavg()[0],
            "settings": {name: s.label() for name, s in pinned.items()}, "readout": cpu_kernel.describe(),
            "source": tuning.source(dtype), "times": result, "cpu": tuning.cpu_info(), "torch": torch.__version__,
            "environment": _common.environment(),
            "median": {cond: {name: statistics.median(ts) for name, ts in times.items()}
                       for cond, times in result.items()}}


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._common import finish_figure

    # tuned first, then by name: the order of the JSON read back (key-sorted), whose figure this is
    names = sorted(res["settings"], key=lambda nm: (nm != "tuned", nm))
    conds = sorted(res["median"], key=lambda c: c != "quiet")
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / len(conds)
    for i, cond in enumerate(conds):
        med = res["median"][cond]
        ax.bar([j + i * width for j in range(len(names))], [med[nm] for nm in names], width, label=cond)
    ax.set_xticks([j + width * (len(res["median"]) - 1) / 2 for j in range(len(names))],
                  [f"{nm}\n" + textwrap.fill(res["settings"][nm], 26) for nm in names], fontsize=7)
    ax.set(ylabel=f"median seconds ({res['rounds']} interleaved rounds)")
    finish_figure(fig, [ax], f"OAL causal forward, N={res['n']}, {res['dtype']}, {res['cpu']['model']}, "
                             f"{res['threads']} threads", path)


def main(args: argparse.Namespace) -> None:
    apply_timing_args(None, args)
    res = run(args.n, args.settings, args.rounds, getattr(torch, args.dtype), loaded=not args.quiet_only,
              readouts=tuple(args.readouts))

    from rich.console import Console
    from rich.table import Table

    from oal.rundir.files import atomic_write_json

    table = Table(title=f"OAL settings side by side, N={args.n}, {args.dtype}, {res['cpu']['model']}, "
                        f"{res['threads']} threads, {res['clock']} clock, median of {args.rounds} interleaved rounds")
    for col in ("settings", "", *(f"{c} (s)" for c in res["median"]), *(f"{c} / tuned" for c in res["median"])):
        table.add_column(col, justify="right")
    for name, label in res["settings"].items():
        med = {c: m[name] for c, m in res["median"].items()}
        table.add_row(name, label, *(f"{t:.3f}" for t in med.values()),
                      *(f"{med[c] / res['median'][c]['tuned']:.2f}" for c in med))
    Console(width=160).print(table)
    print(f"tuned: this machine's {res['source']} settings; load average (1 min) {res['load_before']:.1f} before, "
          f"{res['load_after']:.1f} after (quiet means near 0 before)", file=sys.stderr)
    atomic_write_json(args.out, res)
    png = args.out.with_suffix(".png")
    _plot(res, png)
    print(f"wrote {args.out} and {png}", file=sys.stderr)


if __name__ == "__main__":
    run_tool(main, ARGS)
