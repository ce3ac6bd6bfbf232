"""GPU benchmark: the Triton OAL kernels against torch's default SDPA dispatch, what HF models call (issue 46).

Shape: the Qwen2.5-0.5B head shape (B=1, Hq=14, Hkv=2, d=dv=64), G=5, bf16, causal, N = 2k..128k. Methods:
  oal            oal_attention(backend="auto"): the parallel kernels up to routes.PARALLEL_MAX, the chunked above;
  oal_direct     oal with OAL_TRITON_DIRECT_LAUNCH=1 (forward, up to routes.PARALLEL_MAX: where a kept prefill plan
                 launches its kernels through their compiled launchers; elsewhere it is oal);
  oal_parallel   the parallel kernels forced (quadratic; up to --parallel-max-n), to place the crossover;
  oal_chunked    the chunked kernels forced;
  oal_chunked_prev  oal past routes.PARALLEL_MAX with the chunked kernels as they ran before 2026-12-05's changes
                 (function.HALF_STATES fp32: per-chunk states in fp32; function.NORM_DOTS off: the normaliser summed
                 in registers; function.HALF_PRODUCTS off: the features multiplied in fp32; function.FWD_CHUNKS
                 off: the forward at 64-token chunks, not 128): what those changes did, in the same run;
  sdpa           F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), torch's default
                 dispatch; which backend it picked is read off a torch.profiler trace of one call;
  sdpa_flash, sdpa_cudnn   one backend forced through torch.nn.attention.sdpa_kernel, where torch offers it;
  oal_factor     forward + backward with the kernel's factor trained too (joint adaptation; not in the default
                 --methods): oal_attention runs fp32 kernels then, as dfactor cancels (tests/test_numerics_outliers).
Forward (no autograd) and forward + backward (the gradients of q, k and v; the oal methods' factor frozen, as in
LoRA-only training, except oal_factor's). Times: CUDA events around each call, median of --repeats after
--warmup calls (the first calls compile and autotune); beside each forward time, the host's time to issue the call
(`<method>_fwd_host_ms`: where it exceeds the device's work, as at short lengths, the events measure the host).
Memory: torch.cuda.max_memory_allocated over one call, inputs included. Before timing, the kernels' bf16 output and
gradients are compared with the fp32 torch path (`sanity`), on both OAL routes.

Writes --out (JSON; `rows` hold n, oal_fwd_ms, sdpa_fwd_ms, oal_fwdbwd_ms, sdpa_fwdbwd_ms and the other methods'
times, null where not measured), a PNG beside it, and prints a table and the issue's goals.

    python -m benchmarks.gpu --out benchmarks/reference/gpu_h200.json     # N = 2k..128k
    python -m benchmarks.gpu --lengths 2048,16384 --no-backward            # quicker
    python -m benchmarks.gpu --profile 16384 --profile-out prof.txt       # kernel tables: one forward, one fwd+bwd
    python -m benchmarks.gpu --device cpu --lengths 64 --repeats 1        # smoke test (Triton's interpreter)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import time
from pathlib import Path
from unittest import mock

# one-line errors, exit code 2; --help names the outputs
from benchmarks._common import (
    MAX_TOKENS,
    ToolParser,
    direct_launch,
    environment,
    int_in,
    list_of,
    output_file,
    run_tool,
)

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = dict(B=1, hq=14, hkv=2, d=64, dv=64, g=5)
METHODS = ("oal", "oal_direct", "oal_parallel", "oal_chunked", "oal_chunked_prev", "sdpa", "sdpa_flash", "sdpa_cudnn",
           "oal_factor")
DEFAULT_METHODS = tuple(m for m in METHODS if m != "oal_factor")  # it compiles the fp32 kernels: asked for by name
LENGTHS = tuple(2048 << i for i in range(7))  # 2k .. 128k


def parse_args(argv=None):
    parser = ToolParser(__doc__, "the JSON of the run (--out; default benchmarks/results/gpu.json, rewritten after "
                        "every method, `complete` false until the end) and a PNG beside it; the table on stdout")
    parser.add_argument("--lengths", type=list_of(int_in(1, MAX_TOKENS)), default=",".join(map(str, LENGTHS)),
                        help="comma-separated N values")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per point (median)")
    parser.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                        help=f"comma-separated subset of {METHODS}")
    parser.add_argument("--parallel-max-n", type=int, default=32768, help="longest N for oal_parallel")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--sanity-n", type=int, default=2048, help="length of the accuracy check (0: skip)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke test of this script under Triton's interpreter (no numbers)")
    parser.add_argument("--out", type=output_file, default=RESULTS / "gpu.json", help="the JSON file (PNG beside it)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="instead: profile one OAL forward and one forward + backward at length N (kernel "
                             "tables) and write --profile-out")
    parser.add_argument("--profile-out", type=output_file, default=RESULTS / "gpu_profile.txt")
    parser.add_argument("--ncu-only", action="store_true",
                        help="with --profile: no tables, only the calls in the NVTX range oal_ncu, for Nsight "
                             "Compute (ncu --nvtx --nvtx-include oal_ncu/)")
    args = parser.parse_args(argv)
    for name in ("warmup", "parallel_max_n", "sanity_n", "profile"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')}: expected an integer >= 0, got {getattr(args, name)}")
    if args.repeats < 1:
        parser.error(f"--repeats: expected an integer >= 1, got {args.repeats}")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    if unknown := [m for m in args.methods if m not in METHODS]:
        parser.error(f"--methods: unknown {unknown}, expected a subset of {METHODS}")
    return args


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import torch  # noqa: E402

REQUIRED = ("oal_fwd_ms", "sdpa_fwd_ms", "oal_fwdbwd_ms", "sdpa_fwdbwd_ms")
MODES = {"fwd": False, "fwdbwd": True}


def inputs(n: int, device: str, *, grad: bool, seed: int = 0, train_factor: bool = False):
    """q, k, v (bf16), groups and a calibrated-looking factor (perturbed Taylor; trained where `train_factor`), and
    an output gradient."""
    from oal.ops.kernel import perturbed_factor, taylor_factor

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(SHAPE["B"], SHAPE["hq"], n, SHAPE["d"], generator=gen)
    k = torch.randn(SHAPE["B"], SHAPE["hkv"], n, SHAPE["d"], generator=gen)
    v = torch.randn(SHAPE["B"], SHAPE["hkv"], n, SHAPE["dv"], generator=gen)
    groups = torch.randint(0, SHAPE["g"], (SHAPE["hq"], SHAPE["d"]), generator=gen)
    factor = perturbed_factor(taylor_factor(SHAPE["hq"], SHAPE["g"]), 0.1, generator=gen)
    q, k, v = (t.to(device, torch.bfloat16).requires_grad_(grad) for t in (q, k, v))
    do = torch.randn(SHAPE["B"], SHAPE["hq"], n, SHAPE["dv"], generator=gen).to(device, torch.bfloat16)
    return q, k, v, groups.to(device), factor.to(device).requires_grad_(grad and train_factor), do


@contextlib.contextmanager
def triton_route(method: str):
    """Force the parallel (oal_parallel) or the chunked (oal_chunked) kernels; `oal` keeps the library's choice."""
    from oal.ops.triton import routes

    saved = routes.PARALLEL_MAX
    routes.PARALLEL_MAX = {"oal_parallel": 1 << 40, "oal_chunked": 0}.get(method, saved)
    try:
        yield
    finally:
        routes.PARALLEL_MAX = saved


