"""Benchmark: batched calibration (all heads x all initialisations in one program) vs the per-head sequential loop.

Best of `--repeats` interleaved runs (the CPU is shared). One layer of Qwen2.5-0.5B's attention shape
(Hq = 14, Hkv = 2, d = 64), synthetic frozen q/k/v with a few
outlier dimensions and their exact softmax outputs as targets, groups with 2-4 groups per head. Both paths run the
same protocol (global: 3 inits, then OAL: 3 inits; App. B) with the same seed and budgets; the table reports the
wall time of each, the speedup, and whether they select the same initialisation with the same validation MSE.
Writes `--out` (default benchmarks/results/calibration.json) and a PNG beside it, and prints a table.

    .venv/bin/python -m benchmarks.calibration [--steps 100 --tokens 256 --heads 14]
"""

# ruff: noqa: E402  (the arguments are parsed before the heavy imports)
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks._common import ToolParser, environment, int_in, output_file, run_tool

RESULTS = Path(__file__).resolve().parent / "results"
OUTPUTS = ("the JSON of the run (--out; default benchmarks/results/calibration.json) and a PNG beside it; the table "
           "on stdout")


def parse_args(argv=None) -> argparse.Namespace:
    ap = ToolParser(__doc__, OUTPUTS)
    ap.add_argument("--heads", type=int_in(1, 256), default=14)
    ap.add_argument("--kv-heads", type=int_in(1, 256), default=2, help="must divide --heads")
    ap.add_argument("--head-dim", type=int_in(4, 256), default=64)
    ap.add_argument("--tokens", type=int_in(8, 8192), default=256)
    ap.add_argument("--steps", type=int_in(1, 10**6), default=100, help="updates per initialisation (paper: 1000)")
    ap.add_argument("--val-every", type=int_in(1, 10**6), default=25)
    ap.add_argument("--patience", type=int_in(1, 10**6), default=50)
    ap.add_argument("--seed", type=int_in(0, 2**31 - 2), default=0)
    ap.add_argument("--repeats", type=int_in(1, 100), default=3,
                    help="interleaved repeats; the fastest of each is reported")
    ap.add_argument("--out", type=output_file, default=RESULTS / "calibration.json",
                    help="the JSON to write (the PNG goes beside it)")
    args = ap.parse_args(argv)
    if args.heads % args.kv_heads:
        ap.error(f"--kv-heads: expected a divisor of --heads ({args.heads}), got {args.kv_heads}")
    return args


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import platform
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from rich.console import Console
from rich.table import Table

from oal.calibration.data import CalibConfig, LayerData
from oal.calibration.fit import calibrate_oal_layer
from oal.methods import build_method
from oal.rundir.files import atomic_save_figure, atomic_write_json


def synthetic_layer(n_seq: int, heads: int, kv: int, tokens: int, d: int, seed: int) -> LayerData:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.ones(d)
    scale[torch.randperm(d, generator=gen)[:3]] = 4.0  # a few outlier dimensions (paper Sec. 3)
    q = torch.randn(n_seq, heads, tokens, d, generator=gen) * scale
    k = torch.randn(n_seq, kv, tokens, d, generator=gen) * scale * 0.5
    v = torch.randn(n_seq, kv, tokens, d, generator=gen)
    out = build_method("softmax", heads, kv, d)(q, k, v)
    return LayerData(q, k, v, out)


def main(args: argparse.Namespace) -> None:
    hq, hkv, d = args.heads, args.kv_heads, args.head_dim
    train = synthetic_layer(8, hq, hkv, args.tokens, d, args.seed)
    val = synthetic_layer(2, hq, hkv, args.tokens, d, args.seed + 1)
    gen = torch.Generator().manual_seed(args.seed)
    n_groups = torch.randint(2, 5, (hq,), generator=gen)
    groups = torch.stack([torch.randint(0, int(g), (d,), generator=gen) for g in n_groups])
    cfg = CalibConfig(max_steps=args.steps, val_every=args.val_every, patience=args.patience, seed=args.seed)

    torch.optim.Adam([torch.zeros(1, requires_grad=True)])  # first Adam imports torch._dynamo (~3 s): not timed
    times, results = {}, {}
    for _ in range(args.repeats):  # interleaved repeats, best time kept: the CPU is shared with other jobs
        for name, sequential in (("batched", False), ("sequential", True)):
            t0 = time.perf_counter()
            res = calibrate_oal_layer(train, val, groups, cfg, sequential=sequential)
            dt = time.perf_counter() - t0
            if dt < times.get(name, float("inf")):
                times[name], results[name] = dt, res
    (gb, ob), (gs, os_) = results["batched"], results["sequential"]
    rows = {}
    for label, b, s in (("global", gb, gs), ("oal", ob, os_)):
        vb = torch.tensor([h.val_mse for h in b.heads])
        vs = torch.tensor([h.val_mse for h in s.heads])
        rows[label] = {
            "same_init": [h.init for h in b.heads] == [h.init for h in s.heads],
            "max_rel_val_mse_diff": float(((vb - vs).abs() / vs).max()),
            "val_mse_mean": float(vb.mean()),
            "batched_s": b.elapsed_s, "sequential_s": s.elapsed_s,
        }
    speedup = times["sequential"] / times["batched"]
    record = {"shape": {"Hq": hq, "Hkv": hkv, "d": d, "tokens": args.tokens, "train_seqs": 8, "val_seqs": 2,
                        "groups_per_head": (groups.max(1).values + 1).tolist()},
              "config": cfg.to_dict(), "time_s": times, "repeats": args.repeats, "speedup": speedup, "methods": rows,
              "torch_threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
              "environment": environment()}
    atomic_write_json(args.out, record)

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar(["batched\n(all heads x inits)", "sequential\n(per head, per init)"],
           [times["batched"], times["sequential"]], color=["tab:green", "tab:gray"])
    ax.set_ylabel("wall time for global + OAL calibration (s)")
    ax.set_title(f"One layer, Hq={hq}, d={d}, N={args.tokens}: {speedup:.1f}x")
    fig.tight_layout()
    atomic_save_figure(fig, args.out.with_suffix(".png"), dpi=120)

    table = Table(title=f"calibration, one layer (Hq={hq}, Hkv={hkv}, d={d}, N={args.tokens}, {args.steps} updates)")
    for col in ("method", "batched (s)", "sequential (s)", "same inits", "max rel. val-MSE diff", "val MSE"):
        table.add_column(col, justify="right")
    for label, r in rows.items():
        table.add_row(label, f"{r['batched_s']:.1f}", f"{r['sequential_s']:.1f}", str(r["same_init"]),
                      f"{r['max_rel_val_mse_diff']:.1e}", f"{r['val_mse_mean']:.4g}")
    table.add_row("total", f"{times['batched']:.1f}", f"{times['sequential']:.1f}", "", f"speedup {speedup:.1f}x", "")
    Console().print(table)


if __name__ == "__main__":
    run_tool(main, ARGS)
