"""End-to-end latency: prefill and per-token decode, converted (OAL) against softmax (SDPA), on CPU.

Models:
  qwen     - Qwen2.5-0.5B's shape with random weights, built from its config (no download): hidden 896, 24 layers,
             14 query / 2 KV heads, head_dim 64, intermediate 4864, vocab 151936, rope_theta 1e6, tied embeddings;
             the paper's layers 3..20 converted (App. F);
  default  - the embedded default model, its default layers converted.
Converted layers get random but valid kernels: per head 2..5 groups (ids drawn at random, unused ids allowed, as
calibrated heads have) and a perturbed Taylor factor, through `oal.convert` with `OALMethod` instances. Latency does
not depend on the kernel's values.

For each context length L a fresh subprocess builds the model (same seed, so both variants share weights), warms up,
then times one prefill of L random tokens (`use_cache=True`, logits of the last position only, as `generate`
does), then decodes `--decode-tokens` tokens on that cache (median ms per token). Peak memory is the peak RSS
during prefill and decode above the RSS before them (sampled from /proc every 2 ms).
Writes benchmarks/results/model.{json,png} and prints a table.

    python -m benchmarks.model                                  # both models, L = 1k..32k (long: hours on 2 cores)
    python -m benchmarks.model --models qwen --max-len 4096     # quicker
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks._common import PeakRSS, add_timing_args, apply_timing_args, clock, finish_figure, timing_flags

RESULTS = Path(__file__).resolve().parent / "results"
QWEN_SHAPE = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                  intermediate_size=4864, vocab_size=151936, rope_theta=1e6, tie_word_embeddings=True,
                  max_position_embeddings=40_000)
GOALS = {("qwen", "prefill", 32768): 2.0, ("qwen", "decode", 32768): 3.0}  # issue 18: softmax / converted


def random_kernels(model, layers, seed: int = 0, max_groups: int = 5) -> dict:
    """layer -> OALMethod with 2..max_groups groups per head (random ids) and a perturbed Taylor factor."""
    from oal.methods.oal import OALMethod
    from oal.ops.kernel import perturbed_factor, taylor_factor

    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    gen = torch.Generator().manual_seed(seed)
    methods = {}
    for i in layers:
        counts = torch.randint(2, max_groups + 1, (hq, 1), generator=gen)
        groups = (torch.rand(hq, d, generator=gen) * counts).long()  # head h uses ids < counts[h]
        factor = perturbed_factor(taylor_factor(hq, max_groups), 0.1, generator=gen)
        methods[i] = OALMethod(hq, hkv, d, groups=groups, factor=factor, layer_idx=i)
    return methods


def build(name: str, variant: str, dtype: torch.dtype):
    """(model, description) for one model and variant ("softmax" or "oal")."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from oal.models.convert import convert, default_layers

    torch.manual_seed(0)
    if name == "qwen":
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN_SHAPE)).to(dtype)
        desc = "Qwen2.5-0.5B shape, random weights"
    else:
        from oal.models.registry import load_model

        model, _, prov = load_model("default", dtype=dtype)
        model.config.max_position_embeddings = QWEN_SHAPE["max_position_embeddings"]
        desc = f"embedded default model ({prov['sha256'].get('model.safetensors', '?')[:12]})"
    model.eval()
    layers = default_layers(model)
    if variant == "oal":
        convert(model, methods=random_kernels(model, layers))
    return model, desc, layers