@contextlib.contextmanager
def chunked_kernels(method: str):
    """The chunked kernels as before 2026-12-05 within (oal_chunked_prev: fp32 states, the normaliser summed in
    registers, fp32 feature products, the forward at the backward's 64-token chunks; restored after); nothing for
    the other methods."""
    from oal.ops.triton import function

    if method != "oal_chunked_prev":
        yield
        return
    with (mock.patch.object(function, "HALF_STATES", torch.float32), mock.patch.object(function, "NORM_DOTS", False),
          mock.patch.object(function, "HALF_PRODUCTS", False), mock.patch.object(function, "FWD_CHUNKS", False)):
        yield


def attention(method: str):
    """A function (q, k, v, groups, factor) -> out for one method."""
    import torch.nn.functional as F

    from oal.ops import oal_attention

    if method.startswith("oal"):
        backend = "auto" if method in ("oal", "oal_direct", "oal_chunked_prev", "oal_factor") else "triton"

        def oal(q, k, v, groups, factor):
            with triton_route(method), direct_launch(method == "oal_direct"), chunked_kernels(method):
                return oal_attention(q, k, v, groups, factor, backend=backend)

        return oal

    def sdpa(q, k, v, groups, factor):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    if method == "sdpa":
        return sdpa
    from torch.nn.attention import SDPBackend, sdpa_kernel

    forced = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}[method]

    def forced_sdpa(q, k, v, groups, factor):
        with sdpa_kernel(forced):
            return sdpa(q, k, v, groups, factor)

    return forced_sdpa


