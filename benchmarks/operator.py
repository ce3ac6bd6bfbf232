"""Causal forward time, peak memory and per-phase split of chunked OAL against SDPA, in fp32 and bf16.

Shape: the Qwen2.5-0.5B head shape (B=1, Hq=14, Hkv=2, d=dv=64), G=5, N = 1k..32k, fp32 and bf16 inputs (bf16:
bf16 features and GEMMs with fp32 accumulation and an fp32 state where the CPU has bf16 GEMMs, against bf16 SDPA).
Each (method, N, dtype) runs in a fresh subprocess; the reported memory is the peak RSS of its first call above the
resident inputs (sampled).
Each OAL child also measures the GEMM rate of the dtype its GEMMs run in (2048^3; fp32 for bf16 inputs on a CPU
without bf16 GEMMs) right before its timing, which is what "% of GEMM" refers to, and times one extra call for the
phase split (features, intra-chunk, state, readout: the torch.profiler ranges of `oal.ops.chunked`; the fused
kernel's intra-chunk term is inside its readout share). Ratios come
from one run; the machine load (os.getloadavg) is recorded with every row. Writes `--out` (default
benchmarks/results/operator.json) and a PNG beside it, and prints the tables.

Settings (issue 36): before timing, the chunked operator is tuned to this machine (`oal.ops.tuning`: cached per CPU
model, threads and dtype; measured only when missing or stale, `--retune` measures again), and every OAL row runs
the tuned settings. `--no-tune` runs the fixed defaults instead (the first machine's choice, reproducible). The
CPU model, its flags and the settings of every row go into the JSON and the tables, and so does how the readout
ran: the fused CPU kernel (`oal.ops.cpu_kernel`, built for this machine on first use) where it can, the torch
GEMMs with OAL_CPU_KERNEL=0 or without a C++ compiler.

    python -m benchmarks.operator                        # N = 1k..32k, fp32 and bf16
    python -m benchmarks.operator --max-len 8192 --dtypes float32
    python -m benchmarks.operator --lengths 1024,4096,16384,32768 --threads 1 --clock cpu   # a shared machine
    python -m benchmarks.operator --sweep 8192           # chunk size x chunks per block, OAL only
    python -m benchmarks.operator --contention --lengths 4096,16384 --dtypes float32   # quiet vs one busy process
    python -m benchmarks.operator --no-tune --out benchmarks/results/operator_fixed.json   # the fixed defaults
    benchmarks/tune_report.sh                            # the acceptance run: fixed defaults, then tuned

--contention (benchmarks/_contention.py) times every configuration alone and then beside one busy competing
process, and reports OAL's slowdown over SDPA's (operator_contention.{json,png}).
"""

import os
import sys

# Run as a script, this file's folder comes first on sys.path, where "operator.py" would shadow the standard
# library's `operator` module; drop that entry before anything imports it.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
from pathlib import Path  # noqa: E402

from benchmarks._common import (  # noqa: E402
    MAX_TOKENS,
    ToolParser,
    add_length_args,
    add_timing_args,
    check_timing_args,
    input_file,
    int_in,
    lengths_from,
    list_of,
    output_file,
    run_tool,
    settings_parts,
    settings_text,
)

RESULTS = Path(__file__).resolve().parent / "results"


