"""GPU benchmark: the Triton OAL kernels against SDPA (flash, math) and the torch `chunked` path (issue 10).

Shape: the Qwen2.5-0.5B head shape of the paper's Fig. 3 (B=1, Hq=14, Hkv=2, d=dv=64), G=5, bf16, causal,
N = 1k..64k. Forward (no autograd) and forward+backward. SDPA runs with `enable_gqa` (K/V never repeated) and
one backend forced through `torch.nn.attention.sdpa_kernel`; the math backend is skipped once its estimated
peak exceeds --math-fraction of free memory (as in the paper's App. E), `chunked` above --chunked-max.
Times: CUDA events, median of --repeats after --warmup calls. Memory: torch.cuda.max_memory_allocated over one
call, inputs included (as in Fig. 3). Writes benchmarks/results/gpu.{json,png} and prints a table with the ratio
sdpa_flash / oal (above 1: OAL is faster). Needs a CUDA device.

    python -m benchmarks.gpu                      # N = 1k..64k
    python -m benchmarks.gpu --max-len 16384      # quicker
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = dict(B=1, hq=14, hkv=2, d=64, dv=64, g=5)
METHODS = ("oal_triton", "sdpa_flash", "sdpa_math", "oal_chunked")
LABELS = {"oal_triton": "OAL Triton (G=5)", "sdpa_flash": "SDPA flash", "sdpa_math": "SDPA math",
          "oal_chunked": "OAL torch chunked"}


def inputs(n: int, *, grad: bool, seed: int = 0):
    """q, k, v (bf16, CUDA), groups and a calibrated-looking factor (perturbed Taylor), and an output gradient."""
    from oal.ops.kernel import perturbed_factor, taylor_factor

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(SHAPE["B"], SHAPE["hq"], n, SHAPE["d"], generator=gen)
    k = torch.randn(SHAPE["B"], SHAPE["hkv"], n, SHAPE["d"], generator=gen)
    v = torch.randn(SHAPE["B"], SHAPE["hkv"], n, SHAPE["dv"], generator=gen)
    groups = torch.randint(0, SHAPE["g"], (SHAPE["hq"], SHAPE["d"]), generator=gen)
    factor = perturbed_factor(taylor_factor(SHAPE["hq"], SHAPE["g"]), 0.1, generator=gen)
    q, k, v = (t.to("cuda", torch.bfloat16).requires_grad_(grad) for t in (q, k, v))
    factor = factor.cuda().requires_grad_(grad)
    do = torch.randn(SHAPE["B"], SHAPE["hq"], n, SHAPE["dv"], generator=gen).to("cuda", torch.bfloat16)
    return q, k, v, groups.cuda(), factor, do


def attention(method: str):
    """A function (q, k, v, groups, factor) -> out for one method."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from oal.ops import oal_attention

    if method.startswith("oal_"):
        backend = method.removeprefix("oal_")
        return lambda q, k, v, groups, factor: oal_attention(q, k, v, groups, factor, backend=backend)
    sdp = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_math": SDPBackend.MATH}[method]

    def sdpa(q, k, v, groups, factor):
        with sdpa_kernel(sdp):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    return sdpa


def math_peak_bytes(n: int, backward: bool) -> int:
    """Rough peak of the math backend: a few fp32 [Hq, N, N] tensors (scores, mask, softmax; more backward)."""
    return (6 if backward else 3) * SHAPE["hq"] * n * n * 4


