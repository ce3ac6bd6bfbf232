"""Benchmark: per-token decode time against context length, converted (recurrent OAL state) vs softmax (KV cache).

Models (`--shape`): the embedded default model (or, when it is not built yet, a randomly initialised model of its
shape: Qwen2, 6 layers, hidden 256, 4 query / 2 KV heads, head_dim 64; the JSON says which), and Qwen2.5-0.5B's
shape with random weights (24 layers, hidden 896, 14 query / 2 KV heads, head_dim 64, vocabulary 151,936; decode
cost does not depend on the weights' values). Three variants of each:
  softmax   - the base model, K/V cache in every layer;
  oal       - App. F conversion: every layer but the first and last (hybrid: 2 softmax layers keep K/V);
  oal-all   - every layer converted (pure recurrent decoding).
For a context of L tokens the cache is set up directly instead of prefilling L tokens (decode cost depends only on
the cache's size; `_long_context`): 64 real prompt tokens are prefilled, then softmax layers get random K/V of length
L and converted layers keep their real state with the token count set to L (the state's size does not depend on
L); decoding continues at position L. For long-context generation at batch sizes, on a GPU too, and the recipe's
sliding-window conversion: `benchmarks.generate`. RoPE's max_position_embeddings is raised to cover the longest
context (at least 40k). Times are medians over tokens, `--threads` torch threads (default: torch's). Writes --out
(default benchmarks/results/decode.json), a PNG beside it and prints a table per shape.

    .venv/bin/python -m benchmarks.decode                       # quick: 1k, 4k, 32k; both shapes
    .venv/bin/python -m benchmarks.decode --full                # 1k, 2k, 4k, 8k, 16k, 32k
    .venv/bin/python -m benchmarks.decode --shape default --threads 1
    .venv/bin/python -m benchmarks.decode --shape default --lengths 128,256 --tokens 2 --out /tmp/decode.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
from pathlib import Path

from benchmarks._common import MAX_THREADS, MAX_TOKENS, ToolParser, environment, int_in, list_of, output_file, run_tool

SHAPES = ("default", "qwen2.5-0.5b")
VARIANTS = ("softmax", "oal", "oal-all")
RESULTS = Path(__file__).resolve().parent / "results"
QUICK, FULL = [1024, 4096, 32768], [1024, 2048, 4096, 8192, 16384, 32768]  # the contexts without --lengths


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, checked before the heavy imports (one-line errors, exit code 2; --help names the outputs)."""
    ap = ToolParser(__doc__, "the JSON (--out; default benchmarks/results/decode.json) and a PNG beside it; a table "
                    "per shape on stdout")
    ap.add_argument("--full", action="store_true", help="1k..32k in powers of two (default: 1k, 4k, 32k)")
    ap.add_argument("--lengths", type=list_of(int_in(1, MAX_TOKENS)),
                    help="comma-separated context lengths instead of the default or --full ones")
    ap.add_argument("--tokens", type=int_in(1, 10_000), default=None,
                    help="timed tokens per context (default 5, full 15)")
    ap.add_argument("--threads", type=int_in(0, MAX_THREADS), default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--shape", choices=(*SHAPES, "both"), default="both")
    ap.add_argument("--out", type=output_file, default=str(RESULTS / "decode.json"), help="the JSON to write (default "
                    "benchmarks/results/decode.json; the PNG beside it)")
    args = ap.parse_args(argv)
    if args.lengths and args.full:
        ap.error("--lengths: not with --full (which picks the lengths)")
    return args


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from benchmarks import _long_context as lc  # noqa: E402
from oal.models.cache import state_nbytes  # noqa: E402
from oal.models.convert import convert  # noqa: E402
from oal.models.registry import default_layers  # noqa: E402
from oal.rundir.files import atomic_save_figure, atomic_write_json  # noqa: E402

MAX_POS = 40_000  # at least; raised to cover the longest context (`base_model`)


def base_model(shape: str = "default", max_pos: int = MAX_POS):
    if shape == "qwen2.5-0.5b":
        return lc.build(shape, max_positions=max_pos)
    try:
        from oal.models.registry import load_model

        model, _, prov = load_model("default")
        source = f"embedded default model ({prov.get('path')})"
    except Exception as exc:  # the embedded model may not be built yet
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=259, hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
        model = Qwen2ForCausalLM(cfg).eval()
        source = f"random init of the embedded model's shape (embedded model unavailable: {exc})"
    model.config.max_position_embeddings = max_pos
    return model.eval(), source


def variant(name: str, shape: str = "default", max_pos: int = MAX_POS):
    model, source = base_model(shape, max_pos)
    n = model.config.num_hidden_layers
    if name == "oal":
        convert(model, default_layers(model), "oal")
    elif name == "oal-all":
        convert(model, list(range(n)), "oal")
    return model, source


def decode_time(model, context: int, tokens: int, warmup: int = 2) -> tuple[float, dict[int, int]]:
    """Median seconds per decoded token at `context` (`_long_context`: 64 real prompt tokens, then the context's
    K/V), and the cache's bytes per layer."""
    cache = lc.long_cache(model, context, prompt=64)
    res = lc.decode(model, cache, context, tokens, warmup)
    return statistics.median(res["step_s"]), state_nbytes(cache)


def measure(shape: str, contexts: list[int], tokens: int) -> dict:
    record = {"variants": {}}
    max_pos = max(MAX_POS, max(contexts) + tokens + 2)  # decode's 2 warm-up steps and the timed ones
    for name in VARIANTS:
        model, source = variant(name, shape, max_pos)
        record["source"] = source
        rows = []
        for ctx in contexts:
            t, mem = decode_time(model, ctx, tokens)
            rows.append({"context": ctx, "ms_per_token": 1e3 * t, "cache_bytes": sum(mem.values()),
                         "cache_bytes_per_layer": mem})
        record["variants"][name] = rows
        del model
    soft = {r["context"]: r["ms_per_token"] for r in record["variants"]["softmax"]}
    record["speedup_vs_softmax"] = {
        name: {str(r["context"]): soft[r["context"]] / r["ms_per_token"] for r in rows}
        for name, rows in record["variants"].items() if name != "softmax"
    }
    return record


def plot(shapes: dict, path: Path) -> None:
    fig, axes = plt.subplots(len(shapes), 2, figsize=(10, 3.8 * len(shapes)), squeeze=False)
    # in a fixed order, not the dicts': a JSON read back is key-sorted, and the figure is the one redrawn from it
    for row, shape in zip(axes, [s for s in SHAPES if s in shapes], strict=True):
        record = shapes[shape]
        for name in [v for v in VARIANTS if v in record["variants"]]:
            rows = sorted(record["variants"][name], key=lambda r: r["context"])
            xs = [r["context"] for r in rows]
            row[0].plot(xs, [r["ms_per_token"] for r in rows], marker="o", label=name)
            row[1].plot(xs, [r["cache_bytes"] / 2**20 for r in rows], marker="o", label=name)
        for ax, label in zip(row, ("decode time per token (ms)", "cache size (MiB)"), strict=True):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("context length (tokens)")
            ax.set_ylabel(label)
            ax.set_title(shape)
            ax.grid(alpha=0.3)
            ax.legend()
    fig.suptitle("Per-token decoding on CPU: recurrent OAL state vs softmax KV cache")
    fig.tight_layout()
    atomic_save_figure(fig, path, dpi=120)


def table(shape: str, record: dict, contexts: list[int], threads: int, tokens: int) -> Table:
    t = Table(title=f"{shape}: decode ms/token, {threads} thread(s), median of {tokens} tokens")
    t.add_column("context", justify="right")
    for name in record["variants"]:
        t.add_column(f"{name} ms", justify="right")
    t.add_column("softmax / oal", justify="right")
    t.add_column("softmax / oal-all", justify="right")
    for i, ctx in enumerate(contexts):
        cells = [f"{record['variants'][n][i]['ms_per_token']:.2f}" for n in record["variants"]]
        t.add_row(str(ctx), *cells, f"{record['speedup_vs_softmax']['oal'][str(ctx)]:.2f}x",
                  f"{record['speedup_vs_softmax']['oal-all'][str(ctx)]:.2f}x")
    return t


def main(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    contexts = sorted(set(args.lengths)) if args.lengths else FULL if args.full else QUICK
    tokens = args.tokens or (15 if args.full else 5)
    shapes = SHAPES if args.shape == "both" else (args.shape,)
    record = {"contexts": contexts, "tokens": tokens, "threads": torch.get_num_threads(),
              "machine": platform.processor() or platform.machine(),
              "shapes": {shape: measure(shape, contexts, tokens) for shape in shapes}, "environment": environment()}
    atomic_write_json(args.out, record)
    plot(record["shapes"], args.out.with_suffix(".png"))
    console = Console()
    for shape, rec in record["shapes"].items():
        console.print(table(shape, rec, contexts, record["threads"], tokens))
        console.print(f"model: {rec['source']}")


if __name__ == "__main__":
    run_tool(main, ARGS)
