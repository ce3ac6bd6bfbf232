"""`benchmarks.operator --contention`: OAL and SDPA timed quiet and beside one busy competing process.

For every (dtype, N, method) the child is timed twice in a row, first alone, then while one extra process spins
a core (`while True: pass`, the "one busy competing process" of issue 25), so that quiet and loaded runs of one
configuration are side by side in time. slowdown = loaded / quiet per method, and the figure of merit is
OAL's slowdown / SDPA's slowdown (issue 25 goal: at most 1.3 at 4k and 16k). The machine's load average is
recorded with every run: on a machine that is not otherwise quiet the "quiet" runs are not quiet, and the
ratios say little. Writes `--out` (default benchmarks/results/operator_contention.json) and a PNG beside it, and
prints a table.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from oal.ops.autotune import busy_process

GOAL = 1.3  # issue 25: OAL's slowdown at most 1.3x SDPA's


def run(child, lengths: list[int], dtypes: list[str], repeats: int, device: str, out: Path, title: str):
    """Time each configuration quiet then loaded through `child` (benchmarks.operator._child); report and save."""
    from rich.console import Console
    from rich.table import Table

    from benchmarks._common import environment
    from oal.rundir.files import atomic_write_json

    rows = []
    for dt in dtypes:
        for n in lengths:
            for method in ("sdpa", "oal"):
                args = ["--child", method, str(n), "--dtype", dt, "--repeats", str(repeats), "--device", device]
                quiet = child(args)
                with busy_process():
                    loaded = child(args)
                rows.append({"method": method, "n": n, "dtype": dt, "quiet": quiet, "loaded": loaded,
                             "slowdown": loaded["time_s"] / quiet["time_s"]})
                print(f"  {dt} {method:5s} N={n:6d} quiet {quiet['time_s']:.3f} s (load {quiet['load_before']:.1f})"
                      f"  loaded {loaded['time_s']:.3f} s (load {loaded['load_before']:.1f})", file=sys.stderr)
    summary = []
    for dt in dtypes:
        for n in lengths:
            s, o = (next(r for r in rows if r["method"] == m and r["n"] == n and r["dtype"] == dt)
                    for m in ("sdpa", "oal"))
            loads = [r[k][f"load_{w}"] for r in (s, o) for k in ("quiet", "loaded") for w in ("before", "after")]
            summary.append({"n": n, "dtype": dt, "sdpa_slowdown": s["slowdown"], "oal_slowdown": o["slowdown"],
                            "slowdown_ratio": o["slowdown"] / s["slowdown"], "goal": GOAL,
                            "load_min": min(loads), "load_max": max(loads)})
    table = Table(title=f"{title}: quiet vs one busy competing process (slowdown = loaded / quiet)")
    for col in ("dtype", "N", "SDPA quiet (s)", "SDPA loaded (s)", "SDPA slowdown", "OAL quiet (s)",
                "OAL loaded (s)", "OAL slowdown", "OAL/SDPA slowdown", f"goal <= {GOAL}", "load"):
        table.add_column(col, justify="right")
    for sm in summary:
        s, o = (next(r for r in rows if r["method"] == m and r["n"] == sm["n"] and r["dtype"] == sm["dtype"])
                for m in ("sdpa", "oal"))
        table.add_row(sm["dtype"], str(sm["n"]), f"{s['quiet']['time_s']:.3f}", f"{s['loaded']['time_s']:.3f}",
                      f"{s['slowdown']:.2f}", f"{o['quiet']['time_s']:.3f}", f"{o['loaded']['time_s']:.3f}",
                      f"{o['slowdown']:.2f}", f"{sm['slowdown_ratio']:.2f}",
                      "met" if sm["slowdown_ratio"] <= GOAL else "NOT met",
                      f"{sm['load_min']:.1f}-{sm['load_max']:.1f}")
    console = Console(width=160)
    console.print(table)
    console.print(f"load average (1 min) over the runs: {min(s['load_min'] for s in summary):.1f}-"
                  f"{max(s['load_max'] for s in summary):.1f} on {os.cpu_count()} CPUs; the quiet runs are only "
                  "quiet when the load before them is near 0")
    atomic_write_json(out, {"rows": rows, "summary": summary, "goal": GOAL, "cpu_count": os.cpu_count(),
                            "title": title, "environment": environment()})
    _plot(summary, out.with_suffix(".png"), title)
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)


def _plot(summary: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks._common import finish_figure

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for dt in sorted({s["dtype"] for s in summary}, reverse=True):
        ss = sorted((s for s in summary if s["dtype"] == dt), key=lambda s: s["n"])
        ns = [s["n"] for s in ss]
        axes[0].semilogx(ns, [s["sdpa_slowdown"] for s in ss], "s--", base=2, label=f"SDPA {dt}")
        axes[0].semilogx(ns, [s["oal_slowdown"] for s in ss], "o-", base=2, label=f"OAL {dt}")
        axes[1].semilogx(ns, [s["slowdown_ratio"] for s in ss], "o-", base=2, label=dt)
    axes[1].axhline(GOAL, color="k", linestyle=":", label=f"goal <= {GOAL}")
    axes[0].set(xlabel="sequence length N", ylabel="loaded time / quiet time", title="Slowdown, one busy process")
    axes[1].set(xlabel="sequence length N", ylabel="OAL slowdown / SDPA slowdown", title="Relative slowdown")
    finish_figure(fig, axes, title, path)
