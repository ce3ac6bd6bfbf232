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

Composed rows (`--compose-from N`, for L >= N, when the whole model at L does not fit the time at hand): a
two-layer model of the same shape (layer 0 softmax, layer 1 converted) runs the same prefill and decode, every
decoder layer is timed by forward hooks, and each full model's time is composed as (everything outside the
layers) + (its softmax layers) x t(layer 0) + (its converted layers) x t(layer 1). Layers of one kind have the
same shape and work, so this sums measured parts; `--check-compose` also composes at the longest whole-model
length and prints composed/measured. Composed rows report the cache size (K/V and states of all layers, exact)
but no peak RSS, and the table is followed by the per-layer prefill and decode times (softmax vs converted layer).
Writes `--out` (default benchmarks/results/model.json) and a PNG beside it, prints the tables on stdout and its
progress on stderr.

    python -m benchmarks.model                                  # both models, L = 1k..32k (long: hours on 2 cores)
    python -m benchmarks.model --models qwen --max-len 4096     # quicker
    python -m benchmarks.model --models qwen --lengths 1024,4096,16384,32768 --compose-from 16384 --check-compose
"""

# ruff: noqa: E402  (the arguments are parsed before the heavy imports)
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks._common import (
    MAX_TOKENS,
    ToolParser,
    add_length_args,
    add_timing_args,
    check_timing_args,
    int_in,
    lengths_from,
    list_of,
    output_file,
    run_tool,
)

RESULTS = Path(__file__).resolve().parent / "results"
OUTPUTS = ("the JSON of the run (--out; default benchmarks/results/model.json, rewritten after every length, "
           "`complete` false until the end) and a "
           "PNG beside it; the tables on stdout, progress on stderr")


def _model_name(text: str) -> str:
    if text not in ("qwen", "default"):
        raise argparse.ArgumentTypeError(f"expected qwen or default, got {text!r}")
    return text


def parse_args(argv=None) -> argparse.Namespace:
    parser = ToolParser(__doc__, OUTPUTS)
    parser.add_argument("--models", type=list_of(_model_name), default="qwen,default",
                        help="comma-separated: qwen, default")
    add_length_args(parser)
    parser.add_argument("--decode-tokens", type=int_in(1, 10**4), default=8)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--compose-from", type=int_in(1, MAX_TOKENS), metavar="L",
                        help="qwen lengths >= L: compose the models from a timed two-layer model (see above)")
    parser.add_argument("--check-compose", action="store_true",
                        help="also compose at the longest whole-model length, and print composed/measured")
    parser.add_argument("--out", type=output_file, default=RESULTS / "model.json",
                        help="JSON path (the PNG goes beside it)")
    add_timing_args(parser)
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "VARIANT", "LEN"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_timing_args(parser, args)
    args.lengths = lengths_from(parser, args)
    return args


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import json
import os
import statistics
import sys

import torch

from benchmarks import _common as bench
from benchmarks._common import PeakRSS, clock

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


def build(name: str, variant: str, dtype: torch.dtype, n_layers: int | None = None):
    """(model, description, converted layers) for one model and variant ("softmax", "oal", or "mixed": a
    two-layer model of the same shape whose layer 0 is softmax and layer 1 converted, for composed rows)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from oal.models.convert import convert
    from oal.models.registry import default_layers

    torch.manual_seed(0)
    if name == "qwen":
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN_SHAPE | ({"num_hidden_layers": n_layers} if n_layers else {})))
        model = model.to(dtype)
        desc = "Qwen2.5-0.5B shape, random weights"
    else:
        from oal.models.registry import load_model

        model, _, prov = load_model("default", dtype=dtype)
        model.config.max_position_embeddings = QWEN_SHAPE["max_position_embeddings"]
        desc = f"embedded default model ({prov['sha256'].get('model.safetensors', '?')[:12]})"
    model.eval()
    layers = [1] if variant == "mixed" else default_layers(model)
    if variant != "softmax":
        convert(model, methods=random_kernels(model, layers))
    return model, desc, layers


