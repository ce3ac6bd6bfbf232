"""Benchmark: App. B stable-gap bootstrap grouping for every head of a 24-layer x 14-head model.

Shape of Qwen2.5-0.5B: d = 64, P = 40 calibration prompts, B = 1000 bootstrap replicates, synthetic heavy-tailed
contribution profiles. Compares the vectorised batch call (all 336 heads at once), a per-head loop of the same
function, and the literal per-replicate reference loop (timed on a few heads and extrapolated, labelled so).
Writes benchmarks/results/grouping.json and grouping.png and prints a table.

    .venv/bin/python -P benchmarks/grouping.py [--reference-heads 2]

(-P keeps benchmarks/ off sys.path, so a benchmark file named like a stdlib module cannot shadow it.)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from oal.analysis import stable_gap_groups, stable_gap_groups_reference  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--bootstrap", type=int, default=1000)
    ap.add_argument("--reference-heads", type=int, default=2, help="heads timed with the literal loop")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()

    chi = synthetic_profiles(args.layers, args.heads, args.prompts, args.dim)
    n_heads = args.layers * args.heads
    flat = chi.reshape(n_heads, args.prompts, args.dim)
    kw = dict(n_bootstrap=args.bootstrap, seed=0)

    t_batch = _time(lambda: stable_gap_groups(chi, **kw), args.repeat)
    res = stable_gap_groups(chi, **kw)
    loop_heads = min(n_heads, 48)
    t_loop = _time(lambda: [stable_gap_groups(flat[i], **kw) for i in range(loop_heads)], 1) * n_heads / loop_heads
    ref_heads = max(1, args.reference_heads)
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
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    tmp = RESULTS / ".grouping.json.tmp"
    tmp.write_text(json.dumps(out, indent=1))
    os.replace(tmp, RESULTS / "grouping.json")

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
    tmp_png = RESULTS / ".grouping.png.tmp"
    fig.savefig(tmp_png, format="png", dpi=110)
    plt.close(fig)
    os.replace(tmp_png, RESULTS / "grouping.png")

    table = Table(title=f"Stable-gap grouping: {n_heads} heads, d={args.dim}, P={args.prompts}, B={args.bootstrap}")
    for col in ("path", "seconds", "vs batched"):
        table.add_column(col, justify="right")
    for lab, s in zip(labels, secs, strict=True):
        table.add_row(lab, f"{s:.3f}", f"{s / t_batch:.1f}x")
    console = Console()
    console.print(table)
    console.print(f"* extrapolated; reference agrees on timed heads: {agree}; groups histogram: {hist}")


if __name__ == "__main__":
    main()
