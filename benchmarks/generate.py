"""Long-context generation: tokens/s and peak memory of converted models against the original (HF SDPA, KV cache).

Shapes (--shapes): SmolLM2-135M and Qwen2.5-0.5B, random weights of the published configs (decoding cost does not
depend on the values; --weights real loads SmolLM2-135M's own, fetched by `oal fetch smollm2-135m`), with
max_position_embeddings raised to cover the longest context. Methods (--methods):
  softmax   the original model: HF's SDPA attention with its DynamicCache (what `generate` uses);
  oal       the preset's conversion: `oal` with default (uncalibrated) kernels in registry.default_layers
            (SmolLM2-135M: layers 3-26, 24 of 30; Qwen2.5-0.5B: 3-20, 18 of 24);
  oal-swa   the recipe's conversion: `oal-swa` (window 64, 4 sinks, default kernels) in RECIPE_LAYERS (SmolLM2-135M:
            the 15 layers of the README's recipe; Qwen2.5-0.5B has no recipe: every other layer, 12 of 24).
Kernel values do not change the speed, so the kernels are not calibrated; the JSON says so.

Each context is set up without a full prefill (`_long_context`: a real 256-token prefill, so the converted layers'
states and windows are real, then random K/V of the context's length in the softmax layers). Then --warmup and
--tokens greedy steps; tokens/s = batch x timed steps / their time. Batches (--batches): numbers, and "max" for
the largest batch that fits the GPU (searched: an estimate from the cache's bytes per sequence, then smaller on
out-of-memory). Peak memory: torch.cuda.max_memory_allocated over the run (weights included); on the CPU, the
parameters' and the cache's bytes. Writes --out (JSON: rows of shape, method, context, batch, tokens_per_s,
peak_mib), a PNG beside it, and prints a table.

    python -m benchmarks.generate --out benchmarks/reference/generate_h200.json           # GPU: all of it
    python -m benchmarks.generate --device cpu --shapes smollm2-135m --weights real \\
        --methods softmax,oal-swa --contexts 32768 --batches 1 --tokens 20                 # the CPU recipe check
    python -m benchmarks.generate --device cpu --profile --methods oal-swa --contexts 8192  # where a step goes
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

from benchmarks._common import (
    MAX_THREADS,
    MAX_TOKENS,
    ToolParser,
    environment,
    int_in,
    list_of,
    output_file,
    run_tool,
)

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("softmax", "oal", "oal-swa")
CONTEXTS = (8192, 32768, 65536)
RECIPE_LAYERS = {"qwen2.5-0.5b": list(range(1, 24, 2)),
                 "smollm2-135m": [1, 2, 11, 12, 13, 15, 16, 19, 21, 22, 24, 25, 26, 27, 28]}
SHAPES = tuple(RECIPE_LAYERS)  # the shapes of `_long_context` (a test keeps them equal)
WINDOW = dict(window=64, sinks=4)


def parse_args(argv=None):
    ap = ToolParser(__doc__, "the JSON of the run (--out; default benchmarks/results/generate.json, rewritten after "
                    "every row, `complete` false until the end) and a PNG beside it; the table on stdout")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                    help="auto: cuda when torch sees a GPU")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated subset of {SHAPES}")
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {METHODS}")
    ap.add_argument("--contexts", type=list_of(int_in(1, MAX_TOKENS)), default=",".join(map(str, CONTEXTS)),
                    help="comma-separated context lengths")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes and/or 'max' (default: 1,max on "
                                                    "CUDA, 1 on the CPU)")
    ap.add_argument("--max-batch", type=int_in(1, 1 << 20), default=2048, help="cap of the batch search")
    ap.add_argument("--weights", choices=("random", "real"), default="random")
    ap.add_argument("--tokens", type=int_in(1, 100_000), default=8, help="timed decoding steps per row")
    ap.add_argument("--warmup", type=int_in(0, 1000), default=2, help="untimed steps first (compilation, caches)")
    ap.add_argument("--prompt", type=int_in(1, 1 << 20), default=256,
                    help="real tokens prefilled before the context is set")
    ap.add_argument("--threads", type=int_in(0, MAX_THREADS), default=0,
                    help="torch threads on the CPU (0: torch's default)")
    ap.add_argument("--profile", action="store_true", help="instead: break one decoding step down per layer type")
    ap.add_argument("--out", type=output_file, default=RESULTS / "generate.json", help="the JSON file (PNG beside it)")
    args = ap.parse_args(argv)
    args.shapes = _names(ap, "--shapes", args.shapes, SHAPES)
    args.methods = _names(ap, "--methods", args.methods, METHODS)
    # default: 1 on the CPU, 1,max on CUDA (`auto` is resolved in main, where torch is imported)
    args.batches = args.batches.split(",") if args.batches else ["1"] if args.device == "cpu" else None
    if bad := [b for b in args.batches or [] if b != "max" and not (b.isdigit() and int(b) >= 1)]:
        ap.error(f"--batches: expected positive integers or 'max', got {bad}")
    if "max" in (args.batches or []) and args.device == "cpu":
        ap.error("--batches: 'max' searches the GPU's memory; on the CPU give batch sizes")
    if args.prompt < WINDOW["window"] + WINDOW["sinks"]:
        ap.error(f"--prompt: at least {WINDOW['window'] + WINDOW['sinks']} tokens, so the windows are full")
    if args.weights == "real" and args.shapes != ["smollm2-135m"]:
        ap.error("--weights: real weights exist for --shapes smollm2-135m only")
    return args


def _names(ap, flag: str, value: str, allowed) -> list[str]:
    names = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in names if x not in allowed]
    if bad or not names:
        ap.error(f"{flag}: expected a subset of {allowed}, got {value!r}")
    return names


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import torch  # noqa: E402

from benchmarks import _long_context as lc  # noqa: E402


def convert(model, shape: str, method: str) -> list[int]:
    """Convert `model` in place for `method`; returns the converted layers."""
    from oal.models.convert import convert as oal_convert
    from oal.models.registry import default_layers

    if method == "softmax":
        return []
    layers = default_layers(model) if method == "oal" else RECIPE_LAYERS[shape]
    oal_convert(model, layers, method, **(WINDOW if method == "oal-swa" else {}))
    return layers


def attempt(model, context: int, batch: int, args) -> dict | None:
    """One run at `batch`; on a GPU, None when it runs out of memory."""
    if args.device != "cuda":
        return run(model, context, batch, args)
    try:
        return run(model, context, batch, args)
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        torch.cuda.empty_cache()


def largest_batch(model, context: int, one: dict, args) -> dict | None:
    """The run at the largest batch that fits: guessed from the batch-1 run's cache bytes and the free memory, then
    20% smaller on each out-of-memory (at most 6 tries)."""
    free = torch.cuda.mem_get_info()[0]
    per_seq = one["cache_bytes"] * (1 + 1 / model.config.num_hidden_layers) + 4 * model.config.vocab_size * 4
    batch = max(1, min(args.max_batch, int(0.9 * free / per_seq)))
    for _ in range(6):
        got = attempt(model, context, batch, args)
        if got is not None or batch == 1:
            return got
        batch = max(1, int(batch * 0.8))
    return None


def run(model, context: int, batch: int, args) -> dict:
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    cache = lc.long_cache(model, context, batch, prompt=args.prompt)
    res = lc.decode(model, cache, context, args.tokens, args.warmup)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    peak = torch.cuda.max_memory_allocated() if cuda else params + res["cache_bytes"]
    del cache
    return {"batch": batch, "tokens_per_s": res["tokens_per_s"], "peak_mib": peak / 2**20,
            "ms_per_step": 1e3 * sum(res["step_s"]) / len(res["step_s"]), "cache_bytes": res["cache_bytes"]}


def measure(args):
    """The rows, one at a time: per context in the order given (the first is the one a short time limit must
    reach: the script asks for 32k first), per shape, per method, per batch spec. A row whose run raises (other
    than running out of memory, which the batch search handles) is kept with the error in `skipped`."""
    from oal.models.folders import first_line

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    for context in args.contexts:
        for shape in args.shapes:
            for method in args.methods:
                # built on the device for each context: a second or two, and nothing held between contexts
                model, source = lc.build(shape, weights=args.weights, max_positions=max(args.contexts) + 1024,
                                         dtype=dtype, device=args.device)
                layers = convert(model, shape, method)
                one = None  # the batch-1 run: the batch search starts from its bytes per sequence
                for spec in args.batches:
                    error = None
                    try:
                        if spec == "max":
                            one = one or attempt(model, context, 1, args)
                            got = largest_batch(model, context, one, args) if one else None
                        else:
                            got = attempt(model, context, int(spec), args)
                            one = got if spec == "1" else one
                    except Exception as err:  # noted in the row; the other rows still run
                        got, error = None, first_line(err)[:200]
                    row = {"shape": shape, "method": method, "context": context, "batch_spec": spec,
                           "layers": layers, "source": source, "kernels": "default (uncalibrated)" if layers else None}
                    row |= got if got is not None else {"batch": None, "tokens_per_s": None, "peak_mib": None,
                                                        "skipped": error or "out of memory"}
                    print(f"  {shape:13s} {method:8s} ctx={context:6d} batch={row['batch']} "
                          f"{row['tokens_per_s'] or 0:10.1f} tok/s  {row['peak_mib'] or 0:9.0f} MiB"
                          + (f"  {error}" if error else ""), file=sys.stderr, flush=True)
                    yield row
                del model
                if args.device == "cuda":
                    torch.cuda.empty_cache()


def ratios(rows: list[dict]) -> list[dict]:
    """tokens/s of each conversion over softmax's, per shape, context and batch spec."""
    soft = {(r["shape"], r["context"], r["batch_spec"]): r["tokens_per_s"] for r in rows if r["method"] == "softmax"}
    out = []
    for r in rows:
        base = soft.get((r["shape"], r["context"], r["batch_spec"]))
        if r["method"] != "softmax" and base and r["tokens_per_s"]:
            out.append({k: r[k] for k in ("shape", "method", "context", "batch_spec")}
                       | {"speedup": r["tokens_per_s"] / base})
    return out


