"""Causal forward time and peak memory of chunked OAL against SDPA (issue: operator benchmark).

Shape: the Qwen2.5-0.5B head shape (B=1, Hq=14, Hkv=2, d=dv=64), G=5, fp32, N = 1k..32k.
Each (method, N) runs in a fresh subprocess so that its peak RSS (ru_maxrss) is its own; the reported memory is
the peak above the resident inputs. Writes benchmarks/results/operator.{json,png} and prints a table.

    python -m benchmarks.operator                 # N = 1k..32k
    python -m benchmarks.operator --max-len 8192  # quicker
"""

import os
import sys

# Run as a script, this file's folder comes first on sys.path, where "operator.py" would shadow the standard
# library's `operator` module; drop that entry before anything imports it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = dict(hq=14, hkv=2, d=64, g=5)


def _inputs(n: int, device: str):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, SHAPE["hq"], n, SHAPE["d"], generator=gen)
    k = torch.randn(1, SHAPE["hkv"], n, SHAPE["d"], generator=gen)
    v = torch.randn(1, SHAPE["hkv"], n, SHAPE["d"], generator=gen)
    groups = torch.randint(0, SHAPE["g"], (SHAPE["hq"], SHAPE["d"]), generator=gen)
    from oal.ops.kernel import perturbed_factor, taylor_factor

    factor = perturbed_factor(taylor_factor(SHAPE["hq"], SHAPE["g"]), 0.1, generator=gen)
    return [t.to(device) for t in (q, k, v, groups, factor)]


def _measure(method: str, n: int, repeats: int, device: str) -> dict:
    """Runs inside the child process: time one method at one length."""
    from oal.ops import oal_attention

    q, k, v, groups, factor = _inputs(n, device)
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def call():
        if method == "sdpa":
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return oal_attention(q, k, v, groups, factor, backend="chunked")

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    with torch.no_grad():
        call()  # warm-up
        sync()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            call()
            sync()
            times.append(time.perf_counter() - t0)
    peak_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) / 1024
    if device == "cuda":
        peak_mib = torch.cuda.max_memory_allocated() / 2**20
    return {"method": method, "n": n, "time_s": min(times), "mean_s": sum(times) / len(times), "peak_mib": peak_mib}


def oal_flops(n: int, chunk: int = 64) -> float:
    """Useful floating-point operations of the chunked path: readout, state update, intra-chunk GEMMs."""
    d, hq, hkv, g = SHAPE["d"], SHAPE["hq"], SHAPE["hkv"], SHAPE["g"]
    feat, dv1 = 1 + d + d * (d + 1) // 2, d + 1
    return 2.0 * n * (hq * feat * dv1 + hkv * feat * dv1 + hq * chunk * ((g + 1) * d + dv1))


def gemm_gflops(device: str) -> float:
    a = torch.randn(2048, 2048, device=device)
    b = torch.randn(2048, 2048, device=device)
    a @ b
    t0 = time.perf_counter()
    for _ in range(5):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    return 5 * 2 * 2048**3 / (time.perf_counter() - t0) / 1e9


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for method, label in (("sdpa", "SDPA (causal, GQA)"), ("oal", "OAL chunked (G=5)")):
        pts = sorted((r["n"], r["time_s"], r["peak_mib"]) for r in rows if r["method"] == method)
        axes[0].loglog([p[0] for p in pts], [p[1] for p in pts], "o-", label=label, base=2)
        axes[1].semilogx([p[0] for p in pts], [p[2] for p in pts], "o-", label=label, base=2)
    axes[0].set(xlabel="sequence length N", ylabel="forward time (s)", title="Causal forward time")
    axes[1].set(xlabel="sequence length N", ylabel="peak memory above inputs (MiB)", title="Peak memory")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle("B=1, Hq=14, Hkv=2, d=dv=64, fp32")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child[0], int(args.child[1]), args.repeats, args.device)))
        return

    from rich.console import Console
    from rich.table import Table

    lengths, n = [], args.min_len
    while n <= args.max_len:
        lengths.append(n)
        n *= 2
    rows = []
    for n in lengths:
        for method in ("sdpa", "oal"):
            cmd = [sys.executable, "-m", "benchmarks.operator", "--child", method, str(n), "--repeats",
                   str(args.repeats), "--device", args.device]
            root = Path(__file__).resolve().parent.parent
            res = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=root)
            out = res.stdout.strip().splitlines()[-1]
            rows.append(json.loads(out))
            print(f"  {method:5s} N={n:6d} {rows[-1]['time_s']:.3f} s", file=sys.stderr)
    gemm = gemm_gflops(args.device)
    table = Table(title=f"OAL chunked vs SDPA, causal forward, {args.device}, {torch.get_num_threads()} threads")
    for col in ("N", "SDPA (s)", "OAL (s)", "sdpa/oal", "SDPA MiB", "OAL MiB", "OAL GFLOP/s", "% of GEMM"):
        table.add_column(col, justify="right")
    summary = []
    for n in lengths:
        s = next(r for r in rows if r["method"] == "sdpa" and r["n"] == n)
        o = next(r for r in rows if r["method"] == "oal" and r["n"] == n)
        gfs = oal_flops(n) / o["time_s"] / 1e9
        summary.append({"n": n, "ratio_sdpa_over_oal": s["time_s"] / o["time_s"], "oal_gflops": gfs})
        table.add_row(str(n), f"{s['time_s']:.3f}", f"{o['time_s']:.3f}", f"{s['time_s'] / o['time_s']:.2f}",
                      f"{s['peak_mib']:.0f}", f"{o['peak_mib']:.0f}", f"{gfs:.1f}", f"{100 * gfs / gemm:.0f}%")
    console = Console()
    console.print(table)
    oal_t = {r["n"]: r["time_s"] for r in rows if r["method"] == "oal"}
    scaling = {f"time({2 * n})/time({n})": oal_t[2 * n] / oal_t[n] for n in lengths if 2 * n in oal_t}
    console.print(f"fp32 GEMM (2048^3): {gemm:.1f} GFLOP/s; OAL scaling: "
                  + ", ".join(f"{k} = {v:.2f}" for k, v in scaling.items()))
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {"shape": SHAPE | {"dtype": "float32", "B": 1}, "device": args.device,
              "threads": torch.get_num_threads(), "gemm_gflops": gemm, "rows": rows, "summary": summary,
              "scaling": scaling, "torch": torch.__version__}
    tmp = RESULTS / "operator.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, RESULTS / "operator.json")
    _plot(rows, RESULTS / "operator.png")
    console.print(f"wrote {RESULTS / 'operator.json'} and {RESULTS / 'operator.png'}")


if __name__ == "__main__":
    main()
