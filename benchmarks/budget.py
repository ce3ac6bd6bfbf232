"""Benchmark: the paper's claims on SmolLM2-135M at a real budget. Table 2 (frozen-attention fidelity of every
method) and whether OAL's lead over the learned global quadratic survives LoRA adaptation as the budget grows.

Three subcommands, each over the pipeline's own drivers and records:

  run      an `oal run` (`oal.pipeline.runs.run`) with the preset's protocol but a split plan of other block
           lengths: calibration blocks of --calib-len tokens, adaptation blocks of --adapt-len, validation and test
           blocks of --eval-len, fidelity blocks of --fidelity-len (the preset's grouping prompts are kept).
           Resumable: run the same command again. With the preset's lengths and counts (--adapt-blocks 256 and the
           other defaults) the plan is the preset's own: `oal run --preset smollm2-135m --steps N --val-every V`.
  table2   `oal diagnose --parts table2` (every method calibrated on frozen attention, App. B protocol, then
           held-out fidelity) with calibration blocks of --calib-len and fidelity blocks of --fidelity-len tokens,
           written to a directory that is not a run directory, so its numbers are recorded with the SHA256 of
           diagnostics/table2.json; the calibration and fidelity blocks are recorded beside them.
  collect  reads run directories and Table 2 directories (verified records only: `benchmarks._budget_records`) and
           writes the study's JSON and a figure of the learning curves.

collect writes --json (default benchmarks/results/smollm2_budget.json) with
  {"frozen": {method: {"relmse", "relmse_post_o", "mse", "mse_post_o"}},   # the first --table2 directory
   "curves": {method: [[updates, val_ppl], ...]},                          # mean over seeds at each validation
   "test_ppl": {method: float},                                            # after adaptation (best val checkpoint)
   "tokens_per_update": int, "device": str,
   "frozen_tables": [...], "frozen_runs": {...}, "goals": {...}, "gap_ratio": {...}, "arms": {...}, "sources": {...},
   "environment": {...}}                          # versions, commit, machine, collect's arguments (`args`)
and --png (default beside the JSON, so a --json named .png needs --png): validation PPL against updates per arm,
and the gap ratio (OAL - softmax) / (global - softmax) at each validation. Both are checked writable before the
records are read.

    .venv/bin/python -m benchmarks.budget run --out runs/budget-512 --adapt-len 512 --steps 256 --val-every 32
    .venv/bin/python -m benchmarks.budget table2 --out runs/t2-2048 --fidelity-len 2048 --layers 3-26
    .venv/bin/python -m benchmarks.budget collect --runs runs/budget-512 --table2 runs/t2-2048 \\
        --json benchmarks/reference/smollm2_budget.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks._common import _check_writable

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_METHODS = "oal,global,softmax"


class UsageError(Exception):
    """Bad input: printed as one line `Error: ...`, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own errors: one line and exit 2, as ours
        raise UsageError(message)


# ----------------------------------------------------------------------------------------------- the split plan