def goals(rows: list[dict], device: str) -> dict:
    """The issue's acceptance, on the measured rows (None: not measured)."""
    speed = {(r["shape"], r["method"], r["context"], r["batch_spec"]): r["speedup"] for r in ratios(rows)}
    if device == "cuda":
        return {f"{shape}: the preset's conversion at 32k, {what}": (None if (shape, "oal", 32768, spec) not in speed
                                                                     else speed[shape, "oal", 32768, spec] >= need)
                for shape in lc.SHAPES for spec, need, what in (("max", 3.0, ">= 3x softmax's tokens/s at the "
                                                                 "largest batch each fits"),
                                                                ("1", 1.0, "no slower than softmax at batch 1"))}
    key = ("smollm2-135m", "oal-swa", 32768, "1")
    return {"the recipe's model decodes >= 1.3x faster than softmax at 32k (CPU)":
            None if key not in speed else speed[key] >= 1.3}


def table(rows: list[dict], title: str):
    from rich.table import Table

    t = Table(title=title)
    for col in ("shape", "method", "context", "batch", "tokens/s", "ms/step", "peak MiB", "cache MiB", "vs softmax"):
        t.add_column(col, justify="right")
    speed = {(r["shape"], r["method"], r["context"], r["batch_spec"]): r["speedup"] for r in ratios(rows)}
    for r in rows:
        s = speed.get((r["shape"], r["method"], r["context"], r["batch_spec"]))
        t.add_row(r["shape"], r["method"], str(r["context"]), f"{r['batch']} ({r['batch_spec']})",
                  *(("-",) * 4 if r["tokens_per_s"] is None else (
                      f"{r['tokens_per_s']:.1f}", f"{r['ms_per_step']:.2f}", f"{r['peak_mib']:.0f}",
                      f"{r['cache_bytes'] / 2**20:.0f}")), "-" if s is None else f"{s:.2f}x")
    return t


