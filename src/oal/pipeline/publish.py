"""metrics.json and report.md after `oal evaluate`: rebuilt from the records that verify, never merged into.

`oal evaluate` records each measurement (`rundir.metrics.record_evaluation`) and then calls `republish`: in an `oal
run` directory, the run's own stage outputs whose records verify plus the evaluation records that verify make the new
metrics.json and report.md (`StagedRun.publish`, the same code `oal run` ends with); in any other directory, the
evaluation records alone make metrics.json. A number edited into metrics.json is never read back.

`verified_metrics` rebuilds the same numbers without writing anything: what `oal export` quotes in a model card
(`export_run`), so an edited metrics.json never reaches a card either.

`check_publishable` runs first, before any model is loaded: a run directory whose stage outputs (or the files they
read) have changed since they were recorded is refused, since its other numbers would describe files that are no
longer on disk.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rich.console import Console

from oal.pipeline.base import EVALUATION_VERSIONS, StagedRun, tidy_zeroshot
from oal.pipeline.config import RunConfig
from oal.pipeline.records import run_config, selection_record
from oal.rundir.claim import is_run_dir
from oal.rundir.metrics import METRICS_FILE, publish_evaluations
from oal.rundir.stages import StageLog

__all__ = ["check_publishable", "export_run", "republish", "verified_metrics"]

log = logging.getLogger("oal")


def _run_config(run_dir: Path) -> dict:
    from oal.pipeline.inputs import one_seed_run

    config = run_config(run_dir / "config.json")
    one_seed_run(run_dir, config)
    return config


def check_publishable(run_dir: str | Path) -> None:
    """Refuse (ValueError naming the files) an `oal run` directory whose records no longer verify."""
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        return
    _run_config(run_dir)
    log = StageLog(run_dir)
    changed = sorted({f for s in log.stages if s != "report" for f in log.damaged(s) + log.stale_inputs(s)})
    if changed:
        raise ValueError(f"{run_dir / METRICS_FILE}: its numbers were computed from files that have changed since "
                         f"({', '.join(changed[:4])}); rerun `oal run --out {run_dir}` to bring it up to date first")


def _recorded_run(run_dir: Path, console: Console | None) -> StagedRun:
    """The run of `run_dir` as its records describe it (no model loaded): configuration, layers, stage log."""
    from oal.pipeline.decoder import SELECTION_FILE, Run

    config = _run_config(run_dir)
    log = StageLog(run_dir)
    log.check_config()
    cfg = RunConfig.from_dict({**config["config"], "device": "cpu"})  # nothing runs: no device needed
    if config.get("protocol") == "encoder":
        from oal.pipeline.encoder import EncoderRun as cls
    else:
        cls = Run
    r = cls(cfg, run_dir, console=console or Console(quiet=True), progress=False)
    r.log = log
    layers = config.get("converted_layers")
    if isinstance(layers, dict):  # --layers auto:K: the selection's layers once it verifies
        layers = selection_record(run_dir / SELECTION_FILE)["chosen"] if log.verified("select") else \
            layers.get("candidates")
    r.layers = layers
    r.zeroshot_skipped = dict((log.stages.get("report") or {}).get("zeroshot_skipped") or {})
    return r


def republish(run_dir: str | Path, console: Console | None = None) -> dict:
    """Rewrite metrics.json (and report.md in an `oal run` directory) from the records that verify; the new
    metrics."""
    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        return publish_evaluations(run_dir, tidy_zeroshot, EVALUATION_VERSIONS)
    r = _recorded_run(run_dir, console)
    return r.publish(r.log.verified)


def verified_metrics(run_dir: str | Path) -> dict:
    """The numbers of `run_dir` rebuilt from its records that verify, as `republish` would write them (nothing is
    written): an `oal run` directory whose stage files changed since they were recorded is refused (ValueError, as
    `oal evaluate` refuses it); a number edited into metrics.json is not read, and a warning says it is left out."""
    from oal.rundir.metrics import apply_entries, verified_evaluations

    run_dir = Path(run_dir)
    if not is_run_dir(run_dir):
        entries, defaults, inputs = verified_evaluations(run_dir, EVALUATION_VERSIONS)
        return tidy_zeroshot({**apply_entries(dict(defaults), entries), "sha256": inputs})
    check_publishable(run_dir)
    r = _recorded_run(run_dir, None)
    if (run_dir / METRICS_FILE).is_file() and METRICS_FILE in r.log.damaged("report"):
        log.warning("%s was changed since oal wrote it; its numbers are rebuilt from the verified records (the "
                    "edited numbers are not quoted)", run_dir / METRICS_FILE)
    return r.metrics(r.log.verified)


def export_run(run_dir: str | Path, method: str, to: str | Path, **kwargs) -> Path:
    """`oal export`: `artefact.export.export` with a model card that quotes the run's verified numbers
    (`verified_metrics`) and its corpus (config.json, checked against its stage record in an `oal run` directory)."""
    from oal.artefact.export import export

    run_dir = Path(run_dir)
    metrics = verified_metrics(run_dir)
    config = run_config(run_dir) if is_run_dir(run_dir) else None
    if (config or {}).get("protocol") == "encoder":
        if kwargs.get("adapter"):  # asked for (the default, None, takes one where the run has it)
            log.info("%s is an encoder run, which oal does not adapt: exported without an adapter", run_dir)
        kwargs["adapter"] = False
    return export(run_dir, method, to, metrics=metrics, config=config, **kwargs)
