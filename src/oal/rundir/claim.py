"""One run directory, one configuration (design.md "provenance binds").

`claim_run_dir` is called once the model and data are loaded and checked, before anything is written: it refuses a
directory that holds a run of another configuration (naming the keys that differ), or results of unknown origin,
unless `force=True`, which deletes the old results first. `multi_seed_layout` does the same for the choice between a
single-seed directory and a multi-seed one (`seed-<s>/` below an aggregate).
"""

from __future__ import annotations

import logging
from pathlib import Path

from oal.errors import InputError
from oal.rundir.files import clean_tmp, load_json, remove
from oal.rundir.stages import StageLog

__all__ = ["RUN_ENTRIES", "claim_run_dir", "clear_run", "config_diff", "identity", "is_run_dir", "multi_seed_layout",
           "refuse_run_dir"]

log = logging.getLogger("oal")

# What `oal run` (and `oal diagnose` into a run) writes into a run directory (design.md); `clear_run` deletes these
# and nothing else. The report reads budget.json, regime.json and candidates/ as found: a forced run must not show an
# earlier configuration's.
RUN_ENTRIES = ("config.json", "groups.json", "analysis.json", "regime.json", "budget.json", "selection.json",
               "kernels.safetensors", "kernels.json", "calibration.json", "metrics.json", "report.md", "kernels",
               "candidates", "adapter", "figures", "diagnostics", "zeroshot_samples", ".oal")
# Configuration keys that do not change the numbers' meaning: where things run and where local files live, as typed
# (their content is what counts, and `identity` holds it: the model's SHA256 and the corpus's). So a run resumes
# when --data or --model names the same files by another path.
RUNTIME_KEYS = ("device", "data", "data_dir", "model", "zeroshot_dir")
# Configuration keys of the last evaluations only: changing them on a finished run reruns just the stages that read
# them (their keys hold the data's hashes) and metrics.json is rebuilt from the stages that verify.
EVALUATION_KEYS = ("config.zeroshot_tasks", "config.zeroshot_limit", "config.zeroshot_files")


# what to do about a run directory that cannot be resumed
START_CLEAN = ("use another --out, or start clean with --force (of `oal run` or `oal select-layers`; it deletes the "
               "results)")


def identity(config: dict) -> dict:
    """The parts of a config.json that define a run: the configuration (less runtime keys), the converted layers,
    the split plan, and the SHA256 of the model (files and tensors) and of the data."""
    cfg = {k: v for k, v in _object(config.get("config")).items() if k not in RUNTIME_KEYS}
    model = _object(config.get("model"))
    return {"config": cfg, "converted_layers": config.get("converted_layers"),
            "split_plan": config.get("split_plan"),
            "model": {k: model.get(k) for k in ("sha256", "state_dict_sha256")},
            "data": _object(config.get("data")).get("sha256"), "seeds": config.get("seeds")}


def _object(value) -> dict:
    """`value` when a JSON object, else {} (a damaged record then differs from any configuration)."""
    return value if isinstance(value, dict) else {}


def _flat(d, prefix="") -> dict:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: d}


def config_diff(old: dict, new: dict) -> list[tuple[str, object, object]]:
    """(dotted key, recorded value, new value) for every key of `identity` that differs."""
    a, b = _flat(identity(old)), _flat(identity(new))
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _short(v) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def is_run_dir(path: str | Path) -> bool:
    """True when `path` holds (part of) an `oal run` directory: a config.json or stage records."""
    path = Path(path)
    return (path / "config.json").is_file() or (path / ".oal" / "stages.json").is_file()


def refuse_run_dir(path: str | Path, what: str) -> None:
    """A stage command (`oal analyze`, `oal calibrate`) must not rewrite one part of an `oal run` directory behind
    its records: the rest of the run (metrics, report) would then describe other files."""
    if is_run_dir(path):
        raise InputError(f"{path} is an `oal run` directory; its {what} is one of its stages (rerun `oal run --out "
                         f"{path}`), so write to another --out", "--out", "out_dir")


def _seed_dirs(path: Path) -> list[Path]:
    return sorted(p for p in path.glob("seed-*") if p.is_dir())