def _layer_clock(model) -> list[list[float]]:
    """Forward hooks on every decoder layer: the seconds of each layer's calls, appended per call."""
    from oal.models.attention import _decoder_layers

    spent: list[list[float]] = []
    for i, layer in enumerate(_decoder_layers(model)):
        spent.append([])
        layer.register_forward_pre_hook(lambda mod, args, i=i: spent[i].append(-clock()))
        layer.register_forward_hook(lambda mod, args, out, i=i: spent[i].__setitem__(-1, spent[i][-1] + clock()))
    return spent


@torch.no_grad()
def measure(name: str, variant: str, length: int, decode_tokens: int, dtype: torch.dtype):
    """Runs in the child: one prefill of `length` tokens, then `decode_tokens` decode steps on its cache.

    variant "mixed" (composed rows): the two-layer model, returning the composed softmax and converted rows.
    """
    from transformers import DynamicCache

    from oal.models.cache import cache_kwargs, state_nbytes

    model, desc, layers = build(name, variant, dtype, n_layers=2 if variant == "mixed" else None)
    spent = _layer_clock(model) if variant == "mixed" else None
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)

    def prefill(n):
        ids = torch.randint(0, vocab, (1, n), generator=gen)
        cache = DynamicCache(config=model.config)
        t0 = clock()
        out = model(ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
        return clock() - t0, out.logits[:, -1:].argmax(-1), cache

    def decode(tok, cache, start, steps):
        times = []
        for i in range(steps):
            pos = torch.tensor([[start + i]])
            t0 = clock()
            logits = model(tok, **cache_kwargs(model, cache), use_cache=True, position_ids=pos).logits
            times.append(clock() - t0)
            tok = logits[:, -1:].argmax(-1)
        return times

    _, tok, cache = prefill(min(length, 300))  # warm-up: both the dense (short) and the chunked operator paths
    decode(tok, cache, min(length, 300), 2)
    del cache
    load = os.getloadavg()[0]
    if spent is not None:
        for times in spent:
            times.clear()
    with PeakRSS() as mem:
        prefill_s, tok, cache = prefill(length)
        decode_s = decode(tok, cache, length, decode_tokens)
    cache_mib = sum(state_nbytes(cache).values()) / 2**20
    row = {"model": name, "variant": variant, "length": length, "dtype": str(dtype).replace("torch.", ""),
           "prefill_s": prefill_s, "decode_ms": 1e3 * statistics.median(decode_s),
           "decode_ms_all": [1e3 * t for t in decode_s], "peak_mib": mem.peak_mib, "cache_mib": cache_mib,
           "load_before": load, "load_after": os.getloadavg()[0], "threads": torch.get_num_threads(),
           "description": desc, "converted_layers": layers if variant == "oal" else [], "composed": False}
    if spent is None:
        return row
    return _composed(row, spent, state_nbytes(cache), name)


def _composed(row: dict, spent: list[list[float]], nbytes: dict[int, int], name: str) -> list[dict]:
    """The full models' rows from the two-layer model's: outside-the-layers time + n_kind x t(layer of that kind)."""
    from transformers import Qwen2Config

    from oal.models.registry import default_layers

    if name != "qwen":
        raise ValueError("composed rows: only the qwen model (its full shape is known without loading)")
    full = Qwen2Config(**QWEN_SHAPE)
    converted = default_layers(full)
    n_layers, n_conv = full.num_hidden_layers, len(converted)
    soft_pre, conv_pre = spent[0][0], spent[1][0]  # call 0: the prefill; calls 1..: the decode steps
    outside_pre = row["prefill_s"] - soft_pre - conv_pre
    steps = [t / 1e3 - s - c for t, s, c in zip(row["decode_ms_all"], spent[0][1:], spent[1][1:], strict=True)]
    out = []
    for variant, n_soft, n_oal in (("softmax", n_layers, 0), ("oal", n_layers - n_conv, n_conv)):
        decode_all = [1e3 * (o + n_soft * s + n_oal * c)
                      for o, s, c in zip(steps, spent[0][1:], spent[1][1:], strict=True)]
        out.append(row | {
            "variant": variant, "composed": True, "peak_mib": None,
            "prefill_s": outside_pre + n_soft * soft_pre + n_oal * conv_pre,
            "decode_ms": statistics.median(decode_all), "decode_ms_all": decode_all,
            "cache_mib": (n_soft * nbytes[0] + n_oal * nbytes[1]) / 2**20,
            "layer_prefill_s": {"softmax": soft_pre, "oal": conv_pre, "outside": outside_pre},
            "layer_decode_ms": {"softmax": 1e3 * statistics.median(spent[0][1:]),
                                "oal": 1e3 * statistics.median(spent[1][1:]),
                                "outside": 1e3 * statistics.median(steps)},
            "converted_layers": converted if variant == "oal" else [],
        })
    return out


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    series = sorted({(r["model"], r["variant"]) for r in rows if r["variant"] != "mixed"})
    for i, ((model, variant), style) in enumerate(zip(series, ("o-", "s--") * 4, strict=False)):
        best = {}  # one point per length: the whole-model row when there is one
        for r in rows:
            if (r["model"], r["variant"]) == (model, variant) and (r["length"] not in best or not r["composed"]):
                best[r["length"]] = r
        xs = sorted(best)
        label = f"{model} {variant}"
        axes[0].loglog(xs, [best[x]["prefill_s"] for x in xs], style, color=f"C{i}", label=label, base=2)
        axes[1].semilogx(xs, [best[x]["decode_ms"] for x in xs], style, color=f"C{i}", label=label, base=2)
        peak = [x for x in xs if best[x]["peak_mib"] is not None]
        axes[2].semilogx(peak, [best[x]["peak_mib"] for x in peak], style, color=f"C{i}", label=f"{label} peak RSS",
                         base=2)
        axes[2].semilogx(xs, [best[x]["cache_mib"] for x in xs], style[0] + ":", color=f"C{i}", alpha=0.6,
                         label=f"{label} cache", base=2)
        composed = [x for x in xs if best[x]["composed"]]
        for ax, key in ((axes[0], "prefill_s"), (axes[1], "decode_ms")):
            ax.plot(composed, [best[x][key] for x in composed], "kx", markersize=9)
    axes[0].set(xlabel="context length", ylabel="prefill time (s)", title="Prefill")
    axes[1].set(xlabel="context length", ylabel="ms per token", title="Decode, per token")
    axes[2].set(xlabel="context length", ylabel="MiB", title="Peak RSS above the loaded model; cache size")
    title = "End to end on CPU: converted (OAL) vs softmax (SDPA); x: composed from layer timings"
    bench.finish_figure(fig, axes, title, path)


def _jobs(models: list[str], lengths: list[int], compose_from: int | None, check: bool) -> list[tuple]:
    """(model, length, variant) per child: whole models below --compose-from, one "mixed" child from it on."""
    jobs = []
    for m in models:
        whole = [n for n in lengths if compose_from is None or m != "qwen" or n < compose_from]
        jobs += [(m, n, v) for n in whole for v in ("softmax", "oal")]
        if m == "qwen" and compose_from is not None:
            composed = [n for n in lengths if n >= compose_from]
            jobs += [(m, n, "mixed") for n in ([max(whole)] if check and whole else []) + composed]
    return jobs


def _summary(rows: list[dict], models: list[str], lengths: list[int], console, title: str) -> list[dict]:
    from rich.table import Table

    summary = []
    for m in models:
        table = Table(title=f"{m}: softmax (SDPA) vs converted (OAL), {title}")
        for col in ("L", "prefill softmax (s)", "prefill OAL (s)", "prefill ratio", "decode softmax (ms)",
                    "decode OAL (ms)", "decode ratio", "peak softmax MiB", "peak OAL MiB", "cache softmax MiB",
                    "cache OAL MiB", "load"):
            table.add_column(col, justify="right")
        for n in lengths:
            pick = {}
            for v in ("softmax", "oal"):  # a whole-model row when there is one, else the composed one
                cands = [r for r in rows if r["model"] == m and r["length"] == n and r["variant"] == v]
                pick[v] = min(cands, key=lambda r: r["composed"])
            s, o = pick["softmax"], pick["oal"]
            row = {"model": m, "length": n, "prefill_ratio": s["prefill_s"] / o["prefill_s"],
                   "decode_ratio": s["decode_ms"] / o["decode_ms"], "composed": s["composed"],
                   "load": max(s["load_before"], s["load_after"], o["load_before"], o["load_after"])}
            summary.append(row)
            peak = [f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-" for r in (s, o)]
            table.add_row(f"{n}{' *' if row['composed'] else ''}", f"{s['prefill_s']:.2f}", f"{o['prefill_s']:.2f}",
                          f"{row['prefill_ratio']:.2f}x", f"{s['decode_ms']:.1f}", f"{o['decode_ms']:.1f}",
                          f"{row['decode_ratio']:.2f}x", *peak, f"{s['cache_mib']:.0f}", f"{o['cache_mib']:.0f}",
                          f"{row['load']:.1f}")
        console.print(table)
    if any(r["composed"] for r in summary):
        console.print("* composed from per-layer timings of a two-layer model of the same shape (see --help)")
    for r in (r for r in rows if r["composed"] and r["variant"] == "oal"):
        ms, pre = r["layer_decode_ms"], r["layer_prefill_s"]
        console.print(f"per layer, {r['model']} L={r['length']}: prefill softmax {pre['softmax']:.2f} s, "
                      f"converted {pre['oal']:.2f} s; decode softmax {ms['softmax']:.2f} ms, "
                      f"converted {ms['oal']:.2f} ms, outside the layers {ms['outside']:.1f} ms")
    for r in (r for r in rows if r["composed"]):  # --check-compose: a length measured both ways
        key = (r["model"], r["length"], r["variant"])
        whole = next((w for w in rows if not w["composed"] and (w["model"], w["length"], w["variant"]) == key), None)
        if whole is not None:
            console.print(f"check: {r['model']} {r['variant']} L={r['length']}: composed/measured prefill "
                          f"{r['prefill_s'] / whole['prefill_s']:.3f}, decode "
                          f"{r['decode_ms'] / whole['decode_ms']:.3f}")
    return summary


def main(args: argparse.Namespace) -> None:
    bench.apply_timing_args(None, args)
    dtype = getattr(torch, args.dtype)
    if args.child:
        name, variant, length = args.child
        print(json.dumps(measure(name, variant, int(length), args.decode_tokens, dtype)))
        return
    models, lengths = args.models, args.lengths

    from rich.console import Console
    from rich.progress import Progress

    from oal.rundir.files import atomic_write_json

    console = Console(width=170)
    rows = []
    # what every write records, the partial ones too (`complete` says which): what the rows were measured with
    meta = {"dtype": args.dtype, "torch": torch.__version__, "clock": args.clock, "environment": bench.environment()}
    jobs = _jobs(models, lengths, args.compose_from, args.check_compose)
    with Progress(console=Console(width=170, stderr=True)) as progress:
        task = progress.add_task("prefill + decode", total=len(jobs))
        for m, n, v in jobs:
            cmd = [sys.executable, "-m", "benchmarks.model", "--child", m, v, str(n), "--decode-tokens",
                   str(args.decode_tokens), "--dtype", args.dtype, *bench.timing_flags()]
            got = bench.child_json(cmd, f"the timing child of {m} {v} at {n} tokens")
            for r in got if isinstance(got, list) else [got]:
                rows.append(r)
                progress.console.print(f"  {m} {r['variant']:7s} L={n:6d}{' composed' if r['composed'] else ''} "
                                       f"prefill {r['prefill_s']:.2f} s, decode {r['decode_ms']:.1f} ms/token, "
                                       f"cache {r['cache_mib']:.0f} MiB (load {r['load_before']:.1f})")
            # partial results survive an interrupted run
            atomic_write_json(args.out, {"rows": rows, "complete": False, **meta})
            progress.advance(task)
    title = f"{args.dtype}, {torch.get_num_threads()} threads, {args.clock} clock"
    summary = _summary(rows, models, lengths, console, title)
    goals = []
    for (m, kind, n), goal in GOALS.items():
        row = next((r for r in summary if r["model"] == m and r["length"] == n), None)
        if row is not None:
            got = row[f"{kind}_ratio"]
            goals.append(f"{m} {kind} at {n}{' (composed)' if row['composed'] else ''}: {got:.2f}x (goal {goal:g}x) "
                         f"{'met' if got >= goal else 'NOT met'}")
    if goals:
        console.print("goals: " + "; ".join(goals))
    atomic_write_json(args.out, {"rows": rows, "summary": summary, "complete": True, **meta})
    _plot(rows, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    run_tool(main, ARGS)
