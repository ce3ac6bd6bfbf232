"""Position dependence of runs' converted models (issue 37): for each `oal run` directory, its grouping procedure,
its verified fidelity and perplexity, and how far the last logits move when every position id is shifted
(`oal.evaluate.position.shift_error`) for the base model, the calibrated conversion and the adapted one.

    # the same run twice, App. B groups and pair-tied groups, then the comparison:
    oal run --out runs/appb --methods oal,softmax --tasks none
    oal run --out runs/pairs --methods oal,softmax --tasks none --grouping app-b-pairs
    python scripts/position_dependence.py runs/appb runs/pairs [--shift 3] [--blocks 4] [--json OUT.json]

Any base model works (`--model` of `oal run`, e.g. a SmolLM2 folder); the test blocks are the run's own.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def measure(run: Path, shift: int, n_blocks: int) -> dict:
    from oal.artefact.arms import load_converted
    from oal.data import plan_blocks
    from oal.data.sources import load_corpus
    from oal.data.splits import SplitPlan
    from oal.evaluate.position import shift_error
    from oal.models.registry import load_model
    from oal.pipeline.publish import verified_metrics
    from oal.rundir.files import load_json

    config = load_json(run / "config.json")
    metrics = verified_metrics(run)
    base, tok, _ = load_model(config["config"]["model"], dtype=getattr(torch, config["config"].get("dtype",
                                                                                                    "float32")))
    corpus = load_corpus(config["config"]["data"], data_dir=config["config"].get("data_dir"))
    blocks = plan_blocks(corpus, tok, SplitPlan.from_dict(config["split_plan"]),
                         data_dir=config["config"].get("data_dir"))["test"][:n_blocks]
    groups = load_json(run / "groups.json")
    row = {"run": run.name, "grouping": groups.get("procedure"),
           "relmse": (metrics.get("fidelity", {}).get("oal") or {}).get("relmse"),
           "relmse_post_o": (metrics.get("fidelity", {}).get("oal") or {}).get("relmse_post_o"),
           "ppl_softmax": metrics.get("perplexity", {}).get("softmax"),
           "ppl_no_adapt": metrics.get("perplexity_no_adapt", {}).get("oal"),
           "ppl_lora": metrics.get("perplexity", {}).get("oal"),
           "shift": shift, "blocks": list(blocks.shape), "shift_error_base": shift_error(base, blocks, shift)}
    for adapter, key in ((False, "shift_error_oal"), (True, "shift_error_oal_lora")):
        if adapter and not (run / "adapter" / "oal").is_dir():
            continue
        model, _, _ = load_converted(run, "oal", adapter=adapter)
        row[key] = shift_error(model, blocks, shift)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="oal run directories (method oal)")
    p.add_argument("--shift", type=int, default=3, help="added to every position id (default 3)")
    p.add_argument("--blocks", type=int, default=4, help="test blocks measured (default 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    if args.shift < 0 or args.blocks < 1 or args.threads < 1:
        p.error("--shift must be >= 0, --blocks and --threads >= 1")
    torch.set_num_threads(args.threads)
    rows = []
    for run in args.runs:
        try:
            rows.append(measure(run, args.shift, args.blocks))
        except (ValueError, OSError) as exc:
            print(f"Error: {run}: {' '.join(str(exc).split())}", file=sys.stderr)
            return 2
        print(json.dumps(rows[-1]))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