class Timer:
    """CUDA events on a GPU (device time between the two records), the host clock on the CPU. `host` keeps each
    call's host time (ms): on a GPU the time to issue its work, which the events include where the device waits
    for the host (short sequences)."""

    def __init__(self, device: str):
        self.cuda = device == "cuda"
        self.host: list[float] = []

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            res = fn()
            self.host.append(1e3 * (time.perf_counter() - t0))
            end.record()
            torch.cuda.synchronize()
            del res
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        fn()
        self.host.append(1e3 * (time.perf_counter() - t0))
        return self.host[-1]


def measure(method: str, n: int, backward: bool, args) -> dict:
    """Median time (ms) over `repeats` calls and the peak memory of one call (MiB; GPU only)."""
    fn = attention(method)
    q, k, v, groups, factor, do = inputs(n, args.device, grad=backward, train_factor=method == "oal_factor")

    def call():
        if backward:
            out = fn(q, k, v, groups, factor)
            leaves = (q, k, v) + ((factor,) if factor.requires_grad else ())
            return out, torch.autograd.grad(out, leaves, do)
        with torch.no_grad():
            return fn(q, k, v, groups, factor)

    timer = Timer(args.device)
    for _ in range(args.warmup):  # compilation, autotuning, allocator warm-up
        timer(call)
    timer.host.clear()
    times = [timer(call) for _ in range(args.repeats)]
    host = statistics.median(timer.host)
    peak = None
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        timer(call)
        peak = torch.cuda.max_memory_allocated() / 2**20
    return {"ms": statistics.median(times), "ms_all": times, "host_ms": host, "peak_mib": peak}


def skip_reason(method: str, n: int, args, backward: bool = False) -> str | None:
    from oal.ops.triton import routes

    if method == "oal_factor" and not backward:
        return "the forward (no gradient) is oal's"
    if method == "oal_direct" and (backward or n > routes.PARALLEL_MAX):
        return "no kept plan (a gradient, or past the parallel route): the same launches as oal"
    if method == "oal_chunked_prev" and n <= routes.PARALLEL_MAX:
        return "the parallel route runs no chunked kernel: the same kernels as oal"
    if method == "oal_parallel" and n > args.parallel_max_n:
        return f"N > --parallel-max-n {args.parallel_max_n} (quadratic)"
    if method == "sdpa_cudnn" and args.device != "cuda":
        return "cuDNN needs CUDA"
    return None


# (backend, substrings of an aten operator or kernel name), the first match wins: cuDNN's kernel names contain
# "flash" too, and the operators name the backend outright
BACKEND_NAMES = (
    ("cudnn", ("_scaled_dot_product_cudnn_attention", "cudnn")),
    ("flash", ("_scaled_dot_product_flash_attention", "flash")),
    ("efficient", ("_scaled_dot_product_efficient_attention", "efficient_attention", "fmha_cutlass")),
    ("math", ("_scaled_dot_product_attention_math", "softmax")),
)


def sdpa_backend(names) -> str:
    """The SDPA backend that a profiler trace's event names (aten operators and kernels) show, or 'unknown'."""
    lowered = [name.lower() for name in names]
    for backend, keys in BACKEND_NAMES:
        if any(key in name for name in lowered for key in keys):
            return backend
    return "unknown"