def clear_run(path: str | Path) -> None:
    """Delete what `oal run` writes into `path` (and its seed-<s>/ folders); anything else is left alone (the lock
    file of `rundir.lock` too: the running command holds it)."""
    path = Path(path)
    for name in RUN_ENTRIES:
        remove(path / name)
    for p in _seed_dirs(path):
        clear_run(p)
        if not any(p.iterdir()):
            p.rmdir()
    log.info("--force: deleted the previous results in %s", path)


def claim_run_dir(path: str | Path, config: dict, *, force: bool = False, allow: tuple[str, ...] = ()) -> None:
    """Make `path` the run directory of `config` (the config.json about to be written) or refuse.

    Refused (InputError on --out) unless `force`: a config.json of another configuration (keys outside `allow`
    and EVALUATION_KEYS differ), a damaged config.json, or run results without a config.json. With `force` those
    results are deleted.
    Temporary files left by a killed run are removed.
    """
    path = Path(path)
    recorded = path / "config.json"
    problem = None
    if recorded.exists():
        try:
            old = load_json(recorded)
            if not isinstance(old, dict) or not isinstance(old.get("config"), dict):
                raise ValueError(f"{recorded}: damaged, expected a run configuration")
        except ValueError as exc:
            problem = f"{exc}"
        else:
            diff = [d for d in config_diff(old, config) if not d[0].startswith((*allow, *EVALUATION_KEYS))]
            if diff:
                shown = "; ".join(f"{k}: {_short(a)} recorded, {_short(b)} now" for k, a, b in diff[:6])
                more = f" (and {len(diff) - 6} more)" if len(diff) > 6 else ""
                problem = f"{recorded} records a run of another configuration ({shown}{more})"
    else:
        found = [n for n in RUN_ENTRIES if (path / n).exists() and n not in ("figures",)]
        if found:
            problem = f"{path} holds results of unknown origin ({', '.join(found)}) without a config.json"
    if problem is None and (path / ".oal" / "stages.json").is_file():
        try:
            StageLog(path)
        except ValueError as exc:
            problem = str(exc)
    if problem is not None:
        if not force:
            raise InputError(f"{problem}; {START_CLEAN}", "--out", "out_dir")
        clear_run(path)
    path.mkdir(parents=True, exist_ok=True)
    clean_tmp(path)


def multi_seed_layout(path: str | Path, seeds: list[int], *, force: bool = False) -> None:
    """Refuse a single-seed run over a multi-seed directory and the reverse, or other seeds than recorded (unless
    `force`, which deletes the old results)."""
    path = Path(path)
    problem = None
    seed_dirs = [p.name for p in _seed_dirs(path) if is_run_dir(p)]
    try:
        top = load_json(path / "config.json") if (path / "config.json").is_file() else None
    except ValueError:
        if not force:
            raise
        clear_run(path)
        return
    recorded = (top or {}).get("seeds") if isinstance(top, dict) else None
    if recorded is not None and not isinstance(recorded, list):
        if not force:
            raise InputError(f"{path / 'config.json'}: damaged, 'seeds' must be a list of seeds; use another --out, "
                             "or --force to start clean", "--out", "out_dir")
        clear_run(path)
        return
    if len(seeds) == 1 and (seed_dirs or recorded):
        problem = (f"{path} holds a multi-seed run ({', '.join(seed_dirs) or recorded}); a single-seed run would "
                   "overwrite its aggregate: use another --out, the same --seeds, or --force to start clean")
    elif len(seeds) > 1:
        if (path / ".oal" / "stages.json").is_file() or (top is not None and recorded is None):
            problem = (f"{path} holds a single-seed run; a multi-seed run would mix with it: use another --out, or "
                       "--force to start clean")
        elif recorded is not None and list(recorded) != list(seeds):
            problem = (f"{path} holds a run over seeds {recorded}, not {seeds}: use another --out, the same --seeds, "
                       "or --force to start clean")
    if problem is not None:
        if not force:
            raise InputError(problem, "--seeds", "seeds")
        clear_run(path)
