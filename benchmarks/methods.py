"""Causal forward time of every attention method (built-in registry) against SDPA, at a few lengths.

Shape: Qwen2.5-0.5B heads (B=1, Hq=14, Hkv=2, d=dv=64), fp32, no grad, CPU by default. Methods run in this
process one after another (time only; see benchmarks/operator.py for memory). The ratios are against `sdpa`:
F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), torch's default dispatch, what HF models
call; `softmax` is the registry's softmax method (SDPA behind oal's input checks). Writes `--out` (default
benchmarks/results/methods.json) and a PNG beside it, and prints a table of milliseconds and the ratio to SDPA.

    python -m benchmarks.methods                    # N = 256, 1024, 4096
    python -m benchmarks.methods --lens 512 2048    # custom lengths
"""

import os
import sys

# benchmarks/operator.py would shadow the standard library's `operator` when this folder leads sys.path
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks._common import MAX_TOKENS, ToolParser, environment, int_in, output_file, run_tool  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("softmax", "oal", "global", "performer", "spectraformer", "dijiang", "taylorshift")
ROWS = ("sdpa", *METHODS)  # sdpa: torch's default dispatch, the competitor every ratio is against
HQ, HKV, D = 14, 2, 64
OUTPUTS = ("the JSON of the run (--out; default benchmarks/results/methods.json) and a PNG beside it; the table on "
           "stdout")


def parse_args(argv=None) -> argparse.Namespace:
    ap = ToolParser(__doc__, OUTPUTS)
    ap.add_argument("--lens", type=int_in(1, MAX_TOKENS), nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--repeats", type=int_in(1, 1000), default=3)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--out", type=output_file, default=RESULTS / "methods.json",
                    help="the JSON to write (the PNG goes beside it)")
    return ap.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import time  # noqa: E402

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402


def _build(name: str):
    """The causal forward of one row: `sdpa` is torch's default SDPA call, the others the registry's methods."""
    from oal.methods import build_method

    if name == "sdpa":
        return lambda q, k, v, causal: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=causal, enable_gqa=True)
    kw = {}
    if name == "oal":  # a 5-group head layout, as Fig. 3's OAL (G = 5)
        kw = {"groups": torch.randint(0, 5, (HQ, D), generator=torch.Generator().manual_seed(0)), "n_groups": 5}
    return build_method(name, HQ, HKV, D, **kw).eval()


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]  # median, ms


def main(args: argparse.Namespace) -> None:
    from oal.rundir.files import atomic_save_figure, atomic_write_json

    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch sees no CUDA device")
    torch.manual_seed(0)
    rows = []
    with torch.no_grad():
        for n in args.lens:
            q = torch.randn(1, HQ, n, D, device=args.device)
            k = torch.randn(1, HKV, n, D, device=args.device)
            v = torch.randn(1, HKV, n, D, device=args.device)
            for name in ROWS:
                m = _build(name)
                m = m.to(args.device) if isinstance(m, torch.nn.Module) else m
                ms = _time(lambda m=m, q=q, k=k, v=v: m(q, k, v, causal=True), args.repeats)
                rows.append({"method": name, "N": n, "ms": ms})
    base = {r["N"]: r["ms"] for r in rows if r["method"] == "sdpa"}
    for r in rows:
        r["ratio_to_sdpa"] = r["ms"] / base[r["N"]]
    meta = {"shape": {"B": 1, "Hq": HQ, "Hkv": HKV, "d": D}, "dtype": "float32", "device": args.device,
            "threads": torch.get_num_threads(), "torch": torch.__version__}
    atomic_write_json(args.out, {"meta": meta, "rows": rows, "environment": environment()})

    table = Table(title=f"causal forward, B=1 Hq={HQ} Hkv={HKV} d={D}, fp32, {args.device}")
    table.add_column("method")
    for n in args.lens:
        table.add_column(f"N={n} ms (x SDPA)", justify="right")
    for name in ROWS:
        cells = [f"{r['ms']:.1f} ({r['ratio_to_sdpa']:.1f}x)" for r in rows if r["method"] == name]
        table.add_row(name, *cells)
    Console().print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=150)
    for name in ROWS:
        pts = [(r["N"], r["ms"]) for r in rows if r["method"] == name]
        ax.plot(*zip(*pts, strict=True), "o-", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length N")
    ax.set_ylabel("forward time (ms, median)")
    ax.set_title("Causal attention forward, all methods")
    ax.legend(fontsize=7)
    fig.tight_layout()
    atomic_save_figure(fig, args.out.with_suffix(".png"))


if __name__ == "__main__":
    run_tool(main, ARGS)
