"""metrics.json outside `oal run`: the one merge that commands changing part of a run go through.

metrics.json records, under "sha256", the SHA256 of every file its numbers were computed from (kernels, adapters,
config.json). `update_metrics` refuses to merge new numbers into a metrics.json whose recorded files have changed
since (its other numbers would then describe a model that is no longer on disk), merges and records the new inputs
(`pipeline.report.merge_and_report` rewrites report.md after it, so the report never lags behind).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from oal.rundir.files import atomic_write_json, load_json
from oal.rundir.hashes import sha256_file

__all__ = ["METRICS_FILE", "changed_inputs", "read_metrics", "update_metrics"]

METRICS_FILE = "metrics.json"


def read_metrics(run_dir: str | Path) -> dict:
    """DIR/metrics.json as a dict ({} when absent); a damaged file is a ValueError naming it."""
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return {}
    metrics = load_json(path)
    if not isinstance(metrics, dict):
        raise ValueError(f"{path}: damaged, expected a JSON object")
    return metrics


def changed_inputs(run_dir: str | Path, metrics: Mapping) -> list[str]:
    """Files recorded in metrics["sha256"] that are missing or no longer have the recorded SHA256."""
    run_dir = Path(run_dir)
    recorded = metrics.get("sha256") or {}
    return sorted(f for f, h in recorded.items() if not (run_dir / f).is_file() or sha256_file(run_dir / f) != h)


def update_metrics(run_dir: str | Path, sections: Mapping[str, Mapping], inputs: Mapping[str, str], *,
                   defaults: Mapping | None = None) -> dict:
    """Merge `sections` ({"fidelity": {method: {...}}, ...}) into DIR/metrics.json; `inputs` maps the files (relative
    to DIR) the new numbers were computed from to their SHA256; `defaults` fills top-level keys that are absent.
    Returns the new metrics."""
    run_dir = Path(run_dir)
    metrics = read_metrics(run_dir)
    stale = changed_inputs(run_dir, metrics)
    if stale:
        raise ValueError(f"{run_dir / METRICS_FILE}: its numbers were computed from files that have changed since "
                         f"({', '.join(stale[:4])}); rerun `oal run --out {run_dir}` to bring it up to date first")
    for key, value in (defaults or {}).items():
        metrics.setdefault(key, value)
    for section, values in sections.items():
        metrics.setdefault(section, {}).update(values)
    metrics["sha256"] = {**(metrics.get("sha256") or {}), **inputs}
    atomic_write_json(run_dir / METRICS_FILE, metrics)
    return metrics