def default_backend(n: int, device: str) -> dict:
    """Which backend the default SDPA dispatch picks for the benchmark's inputs at length n (forward and
    backward), from the event names of a torch.profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, groups, factor, do = inputs(n, device, grad=True)
    fn = attention("sdpa")
    fn(q, k, v, groups, factor)  # warm-up outside the trace
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        out = fn(q, k, v, groups, factor)
        torch.autograd.grad(out, (q, k, v), do)
    names = sorted({evt.name for evt in prof.events()})
    kernels = [name for name in names if not name.startswith(("aten::", "autograd::", "cuda", "Memcpy", "Memset"))]
    return {"n": n, "backend": sdpa_backend(names), "kernels": kernels[:12]}


def sanity(device: str, n: int) -> dict:
    """The kernels (bf16) against the torch path (fp32) on the benchmark's inputs, on both routes: relative errors
    (in norm) of the output and of the q, k, v gradients with the factor frozen (the bf16 kernels), and of the
    factor's gradient with it trained (the fp32 kernels: `oal_attention` upcasts then), so that a wrong backward
    is not timed unnoticed."""
    q, k, v, groups, factor, do = inputs(n, device, grad=True, seed=1)

    def run(method, dtype, train_factor, backend=None):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        leaves.append(factor.detach().requires_grad_(train_factor))
        if backend:  # the torch path
            from oal.ops import oal_attention

            out = oal_attention(*leaves[:3], groups, leaves[3], backend=backend)
        else:
            out = attention(method)(*leaves[:3], groups, leaves[3])
        return [out, *torch.autograd.grad(out, leaves[:4] if train_factor else leaves[:3], do.to(out.dtype))]

    want = run("", torch.float32, True, backend="chunked")
    errs = {}
    for method in ("oal_parallel", "oal_chunked"):
        got = run(method, torch.bfloat16, False) + run(method, torch.bfloat16, True)[4:]
        errs[method] = {name: float((g.detach().float() - w.detach().float()).norm() / w.detach().float().norm())
                        for name, g, w in zip(("out", "dq", "dk", "dv", "dfactor"), got, want, strict=True)}
    return {"n": n, "rel_err_vs_chunked_fp32": errs}


def row_of(n: int, measured: dict) -> dict:
    """One JSON row: n, then <method>_<mode>_ms (null where not measured) and the peaks."""
    row = {"n": n}
    for method in METHODS:
        for mode in MODES:
            r = measured.get((method, n, mode), {})
            row[f"{method}_{mode}_ms"] = r.get("ms")
            if mode == "fwd":
                row[f"{method}_peak_mib"] = r.get("peak_mib")
                row[f"{method}_fwd_host_ms"] = r.get("host_ms")  # the host's share (issuing the call)
    return row


def schema_errors(record: dict) -> list[str]:
    """What keeps `record` from the schema the issue asks for (empty when it fits)."""
    errors = []
    rows = record.get("rows")
    if not isinstance(rows, list):
        return ["rows: expected a list"]
    for i, row in enumerate(rows):
        if not isinstance(row.get("n"), int) or isinstance(row.get("n"), bool):
            errors.append(f"rows[{i}].n: expected an int")
        for key in REQUIRED:
            if key not in row or not (row[key] is None or isinstance(row[key], float)):
                errors.append(f"rows[{i}].{key}: expected a float (null where not measured)")
    return errors


def goals(rows: list[dict]) -> dict:
    """The issue's acceptance on an H200, checked on the measured rows (None: not measured)."""
    by_n = {r["n"]: r for r in rows}

    def ratio(n, mode):
        r = by_n.get(n, {})
        sdpa, oal = r.get(f"sdpa_{mode}_ms"), r.get(f"oal_{mode}_ms")
        return sdpa / oal if sdpa and oal else None

    def from_16k(mode):
        vals = [ratio(n, mode) for n in by_n if n >= 16384 and ratio(n, mode) is not None]
        return all(v >= 1 for v in vals) if vals else None

    def at(n, mode, x):
        val = ratio(n, mode)
        return None if val is None else val >= x

    fwd_2k = by_n.get(2048, {}).get("oal_fwd_ms")
    return {
        "forward >= default SDPA from 16k": from_16k("fwd"),
        "forward >= 3x default SDPA at 64k": at(65536, "fwd", 3),
        "forward >= 6x default SDPA at 128k": at(131072, "fwd", 6),
        "forward + backward >= default SDPA from 16k": from_16k("fwdbwd"),
        "forward at 2k under 0.3 ms": None if fwd_2k is None else fwd_2k < 0.3,
    }


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oal.rundir.files import atomic_save_figure

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for method in METHODS:
        for ax, mode in zip(axes[:2], MODES, strict=True):
            pts = [(r["n"], r[f"{method}_{mode}_ms"]) for r in rows if r.get(f"{method}_{mode}_ms")]
            if pts:
                ax.loglog(*zip(*pts, strict=True), "o-", label=method, base=2)
    for mode in MODES:
        pts = [(r["n"], r[f"sdpa_{mode}_ms"] / r[f"oal_{mode}_ms"]) for r in rows
               if r.get(f"sdpa_{mode}_ms") and r.get(f"oal_{mode}_ms")]
        if pts:
            axes[2].semilogx(*zip(*pts, strict=True), "o-", label=mode, base=2)
    axes[2].axhline(1.0, color="grey", lw=0.8)
    for ax, name, ylabel in ((axes[0], "Causal forward", "time (ms)"), (axes[1], "Forward + backward", "time (ms)"),
                             (axes[2], "default SDPA / OAL (above 1: OAL faster)", "ratio")):
        ax.set(xlabel="sequence length N", ylabel=ylabel, title=name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)