def measure(method: str, n: int, backward: bool, warmup: int, repeats: int) -> dict:
    """Median time (ms) over `repeats` CUDA-event-timed calls and the peak memory of one call."""
    fn = attention(method)
    q, k, v, groups, factor, do = inputs(n, grad=backward)

    def call():
        if backward:
            out = fn(q, k, v, groups, factor)
            grads = torch.autograd.grad(out, (q, k, v) + ((factor,) if method.startswith("oal_") else ()), do)
            return out, grads
        with torch.no_grad():
            return fn(q, k, v, groups, factor)

    for _ in range(warmup):  # compilation, autotuning of cuBLAS/SDPA, allocator warm-up
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        res = call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        del res
    torch.cuda.reset_peak_memory_stats()
    res = call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**20
    del res
    times.sort()
    return {"method": method, "n": n, "mode": "fwd+bwd" if backward else "fwd", "ms": times[len(times) // 2],
            "ms_all": times, "peak_mib": peak}


def skip_reason(method: str, n: int, backward: bool, args) -> str | None:
    if method == "oal_chunked" and n > args.chunked_max:
        return f"N > --chunked-max {args.chunked_max}"
    if method == "sdpa_math":
        free, _ = torch.cuda.mem_get_info()
        if math_peak_bytes(n, backward) > args.math_fraction * free:
            return f"estimated peak {math_peak_bytes(n, backward) / 2**30:.0f} GiB > {args.math_fraction:.0%} of free"
    return None


def sanity(n: int = 2048) -> dict:
    """The kernels against the torch path on the benchmark's inputs: relative errors (in norm) of the output and of
    the q, k, v and factor gradients, bf16 on the kernels against fp32 on `chunked` (so a wrong backward is not
    timed unnoticed: on the H200, 8 warps gave dq, dk off by 0.4 at d = 128 with a correct output)."""
    q, k, v, groups, factor, do = inputs(n, grad=True, seed=1)

    def run(method, dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)] + [factor.detach().requires_grad_()]
        out = attention(method)(*leaves[:3], groups, leaves[3])
        return [out, *torch.autograd.grad(out, leaves, do.to(out.dtype))]

    got, want = run("oal_triton", torch.bfloat16), run("oal_chunked", torch.float32)
    names = ("out", "dq", "dk", "dv", "dfactor")
    errs = {name: float((g.detach().float() - w.detach().float()).norm() / w.detach().float().norm())
            for name, g, w in zip(names, got, want, strict=True)}
    return {"n": n, "rel_err_vs_chunked_fp32": errs["out"], "rel_err": errs}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oal.rundir.files import atomic_save_figure

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for method in METHODS:
        for ax, mode in ((axes[0], "fwd"), (axes[1], "fwd+bwd")):
            pts = sorted((r["n"], r["ms"]) for r in rows if r["method"] == method and r["mode"] == mode and "ms" in r)
            if pts:
                ax.loglog(*zip(*pts, strict=True), "o-", label=LABELS[method], base=2)
        pts = sorted((r["n"], r["peak_mib"]) for r in rows if r["method"] == method and r["mode"] == "fwd"
                     and "peak_mib" in r)
        if pts:
            axes[2].loglog(*zip(*pts, strict=True), "o-", label=LABELS[method], base=2)
    for ax, title, ylabel in ((axes[0], "Causal forward", "time (ms)"), (axes[1], "Forward + backward", "time (ms)"),
                              (axes[2], "Peak memory, forward", "max_memory_allocated (MiB)")):
        ax.set(xlabel="sequence length N", ylabel=ylabel, title=title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{torch.cuda.get_device_name()}: B=1, Hq=14, Hkv=2, d=dv=64, G=5, bf16")
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)