def plot(rows: list[dict], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oal.pipeline.report_figures import method_color
    from oal.rundir.files import atomic_save_figure

    specs = sorted({r["batch_spec"] for r in rows})
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(len(shapes), 2 * len(specs), figsize=(5 * 2 * len(specs), 3.8 * len(shapes)),
                             squeeze=False)
    for i, shape in enumerate(shapes):
        for j, spec in enumerate(specs):
            for method in METHODS:
                pts = sorted((r["context"], r["tokens_per_s"], r["peak_mib"]) for r in rows if r["shape"] == shape
                       and r["method"] == method and r["batch_spec"] == spec and r["tokens_per_s"])
                if pts:
                    xs, tps, mib = zip(*pts, strict=True)
                    axes[i, 2 * j].plot(xs, tps, "o-", label=method, color=method_color(method))
                    axes[i, 2 * j + 1].plot(xs, mib, "o-", label=method, color=method_color(method))
            for ax, ylabel in ((axes[i, 2 * j], "tokens/s"), (axes[i, 2 * j + 1], "peak memory (MiB)")):
                ax.set(xscale="log", xlabel="context (tokens)", ylabel=ylabel, title=f"{shape}, batch {spec}")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=110)


def main(args: argparse.Namespace | list[str] | None = None) -> None:
    args = args if isinstance(args, argparse.Namespace) else parse_args(args)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device: cuda is not available here")
    if args.batches is None:
        args.batches = ["1", "max"] if args.device == "cuda" else ["1"]
    if "max" in args.batches and args.device != "cuda":
        raise ValueError("--batches: 'max' searches the GPU's memory; on the CPU give batch sizes")
    if args.threads:
        torch.set_num_threads(args.threads)
    from rich.console import Console

    from oal.rundir.files import atomic_write_json

    console, progress = Console(width=max(Console().width, 140)), Console(stderr=True)
    device = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    if args.profile:
        from benchmarks._decode_profile import profile_step

        console.print(profile_step(args, convert))
        return
    title = (f"Decoding on {device}, bf16" if args.device == "cuda"
             else f"Decoding on {device}, fp32, {torch.get_num_threads()} threads")
    t0 = time.time()
    rows = []
    env = environment()

    def record(interrupted: bool, complete: bool = True) -> dict:  # complete: False on the writes between rows
        return {"device": device, "torch": torch.__version__, "threads": torch.get_num_threads(), "environment": env,
                "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "speedups": ratios(rows),
                "goals": goals(rows, args.device), "interrupted": interrupted,
                "complete": complete and not interrupted, "elapsed_s": time.time() - t0}

    interrupted = False
    try:
        for row in measure(args):
            rows.append(row)
            atomic_write_json(args.out, record(False, complete=False))  # a kill after the INT keeps these
    except KeyboardInterrupt:
        interrupted = True
        progress.print("interrupted: reporting the rows measured so far")
    atomic_write_json(args.out, record(interrupted))
    console.print(table(rows, title))
    for goal, met in goals(rows, args.device).items():
        console.print(f"goal: {goal}: {'not measured' if met is None else 'met' if met else 'NOT met'}")
    if rows:
        plot(rows, title, args.out.with_suffix(".png"))
    progress.print(f"wrote {args.out} and {args.out.with_suffix('.png')}")


if __name__ == "__main__":
    run_tool(main, ARGS)
