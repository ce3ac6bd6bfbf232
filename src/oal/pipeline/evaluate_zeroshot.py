"""Zero-shot PIQA / HellaSwag / ARC-E (Table 3, App. F.3) of a run directory's arms, into its metrics.json
(`oal evaluate --zeroshot`).

Each arm is loaded as `artefact.arms.load_arm` does (the recorded base model, checked; the kernels; the run's
adapter by default) and scored by `evaluate.zeroshot.evaluate_tasks`; each (arm, task) score is recorded with the
SHA256 of the run files it read (`rundir.metrics.record_evaluation`), and metrics.json and report.md are rebuilt from
the records that verify (`pipeline.publish.republish`), under the directory's lock. A task whose data is not
available is skipped with one line and recorded under `zeroshot_skipped`: never a made-up number. Scoring some of
the run's methods on other rows than the others' numbers of a task were (another file or --limit) is refused: a
task has one data record and one report column.

`log_samples=True` (`oal evaluate --zeroshot --log-samples`) also writes DIR/zeroshot_samples/<method>.json: per
task, per example, each candidate's log-likelihood and token count, the gold label and the predictions
(`evaluate.zeroshot.sample_records`), with the SHA256 of the run files and the data it was computed from.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from oal.errors import InputError
from oal.pipeline.config import check_task_files
from oal.rundir.lock import own_dir

__all__ = ["SAMPLES_DIR", "evaluate_zeroshot"]

log = logging.getLogger("oal")

SAMPLES_DIR = "zeroshot_samples"


def evaluate_zeroshot(out_dir: str | Path, methods: Sequence[str], *, model: str | None = None, tasks=None,
                      task_files: dict | None = None, zeroshot_dir: str | None = None, limit: int | None = None,
                      adapter: bool | None = None, device: str = "cpu", dtype=None, progress: bool = True,
                      console=None, log_samples: bool = False) -> dict[str, dict]:
    """{method: {task: {acc, acc_norm, acc_norm_lmeval, n}}} for the tasks whose data is available (possibly none)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise InputError(f"no such run directory: {out_dir}", "--out", "out_dir")
    if not methods:
        raise InputError("expected at least one method", "--methods", "methods")
    check_task_files(tasks, task_files)
    with own_dir(out_dir):
        res = _evaluate(out_dir, methods, model=model, tasks=tasks, task_files=task_files, zeroshot_dir=zeroshot_dir,
                        limit=limit, adapter=adapter, device=device, dtype=dtype, progress=progress, console=console,
                        log_samples=log_samples)
    from oal.pipeline.runs import refresh_aggregate

    refresh_aggregate(out_dir, console)  # a seed of a multi-seed run: its aggregate takes the new numbers
    return res


def _evaluate(out_dir: Path, methods, *, model, tasks, task_files, zeroshot_dir, limit, adapter, device, dtype,
              progress, console, log_samples) -> dict[str, dict]:
    from oal.artefact.arms import arm_inputs, load_arm
    from oal.data.zeroshot import skip_lines
    from oal.evaluate.zeroshot import SCORING_VERSION, evaluate_tasks, load_tasks
    from oal.pipeline.publish import check_publishable, republish
    from oal.rundir.files import atomic_write_json
    from oal.rundir.metrics import record_evaluation

    check_publishable(out_dir)
    sets, skipped = load_tasks(tasks, data_dir=zeroshot_dir, task_files=task_files, limit=limit)
    for line in skip_lines(skipped):
        log.warning("%s", line)
    provenance = {t: prov for t, (_, prov) in sets.items()}
    _check_same_data(out_dir, methods, sets)
    scores: dict[str, dict] = {}
    for m in methods if sets else ():
        model_m, tok, info = load_arm(out_dir, m, adapter, model=model, dtype=dtype, device=device)
        samples = {} if log_samples else None
        scores[m] = evaluate_tasks(model_m, tok, sets, progress=progress, description=f"zeroshot:{m}",
                                   samples=samples)
        inputs = arm_inputs(out_dir, m, info["adapter"])
        if samples is not None:
            atomic_write_json(out_dir / SAMPLES_DIR / f"{m}.json", {"method": m, "inputs": inputs,
                                                                   "data": provenance, "tasks": samples})
        for t, score in scores[m].items():  # zeroshot.<m>.<task> per task (the method's other tasks kept)
            record_evaluation(out_dir, f"zeroshot:{m}:{t}", [(("zeroshot", m, t), score),
                                                             (("zeroshot_data", t), provenance[t])], inputs,
                              versions={"zeroshot_scoring": SCORING_VERSION})
    for t, why in skipped.items():
        record_evaluation(out_dir, f"zeroshot_skipped:{t}", [(("zeroshot_skipped", t), why)], {})
    republish(out_dir, console)
    return scores


def _check_same_data(out_dir: Path, methods, sets: dict) -> None:
    """InputError where a method left out of `methods` has a number for a task measured on other rows (another file,
    another --limit): metrics.json keeps one data record per task and the report one column, so scoring some methods
    alone would put numbers of different data side by side under it."""
    from oal.pipeline.publish import verified_metrics

    current = verified_metrics(out_dir)
    for t, (examples, prov) in sets.items():
        old = (current.get("zeroshot_data") or {}).get(t) or {}
        others = sorted(m for m, res in (current.get("zeroshot") or {}).items() if m not in methods and t in res
                        and (res[t].get("n") != len(examples) or old.get("sha256") not in (None, prov["sha256"])))
        if others:
            n = current["zeroshot"][others[0]][t].get("n")
            was, now = str(old.get("sha256"))[:12], prov["sha256"][:12]
            raise InputError(f"{t}: {', '.join(others)} scored {n} examples of the file of SHA256 {was}, this "
                             f"would score {len(examples)} of {now}; "
                             f"one table would mix them: score them too (--methods "
                             f"{','.join([*methods, *others])}) or pass the same data and --limit", "--methods",
                             "methods")


def zeroshot_table(scores: dict) -> Table:
    """`evaluate_zeroshot`'s scores for the terminal (%; acc_norm is the paper's normalisation)."""
    from oal.data.zeroshot import DISPLAY_NAMES

    table = Table(title="zero-shot accuracy (%; acc_norm: the paper's normalisation)")
    for col in ("method", "task", "acc", "acc_norm", "acc_norm (lm-eval)", "n"):
        table.add_column(col, justify="right")
    for m, res in scores.items():
        for t, r in res.items():
            table.add_row(m, DISPLAY_NAMES[t], *(f"{r[k]:.2f}" for k in ("acc", "acc_norm", "acc_norm_lmeval")),
                          str(r["n"]))
    return table