def summary(rows: list[dict], lengths: list[int]) -> tuple[list[dict], dict]:
    """Per N: flash / OAL ratios; and the issue's goals, checked on the measured numbers."""
    def ms(method, n, mode):
        return next((r["ms"] for r in rows if (r["method"], r["n"], r["mode"]) == (method, n, mode) and "ms" in r),
                    None)

    out = []
    for n in lengths:
        row = {"n": n}
        for mode in ("fwd", "fwd+bwd"):
            flash, oal = ms("sdpa_flash", n, mode), ms("oal_triton", n, mode)
            row[f"ratio_{mode}"] = flash / oal if flash and oal else None
        out.append(row)
    ratio = {(r["n"], mode): r[f"ratio_{mode}"] for r in out for mode in ("fwd", "fwd+bwd")}

    def faster_from(n0, mode):  # None: not measured
        vals = [ratio[n, mode] for n in lengths if n >= n0 and ratio[n, mode] is not None]
        return all(v > 1 for v in vals) if vals else None

    at_64k = ratio.get((65536, "fwd"))
    goals = {
        "forward faster than sdpa_flash from N=8k": faster_from(8192, "fwd"),
        "forward >= 3x sdpa_flash at N=64k": None if at_64k is None else at_64k >= 3,
        "fwd+bwd faster than sdpa_flash from N=16k": faster_from(16384, "fwd+bwd"),
    }
    return out, goals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=65536)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--chunked-max", type=int, default=16384, help="longest N for the torch chunked path")
    parser.add_argument("--math-fraction", type=float, default=0.8, help="skip SDPA math above this share of free")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--out", type=Path, default=RESULTS, help="folder for gpu.json and gpu.png")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks.gpu: no CUDA device (torch.cuda.is_available() is False); run it on a GPU machine, "
                 "see README 'GPU'")
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        sys.exit(f"benchmarks.gpu: --methods: unknown {unknown}, expected a subset of {METHODS}")

    from rich.console import Console
    from rich.table import Table

    from oal.rundir.files import atomic_write_json
    from oal.rundir.hashes import versions

    console = Console(width=max(Console().width, 140))  # the table's 11 columns, also in a log (80 by default)
    lengths = [1 << p for p in range(max(0, math.ceil(math.log2(args.min_len))), 17) if
               args.min_len <= 1 << p <= args.max_len]
    args.out.mkdir(parents=True, exist_ok=True)
    check = sanity()
    console.print(f"sanity: triton (bf16) vs fp32 chunked at N={check['n']}: relative error "
                  + ", ".join(f"{name} {err:.2e}" for name, err in check["rel_err"].items()))
    if not all(err < 5e-2 for err in check["rel_err"].values()):
        console.print("[bold red]sanity: an error above 5e-2: the kernels' results are wrong on this device[/]")
    rows = []
    t0 = time.time()
    import triton

    def save(per_n=None, goals=None, interrupted=False):  # after every length: a time-out keeps what finished
        result = {"shape": SHAPE | {"dtype": "bfloat16", "causal": True}, "device": torch.cuda.get_device_name(),
                  "torch": torch.__version__, "triton": triton.__version__, "versions": versions(),
                  "host": platform.node(), "args": {k: str(v) for k, v in vars(args).items()}, "sanity": check,
                  "rows": rows, "summary": per_n, "goals": goals, "interrupted": interrupted,
                  "elapsed_s": time.time() - t0}
        atomic_write_json(args.out / "gpu.json", result)

    interrupted = False
    try:
        for n in lengths:
            for backward in (False,) if args.no_backward else (False, True):
                for method in methods:
                    reason = skip_reason(method, n, backward, args)
                    mode = "fwd+bwd" if backward else "fwd"
                    if reason:
                        rows.append({"method": method, "n": n, "mode": mode, "skipped": reason})
                        continue
                    try:
                        rows.append(measure(method, n, backward, args.warmup, args.repeats))
                    except torch.cuda.OutOfMemoryError:
                        rows.append({"method": method, "n": n, "mode": mode, "skipped": "out of memory"})
                    torch.cuda.empty_cache()
                    r = rows[-1]
                    console.print(f"  {method:12s} {mode:8s} N={n:6d} "
                                  + (f"{r['ms']:9.3f} ms {r['peak_mib']:9.0f} MiB" if "ms" in r else r["skipped"]))
            save()
    except KeyboardInterrupt:  # a time limit (timeout --signal=INT): report what was measured
        interrupted = True
        console.print("interrupted: reporting the lengths measured so far")
        lengths = sorted({r["n"] for r in rows})
    per_n, goals = summary(rows, lengths)

    def cell(method, n, mode, key="ms", fmt="{:.2f}"):
        r = next((r for r in rows if (r["method"], r["n"], r["mode"]) == (method, n, mode)), None)
        return "-" if r is None or key not in r else fmt.format(r[key])

    table = Table(title=f"Causal attention, {torch.cuda.get_device_name()}, bf16, B=1 Hq=14 Hkv=2 d=dv=64 G=5 (ms)")
    cols = ["N", "flash fwd", "OAL fwd", "flash/OAL fwd", "flash f+b", "OAL f+b", "flash/OAL f+b", "math fwd",
            "chunked fwd", "flash MiB", "OAL MiB"]
    for col in cols:
        table.add_column(col, justify="right")
    for n, s in zip(lengths, per_n, strict=True):
        table.add_row(
            str(n), cell("sdpa_flash", n, "fwd"), cell("oal_triton", n, "fwd"),
            "-" if s["ratio_fwd"] is None else f"{s['ratio_fwd']:.2f}",
            cell("sdpa_flash", n, "fwd+bwd"), cell("oal_triton", n, "fwd+bwd"),
            "-" if s["ratio_fwd+bwd"] is None else f"{s['ratio_fwd+bwd']:.2f}",
            cell("sdpa_math", n, "fwd"), cell("oal_chunked", n, "fwd"),
            cell("sdpa_flash", n, "fwd", "peak_mib", "{:.0f}"), cell("oal_triton", n, "fwd", "peak_mib", "{:.0f}"))
    console.print(table)
    for goal, met in goals.items():
        console.print(f"goal: {goal}: {'not measured' if met is None else 'met' if met else 'NOT met'}")
    save(per_n, goals, interrupted)
    plot(rows, args.out / "gpu.png")
    console.print(f"wrote {args.out / 'gpu.json'} and {args.out / 'gpu.png'}")


if __name__ == "__main__":
    main()
