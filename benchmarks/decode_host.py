"""Host time of one decoding step per attention layer at batch 1: softmax layers against converted ones.

At batch 1 a GPU finishes a small model's decoding kernels long before the host has issued them, so the step's
time is the host's: Python, torch's dispatch and the launches of every layer. A converted layer is no cheaper than
a softmax layer there unless its host side is no longer. This benchmark times each attention module's forward
(projections, RoPE, the cache and the attention itself) with forward hooks, the median over --steps greedy decoding
steps, in one model of 6 layers (random weights) whose odd layers are converted to --methods, so that both kinds of
layer run in the same steps. The projections and RoPE are the same in both kinds: the difference is the attention
and its cache. --shape: smollm2-135m (its published config; the default on CUDA) or tiny (SmolLM2-135M's heads, 9
query and 3 KV, at head size 16 and narrow layers; the default on the CPU, whose reads of the full shape's weights
at batch 1 take several hundred µs a module and would hide the host time).

  --device cuda   the real kernels; without synchronisation a module's wall time is its host time while the GPU
                  keeps up (batch 1, a short context).
  --device cpu    the CPU stands in for the device path (the default without a GPU): the Triton route of
                  `oal.ops` is taken with the device checks deferred, and the Triton kernels are stubbed out (their
                  launches do nothing, their outputs stay uninitialised), so what is timed is oal's host side
                  without Triton's own launch cost. The softmax layers' SDPA runs for real, on a short context.

Also the host time of one prefill call of the operator alone (`prefill`: a fresh sequence of --prefill-n tokens at
the Qwen2.5-0.5B head shape, Hq 14, Hkv 2, d 64, G 5; the parallel kernels' route), median of --steps calls, beside
a call whose length changes every call (no plan) and default SDPA's on CUDA: at 2k tokens CUDA events around a
call include the host's time to issue it.

--direct-launch (CUDA): each method timed again with OAL_TRITON_DIRECT_LAUNCH=1, the plans' kernels launched
through the compiled kernels' own launchers (`oal.ops.triton.launch`), in a row's `direct` entry (and the prefill
call in `prefill.oal_direct_us`).

Writes --out (JSON: rows of method, softmax_us, converted_us, difference_us, direct; `prefill`; rewritten after
each part, with `complete` false until the last write), a PNG beside it, and prints a table.

    python -m benchmarks.decode_host --out benchmarks/reference/decode_host_cpu.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import textwrap
import time
from pathlib import Path

from benchmarks._common import ToolParser, direct_launch, environment, int_in, list_of, output_file, run_tool

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("oal", "oal-swa", "swa")
LAYERS = 6  # odd ones converted
SHAPES = {"smollm2-135m": {"num_hidden_layers": LAYERS},
          "tiny": {"num_hidden_layers": LAYERS, "hidden_size": 144, "head_dim": 16, "intermediate_size": 64,
                   "vocab_size": 256}}


def parse_args(argv=None) -> argparse.Namespace:
    ap = ToolParser(__doc__, "the JSON of the run (--out; default benchmarks/results/decode_host.json) and a PNG "
                    "beside it; the table on stdout")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: cuda when torch sees a GPU, else the CPU stand-in")
    ap.add_argument("--shape", choices=tuple(SHAPES), default=None,
                    help="smollm2-135m (default on CUDA) or tiny (default on the CPU); see above")
    ap.add_argument("--methods", type=list_of(_method), default=",".join(METHODS),
                    help=f"comma-separated subset of {METHODS}")
    ap.add_argument("--steps", type=int_in(5, 100_000), default=200, help="timed decoding steps per method")
    ap.add_argument("--warmup", type=int_in(1, 1000), default=20, help="untimed steps first (plans, compilation)")
    ap.add_argument("--prompt", type=int_in(1, 4096), default=32, help="tokens prefilled before decoding")
    ap.add_argument("--direct-launch", action="store_true",
                    help="CUDA: also time each method with OAL_TRITON_DIRECT_LAUNCH=1 (see above)")
    ap.add_argument("--prefill-n", type=int_in(0, 4096), default=2048,
                    help="tokens of the timed prefill call (0: skip it)")
    ap.add_argument("--out", type=output_file, default=RESULTS / "decode_host.json",
                    help="the JSON file (PNG beside it)")
    return ap.parse_args(argv)


def _method(text: str) -> str:
    if text not in METHODS:
        raise argparse.ArgumentTypeError(f"expected one of {METHODS}, got {text!r}")
    return text


class _NoLaunch:
    """A stubbed Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def stand_in(active: bool):
    """Within: the CPU takes the device path of `oal.ops` (deferred checks, the Triton route) with the decoding
    kernels stubbed (TRITON_INTERPRET=1 set before they were imported). Nothing when not `active`."""
    if not active:
        yield
        return
    from unittest import mock

    import oal.ops
    from oal.ops import checks
    from oal.ops.triton import decode, guard, parallel, window_decode

    nop = _NoLaunch()
    patches = [(checks, "DEFERRED_DEVICES", {"cuda", "cpu"}),
               (oal.ops, "_auto_triton", lambda q, v, causal, chunk_size=None: causal),  # CUDA's route, on the CPU
               (decode, "_dec_step", nop), (decode, "_dec_out", nop), (window_decode, "_win_step", nop),
               (window_decode, "_win_out", nop), (guard, "_guard", nop), (parallel, "_par_fwd", nop)]
    with contextlib.ExitStack() as stack:
        for obj, name, value in patches:
            stack.enter_context(mock.patch.object(obj, name, value))
        yield


