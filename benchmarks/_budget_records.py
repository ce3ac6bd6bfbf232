"""What `benchmarks.budget collect` reads: the verified records of `oal run` directories (the adaptation arms) and of
Table 2 directories (`benchmarks.budget table2`, `oal diagnose` outside a run directory). Nothing is read from a
log or from a file whose record does not verify; a missing or damaged record is a `RecordError` naming the file.

Run directories (`oal run`): `.oal/stages.json` records every stage's outputs and inputs with their SHA256
(`oal.rundir.stages.StageLog.verified`); an arm counts when its `adapt:<m>` stage verifies, and its numbers come
from that stage's `adapter/<m>/adapt.json` (validation NLL per validation) and the `perplexity:<m>` /
`perplexity_no_adapt:<m>` stages' JSON (test PPL after and before adaptation). A multi-seed run (`--seeds`) is its
`seed-<s>/` directories.

Table 2 directories: the evaluation records of `.oal/evaluations.json` (`oal.rundir.metrics.verified_evaluations`),
which bind the fidelity numbers to `diagnostics/table2.json` (its layers) by SHA256.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from oal.rundir.files import load_json
from oal.rundir.hashes import sha256_file
from oal.rundir.metrics import verified_evaluations
from oal.rundir.stages import StageLog

__all__ = ["Arm", "RecordError", "read_arms", "read_table2", "run_dirs"]

FIDELITY_KEYS = ("relmse", "relmse_post_o", "mse", "mse_post_o")
TABLE2_FILE = "diagnostics/table2.json"


class RecordError(ValueError):
    """A run or Table 2 directory whose records are missing or do not verify."""


@dataclass
class Arm:
    """One adapted arm of one seed: its validation curve, test PPL and what one update saw."""

    method: str
    seed: int
    run_dir: str
    layers: list[int]
    curve: list[list[float]]  # [[updates, val PPL], ...]
    test_ppl: float
    test_ppl_calibrated: float | None
    tokens_per_update: int
    best_step: int
    steps: int
    device: str
    platform: str
    extra: dict = field(default_factory=dict)


def run_dirs(path: Path) -> list[Path]:
    """`path` itself, or its `seed-<s>/` directories when it is a multi-seed run."""
    config = path / "config.json"
    if not config.is_file():
        raise RecordError(f"{path}: no config.json (not an `oal run` directory)")
    seeds = _load(config).get("seeds")
    if seeds:
        return [path / f"seed-{s}" for s in seeds]
    return [path]


def _load(path: Path):
    try:
        return load_json(path)
    except (OSError, ValueError) as exc:
        raise RecordError(f"{path}: unreadable ({exc})") from None


def _verified(log: StageLog, stage: str, where: Path) -> None:
    if stage not in log.stages:
        raise RecordError(f"{where}: stage {stage!r} has no record (not finished)")
    if not log.verified(stage):
        bad = log.damaged(stage) + log.stale_inputs(stage)
        raise RecordError(f"{where}: stage {stage!r} does not verify ({', '.join(bad[:3])} changed since it finished)")


def read_arms(path: Path, only: list[str] | None = None) -> list[Arm]:
    """The adapted arms of run directory `path` (each seed of a multi-seed run), or only the methods in `only`
    (each of which must be there). Arms not yet adapted and measured are left out unless named in `only`."""
    arms: list[Arm] = []
    for d in run_dirs(path):
        log = StageLog(d)
        _verified(log, "setup", d)
        config = _load(d / "config.json")
        cfg = config["config"]
        methods = only or [m for m in cfg["methods"]
                           if f"adapt:{m}" in log.stages and f"perplexity:{m}" in log.stages]
        missing = [m for m in methods if m not in cfg["methods"]]
        if missing:
            raise RecordError(f"{d}: no arm {missing[0]!r} (its methods: {', '.join(cfg['methods'])})")
        adapt_len = int(config["split_plan"]["adapt_train"]["block_len"])
        for m in methods:
            _verified(log, f"adapt:{m}", d)
            _verified(log, f"perplexity:{m}", d)
            res = _load(d / "adapter" / m / "adapt.json")
            before = None
            if f"perplexity_no_adapt:{m}" in log.stages:
                _verified(log, f"perplexity_no_adapt:{m}", d)
                before = float(_load(d / ".oal" / f"perplexity_no_adapt_{m}.json")["ppl"])
            curve = [[int(v["step"]), math.exp(float(v["val_nll"]))] for v in res["validation"]]
            arms.append(Arm(
                method=m, seed=int(cfg["seed"]), run_dir=str(d), layers=list(config["converted_layers"]),
                curve=curve, test_ppl=float(_load(d / ".oal" / f"perplexity_{m}.json")["ppl"]),
                test_ppl_calibrated=before, tokens_per_update=adapt_len * int(res.get("global_batch", 1)),
                best_step=int(res["best_step"]), steps=int(res["steps"]), device=str(cfg.get("device", "")),
                platform=str(config.get("versions", {}).get("platform", "")),
                extra={"val_blocks": config["blocks"]["val"]["shape"], "test_blocks": config["blocks"]["test"]["shape"],
                       "fidelity": _run_fidelity(log, d)}))
    return arms


def _run_fidelity(log: StageLog, d: Path) -> dict:
    """The run's own frozen fidelity (its calibrated kernels, its fidelity blocks), when that stage verifies."""
    if "fidelity" not in log.stages or not log.verified("fidelity"):
        return {}
    data = _load(d / ".oal" / "fidelity.json")
    return {m: {k: float(r[k]) for k in FIDELITY_KEYS} for m, r in data.items()}


def read_table2(path: Path) -> dict:
    """{"dir", "layers", "blocks", "calib_blocks", "methods": {method: {relmse, relmse_post_o, mse, mse_post_o}}} of
    a Table 2 directory, from its verified evaluation records. "blocks" and "calib_blocks" ([n, length] of the
    held-out and the calibration training blocks) are known when `benchmarks.budget table2` wrote the directory (its
    `table2_blocks` record), else None."""
    entries, _, inputs = verified_evaluations(path)
    table = path / TABLE2_FILE
    if TABLE2_FILE not in inputs:
        raise RecordError(f"{path}: no verified Table 2 record (run `python -m benchmarks.budget table2 --out {path}` "
                          "or `oal diagnose --parts table2` there)")
    if not table.is_file() or sha256_file(table) != inputs[TABLE2_FILE]:
        raise RecordError(f"{table}: changed since its fidelity was recorded")
    methods, roles = {}, {}
    for key, value in entries:
        if len(key) == 2 and key[0] == "fidelity":
            methods[key[1]] = {k: float(value[k]) for k in FIDELITY_KEYS}
        elif tuple(key) == ("table2_blocks",):
            roles = {r: [int(v["n"]), int(v["length"])] for r, v in value.items()}
    return {"dir": str(path), "layers": list(_load(table)["layers"]), "blocks": roles.get("fidelity"),
            "calib_blocks": roles.get("calib_train"), "methods": methods}