def table(rows: list[dict], title: str, backend: str):
    from rich.table import Table

    t = Table(title=title)
    cols = [("N", None), (f"sdpa ({backend})", "sdpa_fwd"), ("OAL", "oal_fwd"), ("OAL host", "oal_fwd_host"),
            ("sdpa/OAL", "ratio_fwd"), ("OAL direct", "oal_direct_fwd"),
            ("flash", "sdpa_flash_fwd"), ("cudnn", "sdpa_cudnn_fwd"), ("OAL parallel", "oal_parallel_fwd"),
            ("OAL chunked", "oal_chunked_fwd"), ("OAL chunked prev", "oal_chunked_prev_fwd"),
            ("sdpa f+b", "sdpa_fwdbwd"), ("OAL f+b", "oal_fwdbwd"),
            ("sdpa/OAL f+b", "ratio_fwdbwd")]
    for name, _ in cols:
        t.add_column(name, justify="right")
    for r in rows:
        cells = [str(r["n"])]
        for _, key in cols[1:]:
            if key.startswith("ratio"):
                mode = key.removeprefix("ratio_")
                sdpa, oal = r.get(f"sdpa_{mode}_ms"), r.get(f"oal_{mode}_ms")
                cells.append(f"{sdpa / oal:.2f}" if sdpa and oal else "-")
            else:
                val = r.get(f"{key}_ms")
                cells.append("-" if val is None else f"{val:.3f}")
        t.add_row(*cells)
    return t


NCU_RANGE = "oal_ncu"  # the NVTX range around the calls for Nsight Compute (`ncu --nvtx --nvtx-include oal_ncu/`)


def profile_calls(n: int, device: str, out: Path | None, tables: bool = True) -> str:
    """Kernel tables (torch.profiler, top 15 by device time) of one OAL forward and one forward + backward at length
    n, written to `out`; then, on CUDA, one more of each inside the NVTX range NCU_RANGE, after every compile and
    autotuning, for Nsight Compute to profile those kernels alone (scripts/gpu_perf.sh with NCU=1). Without
    `tables` only the warm-up and the marked calls: torch.profiler's CUPTI would collide with Nsight Compute's."""
    from torch.profiler import ProfilerActivity, profile

    q, k, v, groups, factor, do = inputs(n, device, grad=True)
    fn = attention("oal")

    def forward():
        with torch.no_grad():
            return fn(q, k, v, groups, factor)

    def both():  # the q, k, v gradients, the factor frozen: the half kernels, as the timed rows
        return torch.autograd.grad(fn(q, k, v, groups, factor), (q, k, v), do)

    key = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    text = ""
    for name, call, times in (("forward", forward, 5), ("forward + backward", both, 3)):
        for _ in range(3):  # compile and autotune outside the trace
            call()
        if not tables:
            continue
        with profile(activities=activities) as prof:
            for _ in range(times):
                call()
            if device == "cuda":
                torch.cuda.synchronize()
        text += (f"OAL {name}, N={n}, B=1 Hq=14 Hkv=2 d=dv=64 G=5 bf16, {times} calls, {device}\n"
                 + prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60) + "\n")
    if device == "cuda":
        torch.cuda.synchronize()
        with torch.cuda.nvtx.range(NCU_RANGE):
            forward()
            both()
        torch.cuda.synchronize()
    if out is not None:
        from oal.rundir.files import atomic_write_text

        atomic_write_text(out, text)
    return text


def tuning(device: str) -> dict | None:
    """The chunked kernels' tiles and the autotuners' picks so far (CUDA only: the interpreter runs fixed tiles)."""
    if device != "cuda":
        return None
    from oal.ops.triton import function, tiles

    return function.tuning_record(SHAPE["d"], SHAPE["dv"], tiles.device_arch(torch.device("cuda")))


