"""Stage records of a run directory (`DIR/.oal/stages.json`): a stage is skipped only when its key matches and the
files it wrote still hash as recorded, so a damaged output is recomputed rather than trusted. The same records, in
`DIR/.oal/evaluations.json`, hold what `oal evaluate` measured (`rundir.metrics`)."""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone
from pathlib import Path

from oal.rundir.files import atomic_write_json, load_json
from oal.rundir.hashes import sha256_file, sha256_tree

__all__ = ["StageLog", "Timer"]

log = logging.getLogger("oal")


class StageLog:
    """Stage-done markers in `DIR/.oal/stages.json`: stage -> {key, outputs, sha256, inputs, elapsed_s, finished}.

    `done(stage, key)` is True only when the stage finished with the same key (the hash of its configuration and
    of the files it read) and every file it wrote still has the SHA256 recorded when it finished.
    """

    def __init__(self, run_dir: str | Path, name: str = "stages.json"):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / ".oal" / name
        self.stages: dict = load_json(self.path) if self.path.exists() else {}
        if not isinstance(self.stages, dict) or not all(isinstance(v, dict) for v in self.stages.values()):
            raise ValueError(f"{self.path}: damaged, expected a JSON object of stage records")
        for stage, rec in self.stages.items():  # checked before any recorded file is read (hashed)
            shape = _bad_shape(rec)
            if shape:
                raise ValueError(f"{self.path}: damaged, stage {stage!r}: {shape}")
            outside = [p for p in _recorded_paths(rec) if not _within(self.run_dir, p)]
            if outside:
                raise ValueError(f"{self.path}: stage {stage!r} records {outside[0]!r}, a path outside the run "
                                 "directory; oal reads nothing outside it (restore the file, or start the run again "
                                 "with --force)")
        self._verified: set[str] = set()

    def outputs_hash(self, outputs) -> dict[str, str]:
        out: dict[str, str] = {}
        for o in outputs:
            out.update(sha256_tree(self.run_dir, o))
        return out

    def damaged(self, stage: str) -> list[str]:
        """Recorded outputs of `stage` that are missing or whose SHA256 changed (all of them without a record)."""
        rec = self.stages.get(stage) or {}
        want = rec.get("sha256")
        if not isinstance(want, dict) or not want:
            return [str(o) for o in rec.get("outputs", [])] or ["(no recorded outputs)"]
        have = self.outputs_hash(rec.get("outputs", []))
        return sorted(f for f in set(want) | set(have) if want.get(f) != have.get(f))

    def stale_inputs(self, stage: str) -> list[str]:
        """Files `stage` read (its recorded inputs) that are missing or no longer have the recorded SHA256."""
        read = (self.stages.get(stage) or {}).get("inputs") or {}
        have = self.outputs_hash(read)
        return sorted(f for f, h in read.items() if have.get(f) != h)

    def verified(self, stage: str) -> bool:
        """True when `stage` has a record whose outputs and inputs still hash as recorded: its numbers describe the
        files on disk (the record's key, the configuration, is not checked here: `done` does that)."""
        return stage in self.stages and not self.damaged(stage) and not self.stale_inputs(stage)

    def done(self, stage: str, key: str) -> bool:
        rec = self.stages.get(stage)
        if rec is None or rec.get("key") != key:
            return False
        if stage in self._verified:
            return True
        bad = self.damaged(stage)
        if bad:
            log.warning("stage %s: %s changed or missing since it finished (SHA256 differs from %s); recomputing",
                        stage, ", ".join(bad[:4]) + (" ..." if len(bad) > 4 else ""), self.path)
            return False
        self._verified.add(stage)
        return True

    def mark(self, stage: str, key: str, elapsed_s: float | None, outputs=(), inputs: dict | None = None,
             **extra) -> None:
        """`elapsed_s` None: not timed (an evaluation record), and none is written rather than a false 0."""
        outputs = [str(o) for o in outputs]
        self.stages[stage] = {"key": key, "outputs": outputs, "sha256": self.outputs_hash(outputs),
                              **({"inputs": inputs} if inputs else {}),
                              **({} if elapsed_s is None else {"elapsed_s": round(float(elapsed_s), 3)}),
                              "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra}
        self._verified.add(stage)
        atomic_write_json(self.path, self.stages)

    def check_config(self, *, required: bool = True) -> None:
        """ValueError when the run's config.json differs from the SHA256 its setup stage recorded (`required`: also
        when none is recorded; else a directory without that record, written by the library's parts alone, passes):
        an edited configuration must not pass for the one the run's files were computed with."""
        path = self.run_dir / "config.json"
        want = ((self.stages.get("setup") or {}).get("sha256") or {}).get("config.json")
        if (want is None and required) or (want is not None and sha256_file(path) != want):
            raise ValueError(f"{path}: changed since `oal run` wrote it (its SHA256 differs from {self.path}); rerun "
                             f"`oal run --out {self.run_dir}`")

    def elapsed(self) -> dict[str, float]:
        return {k: v["elapsed_s"] for k, v in self.stages.items() if "elapsed_s" in v}


def _bad_shape(rec: dict) -> str | None:
    """What is wrong with the types of a stage record (None when nothing): its outputs a list of paths, its output
    and input hashes objects of path -> SHA256."""
    outputs = rec.get("outputs") or []
    if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
        return "'outputs' must be a list of paths"
    for key in ("sha256", "inputs"):
        value = rec.get(key) or {}
        if not isinstance(value, dict) or not all(isinstance(h, str) for h in value.values()):
            return f"{key!r} must be a JSON object of path -> SHA256"
    return None


def _recorded_paths(rec: dict) -> list:
    """Every path a stage record names: its outputs and the keys of its output and input hashes."""
    paths = list(rec.get("outputs") or [])
    for key in ("sha256", "inputs"):
        if isinstance(rec.get(key), dict):
            paths += list(rec[key])
    return paths


def _within(root: Path, rel) -> bool:
    """`rel` is a relative path that stays below `root`, lexically and with its links resolved."""
    if not isinstance(rel, str) or not rel or not rel.isprintable() or Path(rel).is_absolute() or ".." in Path(
            rel).parts:
        return False  # not printable: a NUL (no path holds one) or a line break
    base = root.resolve()
    target = (root / rel).resolve()
    return target == base or base in target.parents


def _wait_for_cuda() -> None:
    """Wait for the work queued on CUDA (it runs asynchronously), so that a stage's time includes it; nothing when
    CUDA was never used in this process."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class Timer:
    """Wall time of a block (a stage): on CUDA, the device's queued work is waited for at both ends, so the time per
    stage in metrics.json and report.md means on a GPU what it means on the CPU."""

    def __enter__(self):
        _wait_for_cuda()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        _wait_for_cuda()
        self.seconds = time.perf_counter() - self.t0