DTYPES = ("float32", "bfloat16")
OUTPUTS = ("the JSON of the run (--out; default benchmarks/results/operator.json, with --sweep operator_sweep.json, "
           "with --contention operator_contention.json) and a PNG beside it; the tables on stdout, progress on "
           "stderr; --compare: the table on stdout and operator_tuning.md beside TUNED")


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, every one checked before any work (--settings' format, the lengths, the output's folder)."""
    parser = ToolParser(__doc__, OUTPUTS)
    add_length_args(parser)
    parser.add_argument("--repeats", type=int_in(1, 1000), default=3)
    parser.add_argument("--dtypes", type=list_of(_dtype), default="float32,bfloat16",
                        help="comma-separated: float32, bfloat16")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="auto: cuda when torch sees a GPU, else cpu")
    add_timing_args(parser)
    parser.add_argument("--sweep", type=int_in(1, MAX_TOKENS), metavar="N",
                        help="time chunk sizes x blocks at length N instead")
    parser.add_argument("--contention", action="store_true",
                        help="time OAL and SDPA quiet and beside one busy competing process, side by side")
    parser.add_argument("--no-tune", action="store_true",
                        help="run the operator's fixed default settings, not the ones tuned to this machine")
    parser.add_argument("--settings", metavar="CHUNKxBLOCKS[,serial|pipeline[,kvN]]", type=settings_text,
                        help="run every OAL row with these settings (e.g. another machine's tuned choice), not the "
                             "tuned or fixed ones")
    parser.add_argument("--retune", action="store_true", help="tune again even when cached for this torch version")
    parser.add_argument("--out", type=output_file, help="the JSON to write (the PNG goes beside it)")
    parser.add_argument("--compare", nargs=2, type=input_file, metavar=("FIXED", "TUNED"),
                        help="print the acceptance table of two runs' JSON (--no-tune, then tuned) and write it as "
                             "markdown beside TUNED; times nothing")
    parser.add_argument("--child", nargs=2, metavar=("METHOD", "N"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", type=_dtype, default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int_in(1, 4096), help=argparse.SUPPRESS)
    parser.add_argument("--block-chunks", type=int_in(1, 4096), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_timing_args(parser, args)
    if args.compare and args.out:
        parser.error("--compare writes beside TUNED; --out does not apply")
    if args.sweep and args.contention:
        parser.error("choose one of --sweep and --contention")
    args.lengths = lengths_from(parser, args)
    if args.out is None:
        name = "operator_sweep" if args.sweep else "operator_contention" if args.contention else "operator"
        args.out = RESULTS / f"{name}.json"
    return args


def _dtype(text: str) -> str:
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"expected float32 or bfloat16, got {text!r}")
    return text


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import json  # noqa: E402
import subprocess  # noqa: E402

import torch  # noqa: E402

from benchmarks import _common  # noqa: E402
from benchmarks._common import PeakRSS, apply_timing_args, child_json, clock, finish_figure, timing_flags  # noqa: E402

SHAPE = dict(hq=14, hkv=2, d=64, g=5)
PHASES = ("features", "intra", "state", "readout")
# issue 36 (fp32: issue 18's): sdpa/oal at least this, and fp32 at least GEMM_GOAL of the GEMM rate at 16k
GOALS = {"float32": {4096: 1.0, 16384: 4.0, 32768: 8.0}, "bfloat16": {4096: 1.5, 16384: 6.0}}
GEMM_GOAL = {"float32": {16384: 60.0}}


def _inputs(n: int, device: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, SHAPE["hq"], n, SHAPE["d"], generator=gen)
    k = torch.randn(1, SHAPE["hkv"], n, SHAPE["d"], generator=gen)
    v = torch.randn(1, SHAPE["hkv"], n, SHAPE["d"], generator=gen)
    groups = torch.randint(0, SHAPE["g"], (SHAPE["hq"], SHAPE["d"]), generator=gen)
    from oal.ops.kernel import perturbed_factor, taylor_factor

    factor = perturbed_factor(taylor_factor(SHAPE["hq"], SHAPE["g"]), 0.1, generator=gen)
    q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
    return q, k, v, groups.to(device), factor.to(device)


def gemm_gflops(device: str, dtype: torch.dtype, size: int = 2048, reps: int = 5) -> float:
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = clock()
        a @ b
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, clock() - t0)
    return 2 * size**3 / best / 1e9


def gemm_dtype(device: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype of the GEMMs OAL runs for `dtype` inputs: on a CPU without bf16 GEMMs (no avx512_bf16 or AMX), bf16
    inputs run the fp32 path, so their "% of GEMM" is against the fp32 rate (bf16 matmul there is an emulated
    fallback that runs far below it)."""
    from oal.ops import cpu_bf16

    return torch.float32 if device == "cpu" and dtype == torch.bfloat16 and not cpu_bf16() else dtype


def goal_for(dtype: str, n: int, bf16_gemms: bool) -> float | None:
    """Issue 36's sdpa/oal goal of one row; the bf16 goals hold only on a CPU with bf16 GEMMs."""
    return None if dtype == "bfloat16" and not bf16_gemms else GOALS.get(dtype, {}).get(n)


