"""metrics.json holds only numbers of verified records: it is rebuilt, never edited in place.

Two kinds of record feed it:
- the stages of `oal run` (`.oal/stages.json`; `pipeline.base.StagedRun.metrics` reads the stage outputs whose
  records verify);
- what `oal evaluate` (and `oal diagnose` outside a run directory) measured: `record_evaluation` writes each
  measurement as a record in `.oal/evaluations.json`: its entries of metrics.json (in `.oal/evaluate/<name>.json`,
  whose SHA256 the record holds) and the SHA256 of the run files it was measured on (kernels, adapter).
  `verified_evaluations` returns the entries of the records that still verify, oldest first; one whose files
  changed since (the adapter was retrained, a number was edited) is left out, and so is one measured by another
  version of its scorer than the reader requires (`versions`: a zero-shot score of an older tokenisation).
  `drop_evaluations` forgets the records a stage of `oal run` has just measured again.

A number typed into metrics.json is therefore never republished: the next rebuild replaces the file. A rebuild also
records metrics.json's SHA256 (the report stage of `oal run` does), so an edited copy is reported when replaced.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from oal.rundir.files import atomic_write_json, load_json, remove
from oal.rundir.hashes import config_hash
from oal.rundir.stages import StageLog

__all__ = ["EVALUATIONS", "METRICS_FILE", "Versions", "apply_entries", "drop_evaluations", "publish_evaluations",
           "record_evaluation", "verified_evaluations"]

log = logging.getLogger("oal")

METRICS_FILE = "metrics.json"
EVALUATIONS = "evaluations.json"  # below DIR/.oal/, beside stages.json
_VALUES = ".oal/evaluate"

Entry = tuple[Sequence[str], object]  # (key path in metrics.json, value), e.g. (("fidelity", "oal"), {...})
# record-name prefix -> the versions a record of that name must carry, e.g. {"zeroshot:": {"zeroshot_scoring": 2}}
Versions = Mapping[str, Mapping[str, object]]


def record_evaluation(run_dir: str | Path, name: str, entries: Iterable[Entry], inputs: Mapping[str, str], *,
                      defaults: Mapping | None = None, versions: Mapping[str, object] | None = None) -> None:
    """Record one measurement `name` (it replaces an earlier record of that name): the `entries` it sets in
    metrics.json, measured on `inputs` (run files relative to DIR -> SHA256); `defaults` fill top-level keys that
    are absent (a directory that is not an `oal run` directory has no model or layers of its own); `versions`: of
    the code that measured it (`verified_evaluations` leaves the record out once a reader requires others)."""
    run_dir = Path(run_dir)
    records = StageLog(run_dir, EVALUATIONS)
    rel = f"{_VALUES}/{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.json"
    value = {"entries": [[list(path), v] for path, v in entries], "defaults": dict(defaults or {})}
    atomic_write_json(run_dir / rel, value)
    seq = 1 + max((int(r.get("seq", 0)) for r in records.stages.values()), default=0)
    records.mark(name, config_hash({"value": value, "inputs": dict(inputs)}), None, outputs=[rel],
                 inputs=dict(inputs), seq=seq, **({"versions": dict(versions)} if versions else {}))


def drop_evaluations(run_dir: str | Path, prefix: str) -> None:
    """Forget the evaluation records whose name starts with `prefix`, and their values: a stage of `oal run` has
    measured the same numbers again, and an older measurement must not win over them."""
    run_dir = Path(run_dir)
    if not (run_dir / ".oal" / EVALUATIONS).is_file():
        return
    records = StageLog(run_dir, EVALUATIONS)
    gone = [name for name in records.stages if name.startswith(prefix)]
    if gone:
        for name in gone:
            for out in records.stages.pop(name).get("outputs") or []:
                remove(run_dir / out)
        atomic_write_json(records.path, records.stages)


def _stale_version(name: str, rec: dict, versions: Versions | None) -> str | None:
    """Which required version a record lacks (None when it has them all)."""
    have = rec.get("versions") if isinstance(rec.get("versions"), dict) else {}
    for prefix, want in (versions or {}).items():
        if name.startswith(prefix):
            for key, value in want.items():
                if have.get(key) != value:
                    return f"{key} {have.get(key, 'unrecorded')}, now {value}"
    return None


def verified_evaluations(run_dir: str | Path, versions: Versions | None = None
                         ) -> tuple[list[Entry], dict, dict[str, str]]:
    """(entries, defaults, inputs' SHA256) of the evaluation records of DIR that verify and carry the `versions`
    required of their names, oldest first."""
    run_dir = Path(run_dir)
    if not (run_dir / ".oal" / EVALUATIONS).is_file():
        return [], {}, {}
    records = StageLog(run_dir, EVALUATIONS)
    entries: list[Entry] = []
    defaults: dict = {}
    inputs: dict[str, str] = {}
    if any(type(r.get("seq", 0)) is not int for r in records.stages.values()):
        raise ValueError(f"{records.path}: damaged, a record's 'seq' is not an integer")
    for name, rec in sorted(records.stages.items(), key=lambda kv: kv[1].get("seq", 0)):
        if not records.verified(name):
            changed = records.damaged(name) + records.stale_inputs(name)
            log.info("metrics.json: leaving out %s (%s changed since it was measured)", name, ", ".join(changed[:3]))
            continue
        stale = _stale_version(name, rec, versions)
        if stale:
            log.warning("metrics.json: leaving out %s, measured by an older oal (%s); `oal evaluate` measures it "
                        "again", name, stale)
            continue
        more, more_defaults = _read_value(run_dir / rec["outputs"][0])
        entries += more
        defaults.update(more_defaults)
        inputs.update(rec.get("inputs") or {})
    return entries, defaults, inputs


def _read_value(path: Path) -> tuple[list[Entry], dict]:
    """(entries, defaults) of one measurement's file, as `record_evaluation` writes it; ValueError naming the file
    for any other shape (its SHA256 matching its record says who wrote it, not that it is well formed)."""
    value = load_json(path)
    entries = value.get("entries") if isinstance(value, dict) else None
    defaults = (value.get("defaults") or {}) if isinstance(value, dict) else None
    if not isinstance(entries, list) or not isinstance(defaults, dict) or not all(
            isinstance(e, list) and len(e) == 2 and isinstance(e[0], list) and e[0]
            and all(isinstance(k, str) for k in e[0]) for e in entries):
        raise ValueError(f"{path}: damaged, expected {{'entries': [[[key, ...], value], ...], 'defaults': {{...}}}}")
    return [(tuple(keys), v) for keys, v in entries], defaults


def apply_entries(metrics: dict, entries: Iterable[Entry]) -> dict:
    """Set each entry's value at its key path of `metrics` (later entries win)."""
    for path, value in entries:
        d = metrics
        for key in path[:-1]:
            d = d.setdefault(key, {})
            if not isinstance(d, dict):  # an earlier entry set a number where this one needs an object
                raise ValueError(f"metrics: entry {'.'.join(path)} lies below the value of {key!r}, not an object "
                                 f"(damaged evaluation records in .oal/{EVALUATIONS}?)")
        d[path[-1]] = value
    return metrics


def publish_evaluations(run_dir: str | Path, finish: Callable[[dict], dict] | None = None,
                        versions: Versions | None = None) -> dict:
    """metrics.json of a directory that is not an `oal run` directory: the verified evaluation records alone
    (`finish` tidies the result before it is written; `versions` as `verified_evaluations`)."""
    entries, defaults, inputs = verified_evaluations(run_dir, versions)
    metrics = apply_entries(dict(defaults), entries)
    metrics["sha256"] = inputs
    metrics = finish(metrics) if finish is not None else metrics
    atomic_write_json(Path(run_dir) / METRICS_FILE, metrics)
    return metrics
