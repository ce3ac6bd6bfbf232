"""Benchmark: calibration capture, one pass for all converted layers vs one forward per layer, against depth.

The Qwen2.5-0.5B architecture (random weights, bfloat16), converted layers 3..2+L for L in 2, 4, 8, 18, a few
calibration blocks of N tokens. Per-layer capture (`oal.calibration.model.capture_layer_data` once per layer, each
forward cut after its layer) runs sum_i (i+1) layer forwards, quadratic in depth;
`oal.models.capture_store.capture_to_disk` runs one forward per block up to the deepest layer and streams every
layer to disk, linear in depth. Both give the same tensors bit for bit (checked here on the first layer). Writes
benchmarks/results/capture.json and capture.png.

    .venv/bin/python -P benchmarks/capture.py [--seq-len 512 --blocks 2]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen2Config  # noqa: E402

from oal.calibration.model import capture_layer_data  # noqa: E402
from oal.models.capture_store import capture_to_disk  # noqa: E402
from oal.rundir.files import atomic_save_figure, atomic_write_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
# Qwen2.5-0.5B's config.json values (as in scripts/scale_rehearsal.py), vocabulary cut: capture stops before the head
QWEN = dict(vocab_size=4096, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
            num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=2)
    ap.add_argument("--depths", default="2,4,8,18")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**QWEN)).to(torch.bfloat16).eval()
    ids = torch.randint(0, QWEN["vocab_size"], (args.blocks, args.seq_len), generator=torch.Generator().manual_seed(1))
    rows = []
    for n_layers in (int(x) for x in args.depths.split(",")):
        layers = list(range(3, 3 + n_layers))
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            store = capture_to_disk(model, {"calib": ids}, layers, tmp, key="bench")
            one_pass = time.perf_counter() - t0
            first = store.load("calib", layers[0])
        t0 = time.perf_counter()
        per_layer = [capture_layer_data(model, ids, i, batch_size=1) for i in layers]
        per_layer_s = time.perf_counter() - t0
        assert all(torch.equal(first[f], getattr(per_layer[0], f)) for f in ("q", "k", "v", "out"))
        rows.append({"layers": n_layers, "one_pass_s": round(one_pass, 2), "per_layer_s": round(per_layer_s, 2)})
    table = Table(title=f"capture, Qwen2.5-0.5B shapes, {args.blocks} blocks x {args.seq_len} tokens, bf16")
    for col in ("converted layers", "one pass (s)", "per layer (s)", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["layers"]), f"{r['one_pass_s']:.2f}", f"{r['per_layer_s']:.2f}",
                      f"{r['per_layer_s'] / r['one_pass_s']:.1f}x")
    Console().print(table)
    out = {"seq_len": args.seq_len, "blocks": args.blocks, "rows": rows, "threads": torch.get_num_threads(),
           "machine": platform.processor() or platform.machine(), "note": "one run on a shared, busy 2-core CPU"}
    atomic_write_json(RESULTS / "capture.json", out)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    x = [r["layers"] for r in rows]
    ax.plot(x, [r["per_layer_s"] for r in rows], "o-", label="one forward per layer (before)")
    ax.plot(x, [r["one_pass_s"] for r in rows], "s-", label="one pass, streamed per layer")
    ax.set_xlabel("converted layers (from layer 3)")
    ax.set_ylabel("capture time (s)")
    ax.legend()
    fig.tight_layout()
    atomic_save_figure(fig, RESULTS / "capture.png", dpi=120)


if __name__ == "__main__":
    main()