def _versions() -> dict:
    import triton

    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}


def main(args: argparse.Namespace | list[str] | None = None) -> None:
    args = args if isinstance(args, argparse.Namespace) else parse_args(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda is not available here (torch.cuda.is_available() is False); run it on a "
                         "GPU machine, or --device cpu for a smoke test")
    if args.device == "cpu":  # the smoke test runs the kernels under Triton's interpreter (read when they are defined)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from rich.console import Console

    from oal.models.folders import first_line
    from oal.ops.triton import routes
    from oal.rundir.files import atomic_write_json

    console, progress = Console(width=max(Console().width, 160)), Console(stderr=True)
    if args.profile:
        if args.ncu_only:
            profile_calls(args.profile, args.device, None, tables=False)
        else:
            console.print(profile_calls(args.profile, args.device, args.profile_out))
        return
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    title = f"Causal attention, {device_name}, bf16, B=1 Hq=14 Hkv=2 d=dv=64 G=5 (ms)"
    t0 = time.time()
    measured: dict = {}
    skipped: dict = {}
    try:
        check = sanity(args.device, args.sanity_n) if args.sanity_n else None
    except Exception as err:  # noted; the timings still run
        skipped["sanity"] = check = first_line(err)[:200]
        console.print(f"[bold red]sanity failed: {check}[/]")
    if isinstance(check, dict):
        for route, errs in check["rel_err_vs_chunked_fp32"].items():
            console.print(f"sanity ({route}, bf16 vs fp32 torch, N={check['n']}): "
                          + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
            if not all(err < 5e-2 for err in errs.values()):
                console.print(f"[bold red]sanity: {route} has an error above 5e-2: wrong on this device[/]")
    picked = default_backend(min(args.lengths), args.device)
    env = environment()
    console.print(f"default SDPA picks: {picked['backend']} (kernels: {', '.join(picked['kernels'][:4])})")

    def record(interrupted: bool, complete: bool = True) -> dict:  # complete: False on the writes between methods
        rows = [row_of(n, measured) for n in args.lengths if any(key[1] == n for key in measured)]
        return {"shape": SHAPE | {"dtype": "bfloat16", "causal": True}, "device": device_name,
                "versions": _versions(), "host": platform.node(), "environment": env,
                "parallel_max": routes.PARALLEL_MAX,
                "default_sdpa_backend": picked, "sanity": check, "rows": rows, "skipped": skipped,
                "tuning": tuning(args.device),
                "goals": goals(rows), "args": {k: str(v) for k, v in vars(args).items()},
                "interrupted": interrupted, "complete": complete and not interrupted,
                "elapsed_s": time.time() - t0}

    interrupted = False
    try:
        for n in args.lengths:
            for mode, backward in MODES.items():
                if backward and args.no_backward:
                    continue
                for method in args.methods:
                    reason = skip_reason(method, n, args, backward)
                    if reason is None:
                        try:
                            measured[method, n, mode] = measure(method, n, backward, args)
                        except Exception as err:  # out of memory, no cuDNN kernel here, a kernel that fails: noted
                            reason = first_line(err)[:200]
                        if args.device == "cuda":
                            torch.cuda.empty_cache()
                    if reason:
                        skipped[f"{method} {mode} {n}"] = reason
                    r = measured.get((method, n, mode))
                    progress.print(f"  {method:13s} {mode:7s} N={n:7d} " + (f"{r['ms']:9.3f} ms" if r else reason))
                    atomic_write_json(args.out, record(False, complete=False))  # a time-out keeps what finished
    except KeyboardInterrupt:  # a time limit (timeout --signal=INT): report what was measured
        interrupted = True
        progress.print("interrupted: reporting the lengths measured so far")
    result = record(interrupted)
    if errors := schema_errors(result):
        console.print(f"[bold red]schema: {errors}[/]")
    atomic_write_json(args.out, result)
    console.print(table(result["rows"], title, picked["backend"]))
    for goal, met in result["goals"].items():
        console.print(f"goal: {goal}: {'not measured' if met is None else 'met' if met else 'NOT met'}")
    if result["rows"]:
        plot(result["rows"], title, args.out.with_suffix(".png"))
    progress.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    run_tool(main, ARGS)
