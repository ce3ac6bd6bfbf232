"""The paper's zero-shot sets (App. F.3) at pinned revisions: PIQA, HellaSwag and ARC-Easy, as rows of the hub schema.

Each task is one parquet file of its hub dataset repository (`SOURCES`: id, revision, file, SHA256, row count).
It is read from one of:

- a local folder (`data_dir`) in the layout `DIR/<task>/<file in the repo>`, e.g.
  `DIR/piqa/plain_text/validation-00000-of-00001.parquet`, plus `DIR/manifest.json` (dataset id, revision and
  SHA256 of every file; `write_manifest` creates it). The manifest is verified before any row is read;
- the hub, through `huggingface_hub.hf_hub_download` at the pinned revision (the client `datasets` itself
  downloads with; one exact file, so its SHA256 can be checked) or its local cache when the hub is offline;
- a JSON-lines file in the dataset's own schema (`task_file`): unverified, its SHA256 is recorded.

Where a file's SHA256 is pinned, the file must match it. Where it is not (`sha256=None`: no published hash was
found), the hash is recorded on first use (`write_manifest`) and checked against the manifest afterwards, and the
provenance says `sha256_pinned: false`. Offline with nothing cached, `fetch_task` raises `DataUnavailable` with one
line saying how to provide the data (callers skip the task; they never make up a number).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from oal.data.wikitext import MANIFEST_NAME, cached_revisions, hf_download_command, hub_reachable, read_manifest
from oal.errors import parse_names
from oal.rundir.files import atomic_write_json
from oal.rundir.hashes import sha256_file

__all__ = ["DISPLAY_NAMES", "SOURCES", "TASKS", "DataUnavailable", "TaskSource", "TaskRows", "fetch_command",
           "fetch_task", "parse_task_files", "parse_tasks", "read_rows", "skip_lines", "verify_manifest",
           "write_manifest"]

log = logging.getLogger("oal")


@dataclass(frozen=True)
class TaskSource:
    dataset_id: str
    config: str
    split: str
    revision: str
    file: str  # path inside the dataset repository
    sha256: str | None  # None: no published hash found; verified against the manifest's recorded one instead
    rows: int
    schema: dict  # column -> what it holds (checked on read; error messages quote it)


# Revisions and SHA256 as published by the hub for these files (LFS oids); the PIQA file's hash was not found.
SOURCES: dict[str, TaskSource] = {
    "piqa": TaskSource(
        "lighteval/piqa", "plain_text", "validation", "41782e6bf0ef7de82a2ca8a9feb1dca042837fae",
        "plain_text/validation-00000-of-00001.parquet", None, 1838,
        {"goal": "str", "sol1": "str", "sol2": "str", "label": "int 0 or 1"}),
    "hellaswag": TaskSource(
        "Rowan/hellaswag", "default", "validation", "218ec52e09a7e7462a5400043bb9a69a41d06b76",
        "data/validation-00000-of-00001.parquet",
        "899813071e1e95efafec90f856e1987d2150fa4d020fc005df6962c259f660cd", 10042,
        {"activity_label": "str", "ctx_a": "str", "ctx_b": "str", "endings": "list of 4 str",
         "label": "index of the right ending (str or int)"}),
    "arc_easy": TaskSource(
        "allenai/ai2_arc", "ARC-Easy", "test", "210d026faf9955653af8916fad021475a3f00453",
        "ARC-Easy/test-00000-of-00001.parquet",
        "4160597d618ae851c7eb04e281574f3f654776216ac6b6641588d64527b47177", 2376,
        {"question": "str", "choices": "{'text': list of str, 'label': list of str}",
         "answerKey": "one of choices['label']"}),
}
TASKS = tuple(SOURCES)
DISPLAY_NAMES = {"piqa": "PIQA", "hellaswag": "HellaSwag", "arc_easy": "ARC-E"}  # paper Table 3 column names


class DataUnavailable(RuntimeError):
    """The pinned file is neither in a local folder nor reachable (offline hub, nothing cached)."""


@dataclass
class TaskRows:
    task: str
    rows: list[dict]
    provenance: dict  # source, dataset id, revision, file, sha256, sha256_pinned, rows, limit


def _check_task(task: str) -> TaskSource:
    if task not in SOURCES:
        raise ValueError(f"task: expected one of {', '.join(TASKS)}, got {task!r}")
    return SOURCES[task]


def parse_tasks(spec: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """'piqa,arc_easy' -> ['piqa', 'arc_easy']; None or 'all' -> every task; 'none' or '' -> no task."""
    if spec is None:
        return list(TASKS)
    return [] if spec in ("none", ["none"], ("none",)) else parse_names(spec, TASKS, "tasks")


def parse_task_files(specs: list[str] | tuple[str, ...] | dict | None) -> dict[str, str]:
    """['piqa=PATH.jsonl', ...] (or a dict) -> {'piqa': 'PATH.jsonl'}; each file must exist."""
    if not specs:
        return {}
    pairs = specs.items() if isinstance(specs, dict) else []
    if not isinstance(specs, dict):
        for spec in specs:
            task, sep, path = str(spec).partition("=")
            if not sep or not path:
                raise ValueError(f"task_file: expected TASK=PATH.jsonl, got {spec!r}")
            pairs.append((task.strip(), path.strip()))
    out = {}
    for task, path in pairs:
        _check_task(task)
        _check_task_file(task, Path(path))
        if not path.endswith(".parquet"):
            _text(Path(path))  # a binary file is refused here, before any run starts
        out[task] = str(path)
    return out


def _check_task_file(task: str, path: Path) -> None:
    if path.is_dir():  # "no such file" misled about a path that exists
        raise ValueError(f"task_file: {path} ({task}) is a folder; expected a JSON-lines or parquet file")
    if not path.is_file():
        raise ValueError(f"task_file: no such file for {task}: {path}")


def _text(path: Path) -> str:
    """The UTF-8 text of a JSON-lines file; a binary (or otherwise encoded) file is a ValueError naming it."""
    try:  # utf-8-sig: an editor's byte-order mark made line 1 "not JSON"
        return path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not a UTF-8 JSON-lines file (byte {exc.start} cannot be decoded); expected one "
                         "JSON object per line in the dataset's schema") from None


# ----------------------------------------------------------------------------------------------- reading rows


def read_rows(path: str | Path, task: str) -> list[dict]:
    """Rows of a parquet or JSON-lines file in `task`'s hub schema; ValueError naming the file if columns miss."""
    spec = _check_task(task)
    path = Path(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except Exception as exc:  # pyarrow raises several types for a damaged file
            raise ValueError(f"{path}: not a readable parquet file ({exc})") from exc
    else:
        rows = []
        for i, line in enumerate(_text(path).splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}: line {i} is not JSON ({exc.msg})") from None
    if not rows:
        raise ValueError(f"{path}: no rows; expected the {spec.dataset_id} schema {spec.schema}")
    for i, row in enumerate(rows):
        missing = [c for c in spec.schema if not isinstance(row, dict) or c not in row]
        if missing:
            raise ValueError(f"{path}: row {i} lacks columns {missing}; expected the {spec.dataset_id} schema "
                             f"{spec.schema}")
    return rows


# ----------------------------------------------------------------------------------------------- local folder


def _local_file(data_dir: Path, task: str, spec: TaskSource) -> Path:
    return data_dir / task / spec.file


def write_manifest(data_dir: str | Path, tasks: list[str] | None = None, *,
                   sources: dict[str, TaskSource] | None = None) -> Path:
    """Record dataset id, revision and SHA256 of each task's file under `data_dir` (atomic write).

    A file whose hash is pinned must match the pin. A file without a pinned hash is recorded as found (logged);
    later reads check it against this record. Entries of other tasks already in the manifest are kept. Fill the
    folder first, e.g. for PIQA: `hf download lighteval/piqa plain_text/validation-00000-of-00001.parquet
    --repo-type dataset --revision 41782e6bf0ef7de82a2ca8a9feb1dca042837fae --local-dir DIR/piqa`.
    """
    sources = sources or SOURCES
    data_dir = Path(data_dir)
    tasks = list(tasks) if tasks else [t for t in sources if (data_dir / t).is_dir()]
    if not tasks:
        raise ValueError(f"data_dir: {data_dir} holds none of the task folders {list(sources)}")
    entries = {}
    if (data_dir / MANIFEST_NAME).is_file():
        entries = dict(read_manifest(data_dir, "write_manifest")[1].get("tasks", {}))
    for task in tasks:
        spec = sources[task] if task in sources else _check_task(task)
        path = _local_file(data_dir, task, spec)
        if not path.is_file():
            raise ValueError(f"data_dir: missing {path} (the {spec.split} split of {spec.dataset_id} at revision "
                             f"{spec.revision}, file {spec.file})")
        digest = sha256_file(path)
        if spec.sha256 is not None and digest != spec.sha256:
            raise ValueError(f"data_dir: SHA256 mismatch for {path}: file has {digest}, the pinned "
                             f"{spec.dataset_id}@{spec.revision} file has {spec.sha256}")
        if spec.sha256 is None:
            log.warning("%s: no published SHA256 to check %s against; recording %s", task, path, digest)
        entries[task] = {"dataset_id": spec.dataset_id, "revision": spec.revision, "file": spec.file,
                         "sha256": digest}
    return atomic_write_json(data_dir / MANIFEST_NAME, {"tasks": entries})


def verify_manifest(data_dir: str | Path, task: str, *, sources: dict[str, TaskSource] | None = None) -> Path:
    """Check `task`'s entry of DIR/manifest.json and its file (against the pin, or the recorded hash); its path."""
    spec = (sources or SOURCES).get(task) or _check_task(task)
    data_dir = Path(data_dir)
    mpath, manifest = read_manifest(data_dir, "oal.data.zeroshot.write_manifest(DIR) (layout: DIR/<task>/<file in "
                                              "the repo>; docs/guides/evaluation.md)", "--zeroshot-dir")
    entry = manifest.get("tasks", {}).get(task) if isinstance(manifest.get("tasks"), dict) else None
    if not isinstance(entry, dict):
        listed = sorted(manifest.get("tasks") or {}) if isinstance(manifest.get("tasks"), dict) else []
        raise ValueError(f"manifest {mpath}: task {task!r} not listed (the --zeroshot-dir folder holds {listed}); add "
                         f"{task}/{spec.file} and rerun oal.data.zeroshot.write_manifest on it, or leave {task} out "
                         "with --tasks")
    for key in ("dataset_id", "revision", "file"):
        if entry.get(key) != getattr(spec, key):
            raise ValueError(f"manifest {mpath}: {task} {key} is {entry.get(key)!r}, expected {getattr(spec, key)!r}")
    path = _local_file(data_dir, task, spec)
    if not path.is_file():
        raise ValueError(f"data_dir: missing {path} (the {spec.split} split of {spec.dataset_id}, file {spec.file})")
    expected = spec.sha256 or entry.get("sha256")
    if spec.sha256 is not None and entry.get("sha256") != spec.sha256:
        raise ValueError(f"manifest {mpath}: {task} sha256 is {entry.get('sha256')}, the pin is {spec.sha256}")
    digest = sha256_file(path)
    if digest != expected:
        raise ValueError(f"data_dir: SHA256 mismatch for {path}: file has {digest}, expected {expected}")
    return path


# ----------------------------------------------------------------------------------------------- hub


def _download(spec: TaskSource, task: str) -> Path:
    """The pinned file from the hub, or from its local cache when the hub is offline; DataUnavailable if neither."""
    from huggingface_hub import hf_hub_download

    offline = not hub_reachable()
    try:
        return Path(hf_hub_download(spec.dataset_id, spec.file, repo_type="dataset", revision=spec.revision,
                                    local_files_only=offline))
    except Exception as exc:  # huggingface_hub raises several types (offline, missing, network, auth)
        others = [r[:8] for r in cached_revisions(spec.dataset_id, "dataset") if r != spec.revision]
        held = f"; the cache holds {', '.join(others)}" if others else ""
        where = f"offline, not cached{held}" if offline else f"download failed: {exc.__class__.__name__}"
        raise DataUnavailable(
            f"{task}: no {spec.dataset_id}@{spec.revision[:8]} ({where}){_HOW} (--zeroshot-dir DIR with "
            f"DIR/{task}/{spec.file} and {MANIFEST_NAME}) or a JSON-lines file (--task-file {task}=PATH.jsonl), or "
            f"where the hub is reachable fill its cache: `{fetch_command(task, spec)}`"
        ) from exc


def fetch_command(task: str, spec: TaskSource | None = None) -> str:
    """The `hf download` command that puts `task`'s pinned file into the Hugging Face cache, where `fetch_task`
    reads it offline."""
    spec = spec or _check_task(task)
    return hf_download_command(spec.dataset_id, spec.revision, [spec.file], repo_type="dataset")


_HOW = "; pass a local folder"  # where a DataUnavailable's message turns from what is missing to how to provide it


def skip_lines(skipped: dict[str, str]) -> list[str]:
    """What a command prints of the tasks skipped for want of data ({task: DataUnavailable's message}): one line per
    task of what is missing, then once how to provide them (three tasks' whole messages wrapped to nine lines), then
    the command that fetches each task's pinned file."""
    lines = [f"skip zero-shot {why.partition(_HOW)[0]}" for why in skipped.values()]
    how = ("  to score them: --zeroshot-dir DIR or --task-file TASK=PATH.jsonl (docs/guides/evaluation.md), or fill "
           "the Hugging Face cache where the hub is reachable:")
    fetch = [f"    {fetch_command(t)}" for t in skipped if t in SOURCES]
    return lines + [how] * bool(lines) + fetch * bool(lines)


def _check_hub_file(path: Path, spec: TaskSource, task: str) -> str:
    """The file's SHA256, checked against the pin, else against the cache's blob name (an LFS file's SHA256)."""
    digest, blob = sha256_file(path), path.resolve().name
    expected = spec.sha256 or (blob if re.fullmatch(r"[0-9a-f]{64}", blob) else None)
    if expected is not None and digest != expected:
        pin = f"the pinned {spec.dataset_id}@{spec.revision} file" if spec.sha256 else "its cache blob name"
        raise ValueError(f"{task}: SHA256 mismatch for {path}: file has {digest}, {pin} has {expected}")
    return digest


# ----------------------------------------------------------------------------------------------- entry point


def fetch_task(task: str, *, data_dir: str | Path | None = None, task_file: str | Path | None = None,
               limit: int | None = None, sources: dict[str, TaskSource] | None = None) -> TaskRows:
    """`task`'s rows (the first `limit` in source order) and where they came from.

    Precedence: `task_file` (unverified, hash recorded), then `data_dir` (manifest-checked), then the hub or its cache.
    """
    spec = (sources or SOURCES).get(task) or _check_task(task)
    if limit is not None and limit < 1:
        raise ValueError(f"limit: expected a positive number of examples, got {limit}")
    if task_file is not None:
        path = Path(task_file)
        _check_task_file(task, path)
        prov = {"source": "task_file", "path": str(path.resolve()), "sha256": sha256_file(path),
                "sha256_pinned": False, "schema_of": spec.dataset_id}
    else:
        if data_dir is not None:
            path = verify_manifest(data_dir, task, sources=sources)
            source, digest = "data_dir", sha256_file(path)
        else:
            path = _download(spec, task)
            source, digest = "hub", _check_hub_file(path, spec, task)
        prov = {"source": source, "path": str(path.resolve()), "dataset_id": spec.dataset_id, "config": spec.config,
                "split": spec.split, "revision": spec.revision, "file": spec.file, "sha256": digest,
                "sha256_pinned": spec.sha256 is not None}
    rows = read_rows(path, task)
    if task_file is None and len(rows) != spec.rows:
        raise ValueError(f"{path}: {len(rows)} rows, expected {spec.rows} ({spec.dataset_id} {spec.split})")
    prov["rows"] = len(rows)
    if limit is not None and limit < len(rows):
        rows = rows[:limit]
    prov["limit"] = limit
    return TaskRows(task, rows, prov)

