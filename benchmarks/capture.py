"""Benchmark: calibration capture, one pass for all converted layers vs one forward per layer, against depth.

The Qwen2.5-0.5B architecture (random weights, bfloat16), converted layers 3..2+L for L in 2, 4, 8, 18, a few
calibration blocks of N tokens. Per-layer capture (`oal.calibration.model.capture_layer_data` once per layer, each
forward cut after its layer) runs sum_i (i+1) layer forwards, quadratic in depth;
`oal.models.capture_store.capture_to_disk` runs one forward per block up to the deepest layer and streams every
layer to disk, linear in depth. Both give the same tensors bit for bit (checked here on the first layer). Writes
`--out` (default benchmarks/results/capture.json) and a PNG beside it, and prints a table.

    .venv/bin/python -m benchmarks.capture [--seq-len 512 --blocks 2]
"""

# ruff: noqa: E402  (the arguments are parsed before the heavy imports)
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks._common import ToolParser, environment, int_in, list_of, output_file, run_tool

RESULTS = Path(__file__).resolve().parent / "results"
# Qwen2.5-0.5B's config.json values (as in scripts/scale_rehearsal.py), vocabulary cut: capture stops before the head
QWEN = dict(vocab_size=4096, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6)
FIRST = 3  # the first converted layer
OUTPUTS = ("the JSON of the run (--out; default benchmarks/results/capture.json) and a PNG beside it; the table on "
           "stdout")


def parse_args(argv=None) -> argparse.Namespace:
    ap = ToolParser(__doc__, OUTPUTS)
    ap.add_argument("--seq-len", type=int_in(1, QWEN["max_position_embeddings"]), default=512)
    ap.add_argument("--blocks", type=int_in(1, 1024), default=2)
    ap.add_argument("--depths", type=list_of(int_in(1, QWEN["num_hidden_layers"] - FIRST)), default="2,4,8,18",
                    help=f"comma-separated numbers of converted layers (from layer {FIRST})")
    ap.add_argument("--out", type=output_file, default=RESULTS / "capture.json",
                    help="the JSON to write (the PNG goes beside it)")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import os
import platform
import tempfile
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from rich.console import Console
from rich.table import Table
from transformers import AutoModelForCausalLM, Qwen2Config

from oal.calibration.model import capture_layer_data
from oal.models.capture_store import capture_to_disk
from oal.rundir.files import atomic_save_figure, atomic_write_json


def main(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN)).to(torch.bfloat16).eval()
    ids = torch.randint(0, QWEN["vocab_size"], (args.blocks, args.seq_len), generator=torch.Generator().manual_seed(1))
    rows = []
    for n_layers in args.depths:
        layers = list(range(FIRST, FIRST + n_layers))
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            store = capture_to_disk(model, {"calib": ids}, layers, tmp, key="bench")
            one_pass = time.perf_counter() - t0
            first = store.load("calib", layers[0])
        t0 = time.perf_counter()
        per_layer = [capture_layer_data(model, ids, i, batch_size=1) for i in layers]
        per_layer_s = time.perf_counter() - t0
        assert all(torch.equal(first[f], getattr(per_layer[0], f)) for f in ("q", "k", "v", "out"))
        rows.append({"layers": n_layers, "one_pass_s": one_pass, "per_layer_s": per_layer_s})
    table = Table(title=f"capture, Qwen2.5-0.5B shapes, {args.blocks} blocks x {args.seq_len} tokens, bf16")
    for col in ("converted layers", "one pass (s)", "per layer (s)", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["layers"]), f"{r['one_pass_s']:.2f}", f"{r['per_layer_s']:.2f}",
                      f"{r['per_layer_s'] / r['one_pass_s']:.1f}x")
    Console().print(table)
    out = {"seq_len": args.seq_len, "blocks": args.blocks, "rows": rows, "threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine(), "load_average": os.getloadavg()[0],
           "environment": environment()}
    atomic_write_json(args.out, out)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    x = [r["layers"] for r in rows]
    ax.plot(x, [r["per_layer_s"] for r in rows], "o-", label="one forward per layer (before)")
    ax.plot(x, [r["one_pass_s"] for r in rows], "s-", label="one pass, streamed per layer")
    ax.set_xlabel("converted layers (from layer 3)")
    ax.set_ylabel("capture time (s)")
    ax.legend()
    fig.tight_layout()
    atomic_save_figure(fig, args.out.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    run_tool(main, ARGS)