def budget_plan(*, adapt_len: int = 256, eval_len: int = 512, fidelity_len: int = 512, calib_len: int = 512,
                val_blocks: int = 8, test_blocks: int = 16, fidelity_blocks: int = 8, adapt_blocks: int = 0,
                preset: str = "smollm2-135m") -> dict:
    """The preset's split plan with other block lengths (a `SplitPlan.to_dict()`).

    The grouping prompts are the preset's. On the train split after them, in this order: the preset's numbers of
    calibration blocks (training, then validation) of `calib_len` tokens, `fidelity_blocks` of `fidelity_len`, and
    the adaptation blocks of `adapt_len` (`adapt_blocks` of them; 0: every block to the end of the split).
    Validation and test take the first `val_blocks` / `test_blocks` blocks of their splits (`test_blocks` 0: every
    complete block). With the preset's lengths and counts (adapt_blocks 256) this is the preset's plan."""
    from dataclasses import replace

    from oal.data.splits import BlockSet, default_plan

    for name, value, low in (("--adapt-len", adapt_len, 2), ("--eval-len", eval_len, 2),
                             ("--fidelity-len", fidelity_len, 2), ("--calib-len", calib_len, 2),
                             ("--val-blocks", val_blocks, 1), ("--test-blocks", test_blocks, 0),
                             ("--fidelity-blocks", fidelity_blocks, 1), ("--adapt-blocks", adapt_blocks, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise UsageError(f"{name}: expected an integer >= {low}, got {value!r}")
    base = default_plan(preset)
    end = int(max(hi for _, hi in base.grouping.token_ranges()))

    def following(length: int, count: int) -> BlockSet:  # `count` blocks of `length` on train after token `end`
        nonlocal end
        first = -(-end // length)
        end = (first + count) * length
        return BlockSet("train", length, list(range(first, first + count)))

    calib_train = following(calib_len, len(base.calib_train.indices))
    calib_val = following(calib_len, len(base.calib_val.indices))
    fidelity = following(fidelity_len, fidelity_blocks)
    adapt = (following(adapt_len, adapt_blocks) if adapt_blocks
             else BlockSet("train", adapt_len, [-(-end // adapt_len)], through_end=True))
    test = (BlockSet("test", eval_len, list(range(test_blocks))) if test_blocks
            else BlockSet("test", eval_len, [0], through_end=True))
    plan = replace(base, calib_train=calib_train, calib_val=calib_val, fidelity=fidelity, adapt_train=adapt,
                   val=BlockSet("validation", eval_len, list(range(val_blocks))), test=test,
                   notes=f"{base.notes}; benchmarks.budget: blocks of {calib_len} tokens for calibration, "
                   f"{fidelity_len} for fidelity, {adapt_len} for adaptation, {eval_len} for validation and test")
    return plan.to_dict()


def _plan_of(args) -> dict:
    return budget_plan(adapt_len=args.adapt_len, eval_len=args.eval_len, fidelity_len=args.fidelity_len,
                       calib_len=args.calib_len, val_blocks=args.val_blocks, test_blocks=args.test_blocks,
                       fidelity_blocks=args.fidelity_blocks, adapt_blocks=args.adapt_blocks, preset=args.preset)


# ----------------------------------------------------------------------------------------------- run, table2


def cmd_run(args) -> None:
    """`oal run` with the budget plan (resumable), through the pipeline's driver."""
    from oal.cli.options import set_threads
    from oal.device import resolve_device
    from oal.pipeline.config import RunConfig, parse_methods, parse_seeds
    from oal.pipeline.inputs import layer_selection
    from oal.pipeline.runs import run

    plan = _plan_of(args)
    try:
        seeds = parse_seeds(args.seeds)
        adapt = {"steps": args.steps, "val_every": args.val_every, "batch_size": args.batch_size}
        cfg = RunConfig.from_preset(args.preset, model=args.model, methods=parse_methods(args.methods), plan=plan,
                                    **layer_selection(args.layers, "fidelity"), seed=seeds[0],
                                    device=str(resolve_device(args.device)),  # recorded: where the arms trained
                                    dtype=args.dtype, adapt=adapt, zeroshot_tasks=[], window=args.window,
                                    sinks=args.sinks)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    set_threads(args.threads)
    run(cfg, args.out, seeds, progress=args.progress)


def cmd_table2(args) -> None:
    """Table 2 of every method at fidelity blocks of --fidelity-len tokens (what `oal diagnose --parts table2` does,
    with the budget plan's blocks), and a record of those blocks bound to diagnostics/table2.json."""
    import torch

    from oal.calibration.data import CalibConfig
    from oal.data import load_corpus
    from oal.data.splits import SplitPlan, plan_blocks
    from oal.device import resolve_device, resolve_dtype
    from oal.diagnostics.fidelity_table import TABLE2_METHODS
    from oal.diagnostics.runner import diagnose
    from oal.errors import parse_names
    from oal.models.registry import default_layers, load_model
    from oal.pipeline.config import PRESETS, grouping_preset
    from oal.pipeline.inputs import parse_layers
    from oal.rundir.claim import is_run_dir
    from oal.rundir.hashes import sha256_file, tensor_hash
    from oal.rundir.metrics import publish_evaluations, record_evaluation

    if is_run_dir(args.out):
        raise UsageError(f"--out: {args.out} is an `oal run` directory; Table 2 is recorded outside run directories")
    try:
        methods = parse_names(args.methods, TABLE2_METHODS, "methods")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    # only the grouping, calibration and fidelity blocks are read: one short block of each other role
    args.adapt_blocks, args.val_blocks, args.test_blocks = 1, 1, 1
    args.adapt_len = args.eval_len = args.fidelity_len
    plan = SplitPlan.from_dict(_plan_of(args))
    if args.threads:
        torch.set_num_threads(args.threads)
    name = args.model or PRESETS[args.preset]["model"]
    model, tok, _ = load_model(name, dtype=resolve_dtype(args.dtype), device=resolve_device(args.device))
    layers = parse_layers(args.layers, model.config.num_hidden_layers) if args.layers else default_layers(model)
    try:
        blocks = plan_blocks(load_corpus("builtin"), tok, plan)
    except ValueError as exc:
        raise UsageError(f"--fidelity-len/--fidelity-blocks: {exc}") from None
    out = Path(args.out)
    diagnose(model, blocks, layers, out, parts=["table2"], table2_methods=methods,  # `oal diagnose`'s defaults:
             grouping=grouping_preset(args.preset), calib_cfg=CalibConfig.preset("default", seed=0), seed=0)
    table = "diagnostics/table2.json"  # the blocks it was measured on, bound to it by its SHA256
    roles = {r: {"n": blocks[r].shape[0], "length": blocks[r].shape[1], "split": getattr(plan, r).split,
                 "indices": getattr(plan, r).indices, "sha256_16": tensor_hash(blocks[r])}
             for r in ("fidelity", "calib_train", "calib_val")}
    record_evaluation(out, "table2_blocks", [(("table2_blocks",), roles)], {table: sha256_file(out / table)})
    publish_evaluations(out)


# ----------------------------------------------------------------------------------------------- collect


def _parse_run_spec(spec: str) -> tuple[Path, list[str] | None]:
    """'DIR' or 'DIR:arm,arm' (only those arms of DIR)."""
    path, sep, arms = spec.rpartition(":")
    if not sep:
        return Path(spec), None
    names = [a.strip() for a in arms.split(",") if a.strip()]
    if not names:
        raise UsageError(f"--runs: expected DIR or DIR:arm,arm, got {spec!r}")
    return Path(path), names


def cmd_collect(args) -> None:
    from benchmarks._budget_records import RecordError
    from benchmarks._budget_study import collect, markdown, plot
    from benchmarks._common import environment
    from oal.rundir.files import atomic_write_json

    runs = [_parse_run_spec(s) for s in args.runs]
    for path, _ in runs:
        if not (path / "config.json").is_file():
            raise UsageError(f"--runs: {path} is not an `oal run` directory (no config.json)")
    for t in args.table2 or []:
        if not (t / ".oal" / "evaluations.json").is_file():
            raise UsageError(f"--table2: {t} holds no recorded Table 2 (no .oal/evaluations.json)")
    try:
        data = collect(runs, args.table2 or [], args.device)
    except RecordError as exc:
        raise UsageError(str(exc)) from None
    data["sources"] = {"runs": [str(p) + (":" + ",".join(a) if a else "") for p, a in runs],
                       "table2": [str(t) for t in args.table2 or []], "command": " ".join(sys.argv)}
    data["environment"] = environment(args)
    png = _png(args)
    for option, path, write in (("--json", args.json, lambda: atomic_write_json(args.json, data)),
                                ("--png", png, lambda: plot(data, png))):
        try:
            write()
        except OSError as exc:  # checked writable before the work (`_check`), but the disk may fill or change
            raise UsageError(f"{option}: cannot write {path} ({exc.strerror or exc})") from None
    print(markdown(data))


# ----------------------------------------------------------------------------------------------- the command line


def _plan_args(p) -> None:
    p.add_argument("--preset", default="smollm2-135m", help="preset whose protocol and blocks are kept (default "
                   "smollm2-135m)")
    p.add_argument("--model", default=None, help="model (default: the preset's)")
    p.add_argument("--fidelity-len", type=int, default=512, help="tokens per fidelity block (default 512)")
    p.add_argument("--fidelity-blocks", type=int, default=8, help="fidelity blocks (default 8)")
    p.add_argument("--calib-len", type=int, default=512, help="tokens per calibration block (default 512, the "
                   "preset's; 8 training and 2 validation blocks)")
    p.add_argument("--layers", default=None, help="converted layers, e.g. 3-26 or 5,15,25 (default: the preset's)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default="float32", help="base model dtype")
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")


def parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m benchmarks.budget", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter,
                 epilog="Outputs: run: the run directory (--out); table2: Table 2 in --out; collect: the study's JSON "
                        "(--json; default benchmarks/results/smollm2_budget.json) and a PNG beside it (--png)")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    r = sub.add_parser("run", help="an `oal run` with the budget plan (resumable)")
    r.add_argument("--out", type=Path, required=True, help="run directory (created or resumed)")
    _plan_args(r)
    r.add_argument("--methods", default=DEFAULT_METHODS, help=f"arms (default {DEFAULT_METHODS})")
    r.add_argument("--seeds", default="42", help="comma-separated seeds (several: DIR/seed-<s>/)")
    r.add_argument("--adapt-len", type=int, default=256, help="tokens per adaptation block (default 256)")
    r.add_argument("--adapt-blocks", type=int, default=0, help="adaptation blocks (default 0: to the end of train)")
    r.add_argument("--eval-len", type=int, default=512, help="tokens per validation and test block (default 512)")
    r.add_argument("--val-blocks", type=int, default=8, help="validation blocks (default 8)")
    r.add_argument("--test-blocks", type=int, default=16, help="test blocks (default 16; 0: every complete block)")
    r.add_argument("--steps", type=int, default=256, help="LoRA updates per arm (default 256)")
    r.add_argument("--val-every", type=int, default=32, help="updates between validations (default 32)")
    r.add_argument("--batch-size", type=int, default=1, help="blocks per update (default 1)")
    r.add_argument("--window", type=int, default=None, help="sliding window of the window methods (default 64)")
    r.add_argument("--sinks", type=int, default=None, help="attention sinks of the window methods (default 4)")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    t = sub.add_parser("table2", help="Table 2 of every method at --fidelity-len tokens (calibration only)")
    t.add_argument("--out", type=Path, required=True, help="output directory (not a run directory)")
    _plan_args(t)
    t.add_argument("--methods", default="all", help="Table 2 methods: 'all' or a comma list")
    c = sub.add_parser("collect", help="the study's JSON and figure from verified records")
    c.add_argument("--runs", nargs="+", required=True, help="run directories, DIR or DIR:arm,arm (only those arms)")
    c.add_argument("--table2", type=Path, nargs="*", help="Table 2 directories; the first gives 'frozen'")
    c.add_argument("--json", type=Path, default=RESULTS / "smollm2_budget.json", help="output JSON")
    c.add_argument("--png", type=Path, default=None, help="output figure (default: the JSON's name, .png)")
    c.add_argument("--device", default=None, help="device description (default: the runs' recorded device and "
                   "platform)")
    return ap


def _check(args) -> None:
    """Argument checks before any work."""
    if args.command in ("run", "table2"):
        from oal.data.splits import PLAN_PRESETS
        from oal.pipeline.config import PRESETS

        if args.preset not in PRESETS or args.preset not in PLAN_PRESETS:
            raise UsageError(f"--preset: expected one of {', '.join(p for p in PRESETS if p in PLAN_PRESETS)}, "
                             f"got {args.preset!r}")
        if args.out.exists() and not args.out.is_dir():
            raise UsageError(f"--out: {args.out} is a file")
        if args.threads < 0:
            raise UsageError(f"--threads: expected >= 0, got {args.threads}")
        if args.device not in ("auto", "cpu") and not args.device.startswith("cuda"):
            raise UsageError(f"--device: expected auto, cpu, cuda or cuda:N, got {args.device!r}")
        if args.command == "run":
            for name in ("steps", "val_every", "batch_size"):
                if getattr(args, name) < 1:
                    raise UsageError(f"--{name.replace('_', '-')}: expected an integer >= 1, got {getattr(args, name)}")
            _plan_of(args)
    else:  # the outputs, before the records are read and verified
        if args.json.suffix.lower() == ".png" and args.png is None:
            raise UsageError(f"--json: {args.json}: the figure goes beside the JSON as NAME.png and would replace "
                             "it; give the JSON's name (e.g. .json) or --png")
        if args.png is not None and args.png.expanduser().resolve() == args.json.expanduser().resolve():
            raise UsageError(f"--png: {args.png} is the --json file; expected another name")
        for option, path in (("--json", args.json), ("--png", _png(args))):
            if path.is_dir():
                raise UsageError(f"{option}: {path} is a directory; expected a file name")
            try:
                _check_writable(path, path.parent)
            except argparse.ArgumentTypeError as exc:
                raise UsageError(f"{option}: {exc}") from None


def _png(args) -> Path:
    """collect's figure: --png, or beside the JSON under its name."""
    return args.png or args.json.with_suffix(".png")


def main(argv=None) -> int:
    from oal.errors import InputError

    try:
        args = parser().parse_args(argv)
        _check(args)
        {"run": cmd_run, "table2": cmd_table2, "collect": cmd_collect}[args.command](args)
    except UsageError as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 2
    except InputError as exc:  # found by the library once it has the model and the data (e.g. too few blocks)
        print(f"Error: {exc.param}: {exc.message}" if exc.param else f"Error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a file or folder that cannot be read or written, found during the work
        print(f"Error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