def _phase_split(call) -> dict:
    """Seconds per phase of one call: the record_function ranges (oal.*) of oal.ops.chunked, on the benchmark clock,
    with the blocks run one after another (`OAL_CPU_PIPELINE=0`)."""
    import contextlib

    import oal.ops.chunked as chunked

    spent = dict.fromkeys(PHASES, 0.0)

    @contextlib.contextmanager
    def timed(name):
        t0 = clock()
        try:
            yield
        finally:
            spent[name.removeprefix("oal.")] += clock() - t0

    # with the block pipeline on, the ranges of the workers overlap in time: split the serial path instead
    real, chunked.record_function = chunked.record_function, timed
    pipeline = os.environ.get("OAL_CPU_PIPELINE")
    os.environ["OAL_CPU_PIPELINE"] = "0"
    try:
        t0 = clock()
        call()
        total = clock() - t0
    finally:
        chunked.record_function = real
        os.environ.pop("OAL_CPU_PIPELINE") if pipeline is None else os.environ.update(OAL_CPU_PIPELINE=pipeline)
    return spent | {"other": max(total - sum(spent.values()), 0.0), "total": total}


def _measure(method: str, n: int, repeats: int, device: str, dtype: torch.dtype) -> dict:
    """Runs inside the child process: time one method at one length."""
    from oal.ops import oal_attention

    q, k, v, groups, factor = _inputs(n, device, dtype)

    def call():
        if method == "sdpa":
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return oal_attention(q, k, v, groups, factor, backend="chunked")

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    row = {"method": method, "n": n, "dtype": str(dtype).replace("torch.", ""), "load_before": os.getloadavg()[0]}
    if method == "oal":
        import dataclasses

        from oal.ops import chunked, tuning

        row["settings"] = dataclasses.asdict(chunked.current_settings(dtype))
        row["settings_source"] = tuning.source(dtype)  # tuned, fixed (--no-tune) or forced (--sweep)
    with torch.no_grad():
        if method == "oal":  # the GEMM rate of this dtype, measured next to the timing it is compared with
            row["gemm_dtype"] = str(gemm_dtype(device, dtype)).replace("torch.", "")
            row["gemm_gflops"] = gemm_gflops(device, gemm_dtype(device, dtype))
        with PeakRSS() as mem:
            call()  # warm-up (and the memory measurement: the first call allocates the workspace)
            sync()
        times = []
        for _ in range(repeats):
            t0 = clock()
            call()
            sync()
            times.append(clock() - t0)
        peak_mib = mem.peak_mib
        if method == "oal":
            row["phases"] = _phase_split(call)
    if device == "cuda":
        peak_mib = torch.cuda.max_memory_allocated() / 2**20
    return row | {"time_s": min(times), "mean_s": sum(times) / len(times), "peak_mib": peak_mib,
                  "load_after": os.getloadavg()[0]}


def oal_flops(n: int, dtype: str = "float32", chunk: int | None = None) -> float:
    """Useful floating-point operations of the chunked path: readout, state update, intra-chunk GEMMs (`chunk`: the
    chunk size the row ran with; None: the fixed default)."""
    from oal.ops.chunked import default_chunk

    d, hq, hkv, g = SHAPE["d"], SHAPE["hq"], SHAPE["hkv"], SHAPE["g"]
    feat, dv1 = 1 + d + d * (d + 1) // 2, d + 1
    chunk = chunk or default_chunk(getattr(torch, dtype))  # the intra-chunk work grows with the chunk
    return 2.0 * n * (hq * feat * dv1 + hkv * feat * dv1 + hq * chunk * ((g + 1) * d + dv1))


def parse_settings(text: str):
    """`--settings` as `tuning.Settings` (`settings_parts`)."""
    from oal.ops.tuning import Settings

    return Settings(*settings_parts(text))


def _child(args: list[str]) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.operator", *args, *timing_flags()]
    return child_json(cmd, f"the timing child `benchmarks.operator {' '.join(args)}`")


