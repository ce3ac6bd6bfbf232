"""Sliding windows (issue 29): causal prefill time and one decode step of swa and oal-swa against chunked OAL and
SDPA, fp32, at the Qwen2.5-0.5B head shape (B=1, Hq=14, Hkv=2, d=dv=64), W=64, S=4 (swa), G=5.

Prefill: one causal call on N tokens (window_attention backend "banded", oal_attention "chunked", SDPA). Decode:
one new token on the state of N tokens (the windows' ring buffer plus OAL prefix, OAL's state) against SDPA on the
N cached keys. Best of --repeats calls in one process; the machine load is recorded with every row. Writes `--out`
(default benchmarks/results/window.json) and a PNG beside it, and prints the table.

    python -m benchmarks.window --lengths 1024,2048,4096 --threads 1 --clock cpu   # a shared machine
"""

# ruff: noqa: E402  (the arguments are parsed before the heavy imports)
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks._common import (
    ToolParser,
    add_length_args,
    add_timing_args,
    check_timing_args,
    int_in,
    lengths_from,
    output_file,
    run_tool,
)

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = dict(hq=14, hkv=2, d=64, g=5, window=64, sinks=4)
METHODS = ("sdpa", "oal", "swa", "oal-swa")
OUTPUTS = ("the JSON of the run (--out; default benchmarks/results/window.json) and a PNG beside it; the table on "
           "stdout")


def parse_args(argv=None) -> argparse.Namespace:
    parser = ToolParser(__doc__, OUTPUTS)
    add_length_args(parser)
    add_timing_args(parser)
    parser.add_argument("--repeats", type=int_in(1, 1000), default=3)
    parser.add_argument("--out", type=output_file, default=RESULTS / "window.json",
                        help="the JSON to write (the PNG goes beside it)")
    parser.set_defaults(min_len=1024, max_len=4096)
    args = parser.parse_args(argv)
    check_timing_args(parser, args)
    args.lengths = lengths_from(parser, args)
    return args


ARGS = parse_args() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import os
import sys

import torch

from benchmarks import _common
from benchmarks._common import apply_timing_args, clock, finish_figure


def _inputs(n: int):
    from oal.ops.kernel import perturbed_factor, taylor_factor

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, SHAPE["hq"], n + 1, SHAPE["d"], generator=gen)  # the last token is the decode step's
    k = torch.randn(1, SHAPE["hkv"], n + 1, SHAPE["d"], generator=gen)
    v = torch.randn(1, SHAPE["hkv"], n + 1, SHAPE["d"], generator=gen)
    groups = torch.randint(0, SHAPE["g"], (SHAPE["hq"], SHAPE["d"]), generator=gen)
    return q, k, v, groups, perturbed_factor(taylor_factor(SHAPE["hq"], SHAPE["g"]), 0.1, generator=gen)


def _calls(method: str, n: int):
    """(prefill on N tokens, decode of token N+1 on the state of the first N) for `method`."""
    from oal.ops import oal_attention
    from oal.ops.window import window_attention

    q, k, v, groups, factor = _inputs(n)
    head, last = (lambda t: t[:, :, :n]), (lambda t: t[:, :, n:])
    if method == "sdpa":
        def run(qq, kk, vv, causal):
            return torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal, enable_gqa=True)
        return (lambda: run(head(q), head(k), head(v), True)), (lambda: run(last(q), k, v, False))
    if method == "oal":
        def run(qq, kk, vv, **kw):
            return oal_attention(qq, kk, vv, groups, factor, **kw)
        backend = "chunked"
    else:
        kernel = {"groups": groups, "factor": factor} if method == "oal-swa" else {"sinks": SHAPE["sinks"]}

        def run(qq, kk, vv, **kw):
            return window_attention(qq, kk, vv, window=SHAPE["window"], **kernel, **kw)
        backend = "banded"
    _, state = run(head(q), head(k), head(v), backend=backend, output_final_state=True)
    return (lambda: run(head(q), head(k), head(v), backend=backend)), \
        (lambda: run(last(q), last(k), last(v), initial_state=state))


def _best(call, repeats: int) -> float:
    call()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = clock()
        call()
        times.append(clock() - t0)
    return min(times)


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for method in METHODS:
        pts = sorted((r["n"], r["prefill_s"], r["decode_s"]) for r in rows if r["method"] == method)
        ns, pre, dec = zip(*pts, strict=True)
        axes[0].loglog(ns, pre, "o-", label=method, base=2)
        axes[1].loglog(ns, [1e3 * t for t in dec], "o-", label=method, base=2)
    axes[0].set(xlabel="sequence length N", ylabel="time (s)", title="Causal prefill")
    axes[1].set(xlabel="tokens already in the state / cache", ylabel="time (ms)", title="One decode step")
    finish_figure(fig, axes, f"B=1, Hq=14, Hkv=2, d=64, W=64, S=4 (swa), G=5, CPU, {_common.CLOCK_NAME} clock", path)


def main(args: argparse.Namespace) -> None:
    apply_timing_args(None, args)
    rows = []
    with torch.no_grad():
        for n in args.lengths:
            for method in METHODS:
                load = os.getloadavg()[0]
                prefill, decode = _calls(method, n)
                rows.append({"method": method, "n": n, "prefill_s": _best(prefill, args.repeats),
                             "decode_s": _best(decode, args.repeats), "load_before": load,
                             "load_after": os.getloadavg()[0]})
    from oal.rundir.files import atomic_write_json

    atomic_write_json(args.out, {"shape": SHAPE, "threads": torch.get_num_threads(), "clock": _common.CLOCK_NAME,
                                 "rows": rows, "environment": _common.environment()})
    _plot(rows, args.out.with_suffix(".png"))
    print(f"{'method':>8} {'N':>6} {'prefill s':>10} {'decode ms':>10} {'load':>5}")
    for r in rows:
        print(f"{r['method']:>8} {r['n']:>6} {r['prefill_s']:>10.4f} {1e3 * r['decode_s']:>10.3f} "
              f"{r['load_before']:>5.1f}")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}", file=sys.stderr)


if __name__ == "__main__":
    run_tool(main, ARGS)
