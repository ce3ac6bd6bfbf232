"""Benchmark: time the arms of a finished conversion frontier again, on this machine, in one run.

`benchmarks.frontier` times each arm right after adapting it, so its rows are timed minutes or hours apart, each
with whatever else the machine ran then. This tool takes a frontier JSON (`benchmarks/reference/frontier_smollm2.json`),
rebuilds every arm's architecture (the same model, the same converted layers, the same method and window settings)
and times them all again, interleaved: every arm once, then every arm again (--repeats), keeping each arm's
fastest prefill and fastest decode (each round's decode is already the median of its steps): on a machine whose
speed wanders, the least disturbed round. Kernel values do not change the speed, so the arms get their
methods' default (uncalibrated) kernels and no adaptation; perplexity and passkey stay those of the input (its
adapted arms). The model must be the one the input records (its state dict's SHA256).

Writes --json (the input's schema, with `decode_ms`, `prefill_s` and `peak_mb` replaced and `retimed` added: when,
where, how, and the SHA256 of the input) and a PNG beside it, and prints the table.

    .venv/bin/python -m benchmarks.frontier_retime benchmarks/reference/frontier_smollm2.json \\
        --json benchmarks/results/frontier_smollm2_retimed.json
"""

# ruff: noqa: E402  (the arguments are parsed before the heavy imports)
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks._common import MAX_THREADS, ToolParser, environment, input_file, int_in, output_file, run_tool

RESULTS = Path(__file__).resolve().parent / "results"
OUTPUTS = ("the re-timed frontier JSON (--json; default benchmarks/results/<input name>_retimed.json) and a PNG "
           "beside it; the table on stdout, progress on stderr")


def parse(argv=None) -> argparse.Namespace:
    p = ToolParser(__doc__, OUTPUTS)
    p.add_argument("frontier", type=input_file, help="a frontier JSON written by benchmarks.frontier")
    p.add_argument("--json", type=output_file, help="output (default benchmarks/results/<input name>_retimed.json)")
    p.add_argument("--decode-tokens", type=int_in(1, 10**4), default=8, help="timed greedy steps per length")
    p.add_argument("--repeats", type=int_in(1, 100), default=3, help="rounds over the arms (interleaved)")
    p.add_argument("--threads", type=int_in(0, MAX_THREADS), default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    a = p.parse_args(argv)
    a.json = a.json or RESULTS / f"{a.frontier.stem}_retimed.json"
    return a


ARGS = parse() if __name__ == "__main__" else None  # before the heavy imports: --help and bad input at once

import copy
import datetime
import json
import tempfile
import types

import torch

from benchmarks import frontier


def read_frontier(path: Path) -> dict:
    """The frontier JSON at `path`; ValueError naming it when it is not one."""
    try:
        res = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON file ({exc})") from None
    need = {"model", "softmax", "rows", "window", "sinks", "provenance"}
    if not isinstance(res, dict) or not need <= set(res) or "decode_ms" not in res["softmax"]:
        raise ValueError(f"{path}: not a frontier JSON of benchmarks.frontier (it needs {', '.join(sorted(need))})")
    return res


def arms(res: dict) -> list[tuple[str, str, list[int]]]:
    """(label, method, layers) of every arm, softmax first, as the input lists them."""
    out = [("softmax", "softmax", [])]
    out += [(f"{frontier.arm(r)} K={r['n_linear']}", r["method"], list(r["layers"])) for r in res["rows"]]
    return out


def build(base, method: str, layers: list[int], options: dict):
    """A copy of `base` with `layers` converted to `method` (its default kernels; the speed does not depend on them)."""
    from oal.methods.base import method_settings
    from oal.models.convert import convert

    model = copy.deepcopy(base)
    if layers:
        convert(model, layers, method, **method_settings(method, options))
    return model.eval()


def retime(args, log=print) -> dict:
    from oal.rundir.hashes import sha256_file

    res = read_frontier(args.frontier)
    lengths = [int(n) for n in res["softmax"]["decode_ms"]]
    with tempfile.TemporaryDirectory() as work:  # Frontier makes a work folder; nothing is kept in it here
        f = frontier.Frontier(types.SimpleNamespace(model=res["model"], device=args.device, lengths=lengths,
                                                    decode_tokens=args.decode_tokens, window=res["window"],
                                                    sinks=res["sinks"], work=work), log)
    want = res["provenance"].get("state_dict_sha256")
    if want != f.prov["state_dict_sha256"]:
        raise ValueError(f"{args.frontier}: its arms were measured on a model with state dict SHA256 {want}, "
                         f"{res['model']} here has {f.prov['state_dict_sha256']}")
    options = {"window": res["window"], "sinks": res["sinks"]}
    every = arms(res)
    times: dict[str, list[dict]] = {label: [] for label, _, _ in every}
    for r in range(args.repeats):
        for label, method, layers in every:
            log(f"round {r + 1}/{args.repeats}: {label}")
            model = build(f.model, method, layers, options)
            times[label].append(frontier.timing(model, f.text, lengths, args.decode_tokens))
            del model

    def best(label: str) -> dict:
        runs = times[label]
        return {"prefill_s": {str(n): min(t["prefill_s"][str(n)] for t in runs) for n in lengths},
                "decode_ms": {str(n): min(t["decode_ms"][str(n)] for t in runs) for n in lengths},
                "peak_mb": max((t["peak_mb"] for t in runs if t["peak_mb"] is not None), default=None)}

    out = copy.deepcopy(res)
    out["softmax"].update(best("softmax"))
    for row, (label, _, _) in zip(out["rows"], every[1:], strict=True):
        row.update(best(label))
    out["retimed"] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "from": {"file": args.frontier.name, "sha256": sha256_file(args.frontier)},
        "machine": frontier.machine(f.device),
        "repeats": args.repeats, "decode_tokens": args.decode_tokens,
        "how": "every arm rebuilt with default kernels (no adaptation), timed interleaved; the fastest prefill and "
               "decode (each a median of its steps) over the rounds; ppl and passkey are the input's",
        "runs": times}
    out["machine"], out["environment"] = out["retimed"]["machine"], environment()
    return out


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console(stderr=True)
    res = retime(args, log=console.log)
    threads = res["retimed"]["machine"]["threads"]
    frontier.publish(res, args.json, f"conversion frontier, re-timed: {res['model']} ({threads} threads, "
                                     f"{args.repeats} interleaved rounds)")
    console.log(f"wrote {args.json} and {args.json.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    run_tool(main, ARGS)