def _plot(rows: list[dict], summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = sorted({r["dtype"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for dt in dtypes:
        for method, style in (("sdpa", "s--"), ("oal", "o-")):
            pts = sorted((r["n"], r["time_s"]) for r in rows if r["method"] == method and r["dtype"] == dt)
            axes[0].loglog(*zip(*pts, strict=True), style, label=f"{'SDPA' if method == 'sdpa' else 'OAL'} {dt}",
                           base=2)
        pts = sorted((s["n"], s["ratio_sdpa_over_oal"]) for s in summary if s["dtype"] == dt)
        axes[1].semilogx(*zip(*pts, strict=True), "o-", label=dt, base=2)
    for dt, marker in (("float32", "k*"), ("bfloat16", "kx")):
        if dt in dtypes:
            goal_n = sorted(GOALS[dt])
            axes[1].semilogx(goal_n, [GOALS[dt][n] for n in goal_n], marker, markersize=10, label=f"{dt} goal",
                             base=2)
    axes[0].set(xlabel="sequence length N", ylabel="forward time (s)", title="Causal forward time")
    axes[1].set(xlabel="sequence length N", ylabel="SDPA time / OAL time", title="Speed-up over SDPA")
    labels, bottoms = [], None
    width = 0.4
    for j, dt in enumerate(dtypes):
        ss = sorted((s for s in summary if s["dtype"] == dt), key=lambda s: s["n"])
        xs = [i + (j - 0.5) * width for i in range(len(ss))]
        bottoms = [0.0] * len(ss)
        for p, color in zip((*PHASES, "other"), ("C0", "C1", "C2", "C3", "C7"), strict=True):
            vals = [100 * s["phase_share"][p] for s in ss]
            axes[2].bar(xs, vals, width * 0.95, bottom=bottoms, color=color, label=p if j == 0 else None,
                        hatch="//" if dt == "bfloat16" else None)
            bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
        labels = [str(s["n"]) for s in ss]
    axes[2].set_xticks(range(len(labels)), labels)
    axes[2].set(xlabel="N (left bar fp32, right bar bf16, hatched)", ylabel="% of OAL time",
                title="Where OAL's time goes", ylim=(0, 120))
    # one row above the stacks: "best" put the five entries over the bars
    axes[2].legend(fontsize=7, ncol=len(PHASES) + 1, loc="upper center", columnspacing=0.8, handlelength=1.2)
    finish_figure(fig, axes, "B=1, Hq=14, Hkv=2, d=dv=64, G=5, CPU", path)


def _sweep(n: int, repeats: int, device: str, dtypes: list[str], out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = []
    for dt in dtypes:
        for chunk in (32, 64, 128):
            for blocks in (2, 4, 8, 16):
                row = _child(["--child", "oal", str(n), "--dtype", dt, "--repeats", str(repeats), "--device", device,
                              "--chunk", str(chunk), "--block-chunks", str(blocks)])
                rows.append(row | {"chunk": chunk, "block_chunks": blocks})
                print(f"  {dt} chunk={chunk} blocks={blocks}: {row['time_s']:.3f} s", file=sys.stderr)
    table = Table(title=f"OAL chunked, N={n}: chunk size x chunks per block")
    for col in ("dtype", "chunk", "chunks/block", "time (s)", "% of GEMM", "peak MiB", "load"):
        table.add_column(col, justify="right")
    for r in rows:
        share = 100 * oal_flops(n, r["dtype"], r["chunk"]) / r["time_s"] / 1e9 / r["gemm_gflops"]
        table.add_row(r["dtype"], str(r["chunk"]), str(r["block_chunks"]), f"{r['time_s']:.3f}", f"{share:.0f}%",
                      f"{r['peak_mib']:.0f}", f"{r['load_before']:.1f}")
    Console(width=160).print(table)
    from oal.rundir.files import atomic_write_json

    atomic_write_json(out, {"n": n, "rows": rows, "torch": torch.__version__, "environment": _common.environment()})
    _plot_sweep(rows, n, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)


def _plot_sweep(rows: list[dict], n: int, path: Path) -> None:
    """--sweep's figure: OAL's time against chunks per block, one line per dtype and chunk size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dt in sorted({r["dtype"] for r in rows}, reverse=True):
        for chunk in sorted({r["chunk"] for r in rows if r["dtype"] == dt}):
            pts = sorted((r["block_chunks"], r["time_s"]) for r in rows if r["dtype"] == dt and r["chunk"] == chunk)
            ax.semilogx(*zip(*pts, strict=True), "o-", base=2, label=f"{dt}, chunk {chunk}")
    ax.set(xlabel="chunks per block", ylabel="forward time (s)")
    finish_figure(fig, [ax], f"OAL chunked, N={n}: chunk size x chunks per block", path)


def compare(fixed_path: Path, tuned_path: Path) -> str:
    """The acceptance table (issue 36) of a run with the fixed defaults and one tuned, on one machine: sdpa/oal and
    % of GEMM side by side, each row's settings, and the goals. Printed, and written as markdown beside the tuned
    JSON (operator_tuning.md); returns the markdown."""
    runs = [_run_json(Path(p)) for p in (fixed_path, tuned_path)]
    cpu, tuned = runs[1]["cpu"], runs[1]
    lines = [f"CPU: {cpu['model']} ({cpu['capability']}; flags {' '.join(cpu['flags'])}; bf16 GEMMs "
             f"{'yes' if cpu.get('bf16_gemms') else 'no'}), {tuned['threads']} threads, {tuned['clock']} clock, "
             f"torch {tuned['torch']}; fixed: {_readout_label(runs[0]['cpu'])}; tuned: {_readout_label(cpu)}", "",
             "| dtype | N | settings (fixed / tuned) | sdpa/oal fixed | sdpa/oal tuned | goal | % of GEMM fixed | "
             "% of GEMM tuned | GEMM GFLOP/s | load |", "|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []

    def label(row):
        st = row["settings"]
        layout = ("pipeline" + (f"/kv{st['kv_groups']}" if st["kv_groups"] else "")) if st["pipeline"] else "serial"
        return f"{st['chunk']}x{st['block_chunks']} {layout}"

    for s in tuned["summary"]:
        f = next((r for r in runs[0]["summary"] if r["n"] == s["n"] and r["dtype"] == s["dtype"]), None)
        goal, gemm_goal = s.get("goal"), s.get("gemm_goal_pct")
        goal_txt = ", ".join(([f"{goal:g}"] if goal else []) + ([f"{gemm_goal:g}% of GEMM"] if gemm_goal else []))
        if s["dtype"] == "bfloat16" and not cpu.get("bf16_gemms"):
            goal_txt = "none (no bf16 GEMMs)"
        cells = [s["dtype"], str(s["n"]), f"{label(f) if f else '-'} / {label(s)}",
                 f"{f['ratio_sdpa_over_oal']:.2f}" if f else "-", f"{s['ratio_sdpa_over_oal']:.2f}", goal_txt,
                 f"{f['pct_of_gemm']:.0f}%" if f else "-", f"{s['pct_of_gemm']:.0f}%",
                 f"{s['gemm_gflops']:.0f}" + (f" ({s['gemm_dtype']})" if s.get("gemm_dtype", s["dtype"]) != s["dtype"]
                                               else ""),
                 f"{max(s['load'], f['load'] if f else 0):.1f}"]
        lines.append("| " + " | ".join(cells) + " |")
        if goal:
            verdicts.append(f"{s['dtype']} N={s['n']}: {s['ratio_sdpa_over_oal']:.2f} (goal {goal:g}) "
                            f"{'met' if s['ratio_sdpa_over_oal'] >= goal else 'NOT met'}")
        if gemm_goal:
            verdicts.append(f"{s['dtype']} N={s['n']}: {s['pct_of_gemm']:.0f}% of GEMM (goal {gemm_goal:g}%) "
                            f"{'met' if s['pct_of_gemm'] >= gemm_goal else 'NOT met'}")
    lines += ["", "Tuned: " + "; ".join(verdicts)]
    text = "\n".join(lines) + "\n"
    print(text)
    from oal.rundir.files import atomic_write_text

    atomic_write_text(Path(tuned_path).parent / "operator_tuning.md", text)
    return text


def _run_json(path: Path) -> dict:
    """A JSON this benchmark wrote (its table's fields present); ValueError naming the file otherwise."""
    try:
        run = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    keys = ("cpu", "summary", "threads", "clock", "torch")
    if not isinstance(run, dict) or any(k not in run for k in keys) or not isinstance(run["summary"], list):
        raise ValueError(f"{path}: not a run of benchmarks.operator (expected the keys {', '.join(keys)})")
    return run


def _tune(dtypes: list[str], force: bool) -> None:
    """Tune the operator to this machine for every dtype timed (cached: only what is missing or stale is measured),
    in a child process like every timing, so that this process holds no scratch memory or worker threads."""
    cmd = [sys.executable, "-m", "oal", "tune-cpu", "--threads", str(torch.get_num_threads()), "--dtypes",
           ",".join(dtypes), *(["--force"] if force else [])]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parent.parent)
    print("\n".join(x for x in (res.stderr.rstrip(), res.stdout.rstrip()) if x), file=sys.stderr)
    if res.returncode != 0:
        raise RuntimeError(f"`oal tune-cpu` failed (exit code {res.returncode}); its output is above")


def _readout_label(cpu: dict) -> str:
    """How the readout ran: the fused kernel (bf16 on AMX tiles, with bf16 dot products or widened) or the torch
    GEMM."""
    if not cpu.get("fused_readout"):
        return "torch readout (OAL_CPU_KERNEL=0 or no compiler)"
    bf16 = ", bf16 on AMX tiles" if cpu.get("amx") else ", bf16 dots" if cpu.get("bf16_dots") else ""
    return f"fused readout ({cpu.get('vector_width')}-wide{bf16})"


def _machine(dtypes: list[str]) -> tuple[dict, dict]:
    """The CPU (model, flags, torch's capability, bf16 GEMMs) and the operator settings of each dtype, as the
    children will run them."""
    import dataclasses

    from oal.ops import chunked, cpu_bf16, cpu_kernel, tuning

    cpu = tuning.cpu_info() | {"bf16_gemms": cpu_bf16(), "fused_readout": cpu_kernel.available(),
                               "bf16_dots": cpu_kernel.bf16_dots(), "amx": cpu_kernel.amx(),
                               "vector_width": cpu_kernel.vector_width()}
    settings = {}
    for dt in dtypes:
        s = chunked.current_settings(getattr(torch, dt))
        settings[dt] = dataclasses.asdict(s) | {"label": s.label(), "source": tuning.source(getattr(torch, dt))}
    return cpu, settings


def main(args: argparse.Namespace) -> None:
    dtypes = args.dtypes
    apply_timing_args(None, args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this torch sees no CUDA device")
    if args.compare:
        compare(*args.compare)
        return
    if args.child:
        from oal.ops import chunked, tuning

        forced = parse_settings(os.environ["OAL_BENCH_SETTINGS"]) if os.environ.get("OAL_BENCH_SETTINGS") else None
        if args.chunk or args.block_chunks:  # --sweep: one cell of the grid, whatever is tuned
            base = chunked.fixed_settings(getattr(torch, args.dtype))
            chunk = args.chunk or base.chunk
            forced = tuning.Settings(chunk, args.block_chunks or max(base.chunk * base.block_chunks // chunk, 1))
        with tuning.forced(forced):
            row = _measure(args.child[0], int(args.child[1]), args.repeats, args.device, getattr(torch, args.dtype))
        print(json.dumps(row))
        return
    if args.settings:
        pinned = parse_settings(args.settings)
        os.environ["OAL_BENCH_SETTINGS"] = args.settings  # read by every child
    if args.no_tune or args.settings:
        os.environ["OAL_NO_TUNE"] = "1"  # read by every child
    elif args.device == "cpu" and not args.sweep:
        _tune(dtypes, args.retune)
    if args.sweep:
        _sweep(args.sweep, args.repeats, args.device, dtypes, args.out)
        return

    from rich.console import Console
    from rich.table import Table

    lengths = args.lengths
    from oal.ops import tuning

    with tuning.forced(pinned if args.settings else None):
        cpu, settings = _machine(dtypes)
    if args.contention:
        from benchmarks import _contention

        _contention.run(_child, lengths, dtypes, args.repeats, args.device, args.out,
                        f"B=1, Hq=14, Hkv=2, d=dv=64, G=5, {args.device}, {torch.get_num_threads()} threads, "
                        f"{_common.CLOCK_NAME} clock")
        return
    rows = []
    for dt in dtypes:
        for n in lengths:
            for method in ("sdpa", "oal"):
                rows.append(_child(["--child", method, str(n), "--dtype", dt, "--repeats", str(args.repeats),
                                    "--device", args.device]))
                print(f"  {dt} {method:5s} N={n:6d} {rows[-1]['time_s']:.3f} s (load {rows[-1]['load_before']:.1f})",
                      file=sys.stderr)
    console = Console(width=160)
    summary = []
    for dt in dtypes:
        st = settings[dt]
        table = Table(title=f"OAL chunked vs SDPA, causal forward, {dt}, {args.device}, "
                            f"{torch.get_num_threads()} threads, {_common.CLOCK_NAME} clock\n{cpu['model']} "
                            f"({cpu['capability']}; {' '.join(cpu['flags'])}); {st['label']} ({st['source']}); "
                            f"{_readout_label(cpu)}")
        for col in ("N", "SDPA (s)", "OAL (s)", "sdpa/oal", "SDPA MiB", "OAL MiB", "OAL GFLOP/s", "GEMM GFLOP/s",
                    "% of GEMM", *PHASES, "other", "load"):
            table.add_column(col, justify="right")
        for n in lengths:
            s = next(r for r in rows if r["method"] == "sdpa" and r["n"] == n and r["dtype"] == dt)
            o = next(r for r in rows if r["method"] == "oal" and r["n"] == n and r["dtype"] == dt)
            gfs = oal_flops(n, dt, o["settings"]["chunk"]) / o["time_s"] / 1e9
            total = o["phases"]["total"]
            share = {p: o["phases"][p] / total for p in (*PHASES, "other")}
            summary.append({"n": n, "dtype": dt, "ratio_sdpa_over_oal": s["time_s"] / o["time_s"], "oal_gflops": gfs,
                            "gemm_gflops": o["gemm_gflops"], "pct_of_gemm": 100 * gfs / o["gemm_gflops"],
                            "phase_share": share,
                            "goal": goal_for(dt, n, args.device != "cpu" or cpu["bf16_gemms"]),
                            "gemm_dtype": o.get("gemm_dtype", dt),
                            "gemm_goal_pct": GEMM_GOAL.get(dt, {}).get(n), "settings": o["settings"],
                            "load": max(s["load_before"], o["load_before"], s["load_after"], o["load_after"])})
            table.add_row(str(n), f"{s['time_s']:.3f}", f"{o['time_s']:.3f}", f"{s['time_s'] / o['time_s']:.2f}",
                          f"{s['peak_mib']:.0f}", f"{o['peak_mib']:.0f}", f"{gfs:.0f}", f"{o['gemm_gflops']:.0f}",
                          f"{summary[-1]['pct_of_gemm']:.0f}%", *(f"{100 * share[p]:.0f}%" for p in (*PHASES, "other")),
                          f"{summary[-1]['load']:.1f}")
        console.print(table)
        oal_t = {r["n"]: r["time_s"] for r in rows if r["method"] == "oal" and r["dtype"] == dt}
        scaling = ", ".join(f"{oal_t[2 * n] / oal_t[n]:.2f}" for n in lengths if 2 * n in oal_t)
        if scaling:  # only where the lengths hold a doubling
            console.print(f"{dt}: OAL time(2N)/time(N) = {scaling}")
    goals = [f"{s['dtype']} N={s['n']}: {s['ratio_sdpa_over_oal']:.2f} (goal {s['goal']:g}) "
             f"{'met' if s['ratio_sdpa_over_oal'] >= s['goal'] else 'NOT met'}" for s in summary if s["goal"]]
    goals += [f"{s['dtype']} N={s['n']}: {s['pct_of_gemm']:.0f}% of GEMM (goal {s['gemm_goal_pct']:g}%) "
              f"{'met' if s['pct_of_gemm'] >= s['gemm_goal_pct'] else 'NOT met'}" for s in summary
              if s["gemm_goal_pct"]]
    if goals:
        console.print("goals: " + "; ".join(goals))
    if "bfloat16" in dtypes and args.device == "cpu" and not cpu["bf16_gemms"]:
        console.print("bfloat16: no goal on this CPU (no avx512_bf16 or AMX: bf16 inputs run the fp32 path, and "
                      "% of GEMM is against the fp32 rate)")
    from oal.rundir.files import atomic_write_json

    result = {"shape": SHAPE | {"B": 1}, "device": args.device, "threads": torch.get_num_threads(), "rows": rows,
              "summary": summary, "torch": torch.__version__, "cpu_count": os.cpu_count(), "clock": _common.CLOCK_NAME,
              "cpu": cpu, "tune": not (args.no_tune or args.settings), "settings": settings,
              "environment": _common.environment()}
    atomic_write_json(args.out, result)
    png = args.out.with_suffix(".png")
    _plot(rows, summary, png)
    print(f"wrote {args.out} and {png}", file=sys.stderr)


if __name__ == "__main__":
    run_tool(main, ARGS)