@torch.no_grad()
def measure(name: str, variant: str, length: int, decode_tokens: int, dtype: torch.dtype) -> dict:
    """Runs in the child: one prefill of `length` tokens, then `decode_tokens` decode steps on its cache."""
    from transformers import DynamicCache

    model, desc, layers = build(name, variant, dtype)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)

    def prefill(n):
        ids = torch.randint(0, vocab, (1, n), generator=gen)
        cache = DynamicCache(config=model.config)
        t0 = clock()
        out = model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return clock() - t0, out.logits[:, -1:].argmax(-1), cache

    def decode(tok, cache, start, steps):
        times = []
        for i in range(steps):
            pos = torch.tensor([[start + i]])
            t0 = clock()
            logits = model(tok, past_key_values=cache, use_cache=True, position_ids=pos).logits
            times.append(clock() - t0)
            tok = logits[:, -1:].argmax(-1)
        return times

    _, tok, cache = prefill(min(length, 300))  # warm-up: both the dense (short) and the chunked operator paths
    decode(tok, cache, min(length, 300), 2)
    del cache
    load = os.getloadavg()[0]
    with PeakRSS() as mem:
        prefill_s, tok, cache = prefill(length)
        decode_s = decode(tok, cache, length, decode_tokens)
    return {"model": name, "variant": variant, "length": length, "dtype": str(dtype).replace("torch.", ""),
            "prefill_s": prefill_s, "decode_ms": 1e3 * statistics.median(decode_s),
            "decode_ms_all": [1e3 * t for t in decode_s], "peak_mib": mem.peak_mib,
            "load_before": load, "load_after": os.getloadavg()[0], "threads": torch.get_num_threads(),
            "description": desc, "converted_layers": layers if variant == "oal" else []}


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for (model, variant), style in zip(sorted({(r["model"], r["variant"]) for r in rows}), ("o-", "s--") * 4,
                                       strict=False):
        pts = sorted((r["length"], r) for r in rows if r["model"] == model and r["variant"] == variant)
        xs = [p[0] for p in pts]
        label = f"{model} {variant}"
        axes[0].loglog(xs, [p[1]["prefill_s"] for p in pts], style, label=label, base=2)
        axes[1].semilogx(xs, [p[1]["decode_ms"] for p in pts], style, label=label, base=2)
        axes[2].semilogx(xs, [p[1]["peak_mib"] for p in pts], style, label=label, base=2)
    axes[0].set(xlabel="context length", ylabel="prefill time (s)", title="Prefill")
    axes[1].set(xlabel="context length", ylabel="ms per token", title="Decode, per token")
    axes[2].set(xlabel="context length", ylabel="peak RSS above the loaded model (MiB)", title="Peak memory")
    finish_figure(fig, axes, "End to end on CPU: converted (OAL) vs softmax (SDPA)", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen,default", help="comma-separated: qwen, default")
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=32768)
    parser.add_argument("--decode-tokens", type=int, default=8)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    add_timing_args(parser)
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "VARIANT", "LEN"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    apply_timing_args(parser, args)
    dtype = getattr(torch, args.dtype)
    if args.child:
        name, variant, length = args.child
        print(json.dumps(measure(name, variant, int(length), args.decode_tokens, dtype)))
        return
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in models:
        if m not in ("qwen", "default"):
            parser.error(f"--models: expected qwen or default, got {m!r}")
    if args.min_len < 1 or args.max_len < args.min_len:
        parser.error("--min-len/--max-len: expected 1 <= min-len <= max-len")
    lengths, n = [], args.min_len
    while n <= args.max_len:
        lengths.append(n)
        n *= 2

    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from oal.runio import atomic_write_json

    console = Console(width=160)
    rows = []
    RESULTS.mkdir(parents=True, exist_ok=True)
    jobs = [(m, n, v) for m in models for n in lengths for v in ("softmax", "oal")]
    with Progress(console=console) as progress:
        task = progress.add_task("prefill + decode", total=len(jobs))
        for m, n, v in jobs:
            cmd = [sys.executable, "-m", "benchmarks.model", "--child", m, v, str(n), "--decode-tokens",
                   str(args.decode_tokens), "--dtype", args.dtype, *timing_flags()]
            res = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=Path(__file__).parents[1])
            rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            progress.console.print(f"  {m} {v:7s} L={n:6d} prefill {r['prefill_s']:.2f} s, decode "
                                   f"{r['decode_ms']:.1f} ms/token, peak {r['peak_mib']:.0f} MiB "
                                   f"(load {r['load_before']:.1f})")
            # partial results survive an interrupted run
            atomic_write_json(RESULTS / "model.json", {"rows": rows, "complete": False})
            progress.advance(task)
    summary = []
    for m in models:
        table = Table(title=f"{m}: softmax (SDPA) vs converted (OAL), {args.dtype}, {torch.get_num_threads()} threads, "
                            f"{args.clock} clock")
        for col in ("L", "prefill softmax (s)", "prefill OAL (s)", "prefill ratio", "decode softmax (ms)",
                    "decode OAL (ms)", "decode ratio", "peak softmax MiB", "peak OAL MiB", "load"):
            table.add_column(col, justify="right")
        for n in lengths:
            s = next(r for r in rows if r["model"] == m and r["length"] == n and r["variant"] == "softmax")
            o = next(r for r in rows if r["model"] == m and r["length"] == n and r["variant"] == "oal")
            row = {"model": m, "length": n, "prefill_ratio": s["prefill_s"] / o["prefill_s"],
                   "decode_ratio": s["decode_ms"] / o["decode_ms"],
                   "load": max(s["load_before"], s["load_after"], o["load_before"], o["load_after"])}
            summary.append(row)
            table.add_row(str(n), f"{s['prefill_s']:.2f}", f"{o['prefill_s']:.2f}", f"{row['prefill_ratio']:.2f}x",
                          f"{s['decode_ms']:.1f}", f"{o['decode_ms']:.1f}", f"{row['decode_ratio']:.2f}x",
                          f"{s['peak_mib']:.0f}", f"{o['peak_mib']:.0f}", f"{row['load']:.1f}")
        console.print(table)
    goals = []
    for (m, kind, n), goal in GOALS.items():
        row = next((r for r in summary if r["model"] == m and r["length"] == n), None)
        if row is not None:
            got = row[f"{kind}_ratio"]
            goals.append(f"{m} {kind} at {n}: {got:.2f}x (goal {goal:g}x) {'met' if got >= goal else 'NOT met'}")
    if goals:
        console.print("goals: " + "; ".join(goals))
    atomic_write_json(RESULTS / "model.json", {"rows": rows, "summary": summary, "complete": True,
                                               "dtype": args.dtype, "torch": torch.__version__, "clock": args.clock})
    _plot(rows, RESULTS / "model.png")
    console.print(f"wrote {RESULTS / 'model.json'} and {RESULTS / 'model.png'}")


if __name__ == "__main__":
    main()
