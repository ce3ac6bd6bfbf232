"""Kill `oal run` at random moments, resume it each time, and compare its final numbers with an uninterrupted run.

    .venv/bin/python scripts/resume_check.py --reference runs/acc --out runs/acc-killed --kills 2 --seed 1 -- \
        --model smollm2-135m --layers 13,14 --methods oal,global,softmax --steps 2 --val-every 1 --tasks none

The arguments after `--` are those of the reference run (without --out). Each kill is a SIGKILL at a uniformly
random moment within the expected run time (`--within`, seconds), so it can land in any stage; the run is then
started again with the same command. Exit 0 when every number of metrics.json (perplexities, fidelity, ...) equals
the reference's exactly, 1 otherwise; the stages each kill interrupted are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

VOLATILE = {"elapsed_s", "seconds", "created", "versions", "sha256", "path", "timestamp"}


def numbers(obj, prefix=""):
    """{dotted key: value} of the numbers in a metrics record, leaving out times and file records."""
    out = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k not in VOLATILE:
                out.update(numbers(v, f"{prefix}{k}."))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(numbers(v, f"{prefix}{i}."))
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        out[prefix.rstrip(".")] = obj
    return out


def last_stage(out: Path) -> str:
    try:
        return ", ".join(sorted(json.loads((out / ".oal" / "stages.json").read_text())))
    except (OSError, ValueError):
        return "(none finished)"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reference", type=Path, required=True, help="the uninterrupted run directory")
    p.add_argument("--out", type=Path, required=True, help="the run directory to kill and resume (new)")
    p.add_argument("--kills", type=int, default=2)
    p.add_argument("--within", type=float, default=600.0, help="kill moments are drawn in [5, WITHIN] seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then the run's arguments")
    a = p.parse_args(argv)
    run_args = a.args[1:] if a.args[:1] == ["--"] else a.args
    cmd = [str(Path(sys.executable).with_name("oal")), "run", "--out", str(a.out), *run_args]
    rng = random.Random(a.seed)
    for i in range(a.kills):
        wait = rng.uniform(5.0, a.within)
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=wait)
            print(f"kill {i + 1}: the run finished before {wait:.0f} s; nothing to kill")
            break
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            print(f"kill {i + 1}: SIGKILL after {wait:.0f} s; finished stages then: {last_stage(a.out)}", flush=True)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL)
    print(f"resumed run: exit {done.returncode} after {time.perf_counter() - t0:.0f} s")
    if done.returncode != 0:
        return 1
    want = numbers(json.loads((a.reference / "metrics.json").read_text()))
    got = numbers(json.loads((a.out / "metrics.json").read_text()))
    diff = {k: (want.get(k), got.get(k)) for k in sorted(set(want) | set(got)) if want.get(k) != got.get(k)}
    print(f"{len(want)} numbers compared; {len(diff)} differ")
    for k, (w, g) in list(diff.items())[:20]:
        print(f"  {k}: reference {w}, resumed {g}")
    return 0 if not diff else 1


if __name__ == "__main__":
    sys.exit(main())
