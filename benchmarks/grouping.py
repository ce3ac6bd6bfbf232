"""Benchmark: App. B stable-gap bootstrap grouping for every head of a 24-layer x 14-head model.

Shape of Qwen2.5-0.5B: d = 64, P = 40 calibration prompts, B = 1000 bootstrap replicates, synthetic heavy-tailed
contribution profiles. Compares the vectorised batch call (all 336 heads at once), a per-head loop of the same
function, and the literal per-replicate reference loop (timed on a few heads and extrapolated, labelled so).
Writes `--out` (default benchmarks/results/grouping.json) and a PNG beside it, and prints a table.

    .venv/bin/python -m benchmarks.grouping [--reference-heads 2]
"""

# ruff: noqa: E402  (the arguments are parsed before the heavy imports)
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks._common import ToolParser, environment, int_in, output_file, run_tool

RESULTS = Path(__file__).resolve().parent / "results"
OUTPUTS = ("the JSON of the run (--out; default benchmarks/results/grouping.json) and a PNG beside it; the table on "
           "stdout")


def parse_args(argv=None) -> argparse.Namespace:
    ap = ToolParser(__doc__, OUTPUTS)
    ap.add_argument("--layers", type=int_in(1, 1024), default=24)
    ap.add_argument("--heads", type=int_in(1, 1024), default=14)
    ap.add_argument("--prompts", type=int_in(2, 10**5), default=40)
    ap.add_argument("--dim", type=int_in(2, 1024), default=64)
    ap.add_argument("--bootstrap", type=int_in(1, 10**6), default=1000)
    ap.add_argument("--reference-heads", type=int_in(1, 10**6), default=2, help="heads timed with the literal loop")
    ap.add_argument("--repeat", type=int_in(1, 100), default=3)
    ap.add_argument("--out", type=output_file, default=RESULTS / "grouping.json",
                    help="the JSON to write (the PNG goes beside it)")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import os
import platform
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from rich.console import Console
from rich.table import Table

from oal.analysis import stable_gap_groups, stable_gap_groups_reference
from oal.rundir.files import atomic_save_figure, atomic_write_json


def synthetic_profiles(layers: int, heads: int, prompts: int, d: int, seed: int = 0) -> torch.Tensor:
    """[L, H, P, d]: log-normal bulk plus 1-6 outlier dims per head, multiplicative per-prompt noise."""
    gen = torch.Generator().manual_seed(seed)
    base = torch.exp(0.3 * torch.randn(layers, heads, 1, d, generator=gen, dtype=torch.float64))
    n_out = torch.randint(1, 7, (layers, heads), generator=gen)
    for li in range(layers):
        for h in range(heads):
            dims = torch.randperm(d, generator=gen)[: n_out[li, h]]
            base[li, h, 0, dims] *= torch.exp(torch.rand(len(dims), generator=gen, dtype=torch.float64) * 3)
    noise = torch.exp(0.25 * torch.randn(layers, heads, prompts, d, generator=gen, dtype=torch.float64))
    return base * noise


def _time(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def main(args: argparse.Namespace) -> None:
    chi = synthetic_profiles(args.layers, args.heads, args.prompts, args.dim)
    n_heads = args.layers * args.heads
    flat = chi.reshape(n_heads, args.prompts, args.dim)
    kw = dict(n_bootstrap=args.bootstrap, seed=0)

    t_batch = _time(lambda: stable_gap_groups(chi, **kw), args.repeat)
    res = stable_gap_groups(chi, **kw)
    loop_heads = min(n_heads, 48)
    t_loop = _time(lambda: [stable_gap_groups(flat[i], **kw) for i in range(loop_heads)], 1) * n_heads / loop_heads
    ref_heads = min(args.reference_heads, n_heads)
    t0 = time.perf_counter()
    refs = [stable_gap_groups_reference(flat[i], **kw) for i in range(ref_heads)]
    t_ref = (time.perf_counter() - t0) * n_heads / ref_heads
    agree = all(torch.equal(refs[i]["groups"], res.groups.reshape(n_heads, -1)[i]) for i in range(ref_heads))

    hist = {int(v): int(c) for v, c in zip(*torch.unique(res.n_groups, return_counts=True), strict=True)}
    out = dict(
        shape=dict(layers=args.layers, heads=args.heads, prompts=args.prompts, d=args.dim, bootstrap=args.bootstrap),
        seconds=dict(batched=t_batch, per_head_loop_extrapolated=t_loop, literal_reference_extrapolated=t_ref),
        extrapolation=dict(per_head_loop_heads_timed=loop_heads, reference_heads_timed=ref_heads),
        speedup=dict(vs_per_head_loop=t_loop / t_batch, vs_reference=t_ref / t_batch),
        reference_agrees_on_timed_heads=agree,
        n_groups_histogram=hist,
        threads=torch.get_num_threads(),
        machine=dict(python=platform.python_version(), torch=torch.__version__, cpus=os.cpu_count()),
        environment=environment(),
    )
    atomic_write_json(args.out, out)

    labels = ["batched (all heads)", "per-head loop*", "literal reference*"]
    secs = [t_batch, t_loop, t_ref]
    fig, ax = plt.subplots(figsize=(6.5, 3.6), layout="constrained")
    bars = ax.bar(labels, secs, color=["#1f77b4", "#ff7f0e", "#7f7f7f"])
    for b, s in zip(bars, secs, strict=True):
        ax.annotate(f"{s:.2f} s", (b.get_x() + b.get_width() / 2, s), ha="center", va="bottom", fontsize=9)
    ax.set_yscale("log")
    ax.set_ylabel("seconds (log)")
    ax.set_title(f"Stable-gap grouping, {n_heads} heads, d={args.dim}, P={args.prompts}, B={args.bootstrap}\n"
                 "* extrapolated from a subset of heads", fontsize=10)
    atomic_save_figure(fig, args.out.with_suffix(".png"), dpi=110)

    table = Table(title=f"Stable-gap grouping: {n_heads} heads, d={args.dim}, P={args.prompts}, B={args.bootstrap}")
    for col in ("path", "seconds", "vs batched"):
        table.add_column(col, justify="right")
    for lab, s in zip(labels, secs, strict=True):
        table.add_row(lab, f"{s:.3f}", f"{s / t_batch:.1f}x")
    console = Console()
    console.print(table)
    console.print(f"* extrapolated; reference agrees on timed heads: {agree}; groups histogram: {hist}")


if __name__ == "__main__":
    run_tool(main, ARGS)