def measure(method: str, args, device: str, direct: bool = False) -> dict:
    """Median forward time (µs) of the softmax and of the converted attention modules over the timed steps;
    `direct`: with the plans' kernels launched directly (`oal.ops.triton.launch`)."""
    with direct_launch(direct, otherwise="0"):
        return _measure(method, args, device)


def _measure(method: str, args, device: str) -> dict:
    import torch

    from benchmarks._long_context import build
    from oal.models.cache import cache_kwargs
    from oal.models.convert import convert
    from oal.ops import checks

    model, _ = build("smollm2-135m", max_positions=4096, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
                     device=device, overrides=SHAPES[args.shape])
    converted = list(range(1, LAYERS, 2))
    convert(model, converted, method, **({} if method == "oal" else dict(window=64, sinks=4)))
    model.to(device)
    times: dict[str, list[float]] = {"softmax": [], "converted": []}
    timing = [False]

    def hook(module, kind):
        def pre(*_):
            module._oal_t0 = time.perf_counter()

        def post(*_):
            if timing[0]:
                times[kind].append(time.perf_counter() - module._oal_t0)

        module.register_forward_pre_hook(pre)
        module.register_forward_hook(post)

    for i, layer in enumerate(model.model.layers):
        hook(layer.self_attn, "converted" if i in converted else "softmax")
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids.to(device), **cache_kwargs(model, cache), use_cache=True)  # the prefill on the CPU's own path
        token = ids[:, -1:].to(device)
        with stand_in(device == "cpu"):
            for step in range(args.warmup + args.steps):
                timing[0] = step >= args.warmup
                model(token, **cache_kwargs(model, cache), use_cache=True)
            checks.check_errors()
    softmax, conv = (statistics.median(times[k]) * 1e6 for k in ("softmax", "converted"))
    return {"method": method, "softmax_us": softmax, "converted_us": conv, "difference_us": conv - softmax,
            "layers_timed": {k: len(v) // args.steps for k, v in times.items()}}


def prefill(args, device: str) -> dict:
    """Median host time (µs) of one oal_attention call on a fresh sequence (no gradient; from the second call on
    it runs its plan, `oal.ops.triton.prefill`), of one whose length changes every call (N and N - 1 in turn: the
    full path), with --direct-launch of one whose plan's kernels launch directly, and of default SDPA's on CUDA
    (on the CPU SDPA computes for real: not a host time)."""
    import torch
    import torch.nn.functional as F

    from oal.ops import checks, oal_attention

    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v = (torch.randn(1, h, args.prefill_n, 64, generator=gen).to(device, dtype) for h in (14, 2, 2))
    groups = torch.randint(0, 5, (14, 64), generator=gen).to(device)
    factor = (0.3 * torch.randn(14, 6, 6, generator=gen)).to(device)
    calls = {"oal": lambda: oal_attention(q, k, v, groups, factor)}
    # a length that changes every call (an evaluation's batches): the full path, no plan (a kernel of its own)
    shorter, changing_factor, turn = [t[:, :, :-1].contiguous() for t in (q, k, v)], factor.clone(), [0]

    def changing():
        turn[0] ^= 1
        return oal_attention(*(shorter if turn[0] else (q, k, v)), groups, changing_factor)

    calls["oal_changing"] = changing
    if args.direct_launch and device == "cuda":  # a new kernel tensor: a new plan, made with the variable set
        direct_factor = factor.clone()
        calls["oal_direct"] = lambda: oal_attention(q, k, v, groups, direct_factor)
    if device == "cuda":
        calls["sdpa"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    result = {"n": args.prefill_n, "oal_us": None, "oal_changing_us": None, "oal_direct_us": None, "sdpa_us": None}
    with torch.no_grad(), stand_in(device == "cpu"):
        for name, call in calls.items():
            times = []
            with direct_launch(name == "oal_direct", otherwise="0"):
                for step in range(args.warmup + args.steps):
                    if device == "cuda" and step % 20 == 0:
                        torch.cuda.synchronize()  # a bounded queue: the call's time is the host's
                    t0 = time.perf_counter()
                    call()
                    if step >= args.warmup:
                        times.append(time.perf_counter() - t0)
            result[f"{name}_us"] = statistics.median(times) * 1e6
        checks.check_errors()
    return result


def table(rows: list[dict], title: str):
    from rich.table import Table

    t = Table(title=title)
    direct = any(r.get("direct") for r in rows)
    cols = ("method", "softmax layer (µs)", "converted layer (µs)", "converted - softmax (µs)")
    for col in cols + (("direct launch: converted - softmax (µs)",) if direct else ()):
        t.add_column(col, justify="right")
    for r in rows:
        cells = [r["method"], f"{r['softmax_us']:.1f}", f"{r['converted_us']:.1f}", f"{r['difference_us']:+.1f}"]
        if direct:
            cells.append(f"{r['direct']['difference_us']:+.1f}" if r.get("direct") else "-")
        t.add_row(*cells)
    return t


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oal.rundir.files import atomic_save_figure

    fig, ax = plt.subplots(figsize=(6.5, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["softmax_us"] for r in rows], 0.4, label="softmax layer (same steps)")
    ax.bar([x + 0.2 for x in xs], [r["converted_us"] for r in rows], 0.4, label="converted layer")
    ax.set(xticks=list(xs), xticklabels=[r["method"] for r in rows], ylabel="attention module, µs per step")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(textwrap.fill(title, 80), fontsize=9)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=110)


def main(args: argparse.Namespace) -> int:
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda is not available here")
    args.shape = args.shape or ("smollm2-135m" if args.device == "cuda" else "tiny")
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # the stand-in's kernels (stubbed) are defined under the interpreter
    from rich.console import Console

    from oal.models.folders import first_line
    from oal.rundir.files import atomic_write_json

    if args.device == "cuda":
        name = torch.cuda.get_device_name()
    else:
        from oal.ops.tuning import cpu_info

        name = cpu_info()["model"]
    how = "real kernels, bf16" if args.device == "cuda" else "CPU stand-in, Triton kernels stubbed, fp32"
    title = f"Host time per attention layer, one decoding step at batch 1: {name} ({how}, {args.shape} shape)"
    rows = []
    record = {"device": name, "stand_in": args.device == "cpu", "torch": torch.__version__,
              "threads": torch.get_num_threads(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows,
              "prefill": None, "environment": environment(), "complete": False}  # True once every part ran
    failed = record["failed"] = {}  # what raised, by part: the other parts still run and are kept

    def attempt(part: str, fn):
        try:
            return fn()
        except Exception as err:
            failed[part] = first_line(err)[:200]
            Console(stderr=True).print(f"[red]{part} failed: {failed[part]}[/]")
            return None
        finally:
            atomic_write_json(args.out, record)  # after each part: a time-out keeps what finished

    for method in args.methods:
        row = attempt(method, lambda m=method: measure(m, args, args.device))
        if row is None:
            continue
        rows.append(row | {"direct": None})
        if args.direct_launch and args.device == "cuda":  # the stand-in's stubs compile nothing to launch directly
            again = attempt(f"{method} direct", lambda m=method: measure(m, args, args.device, direct=True))
            if again is not None:
                rows[-1]["direct"] = {k: again[k] for k in ("softmax_us", "converted_us", "difference_us")}
    if args.prefill_n:
        record["prefill"] = attempt("prefill", lambda: prefill(args, args.device))
    record["complete"] = True  # the writes before this one (after each part) are partial: cut short, they say so
    atomic_write_json(args.out, record)
    if rows:
        plot(rows, title, args.out.with_suffix(".png"))
    console = Console(width=140)
    console.print(table(rows, title))
    if record["prefill"]:
        p = record["prefill"]
        sdpa = "" if p["sdpa_us"] is None else f", default SDPA {p['sdpa_us']:.1f} µs"
        if p["oal_direct_us"] is not None:
            sdpa = f", launched directly {p['oal_direct_us']:.1f} µs" + sdpa
        sdpa = f" (its length changing every call: {p['oal_changing_us']:.1f} µs)" + sdpa
        console.print(f"prefill call, N = {p['n']} (Qwen2.5-0.5B heads): OAL {p['oal_us']:.1f} µs of host time{sdpa}")
    return 1 if failed else 0  # a part that raised fails the command (its message is in the JSON's "failed")


if __name__ == "__main__":
    run_tool(main, parse_args())
