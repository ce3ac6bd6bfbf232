"""WikiText (the paper's data): `Salesforce/wikitext` at a pinned revision, from the hub or a local copy.

A local copy keeps the hub repository's on-disk layout (`<config>/<split>-0000i-of-0000n.parquet`) plus a
`manifest.json` naming dataset id, revision and the SHA256 of every file; the manifest is verified before any
text is read. Text protocol (paper App. F.3): the entries of a split joined in source order with "\\n\\n".
"""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from oal.data.corpus import SPLITS, Corpus
from oal.rundir.files import atomic_write_json
from oal.rundir.hashes import sha256_file

DATASET_ID = "Salesforce/wikitext"
REVISION = "b08601e04326c79dfdd32d625aee71d232d685c3"
CONFIGS = ("wikitext-2-raw-v1", "wikitext-103-raw-v1")
MANIFEST_NAME = "manifest.json"


def _check_config(config: str) -> None:
    if config not in CONFIGS:
        raise ValueError(f"config: expected one of {CONFIGS}, got {config!r}")


def split_files(data_dir: str | Path, config: str) -> dict[str, list[Path]]:
    """The parquet shards of each split of `config` under `data_dir`, in shard order."""
    root = Path(data_dir) / config
    files = {s: sorted(root.glob(f"{s}-*.parquet")) for s in SPLITS}
    missing = [s for s, fs in files.items() if not fs]
    if missing:
        raise ValueError(f"data_dir: no parquet files for splits {missing} under {root} "
                         f"(expected e.g. {config}/train-00000-of-00001.parquet)")
    return files


def write_manifest(data_dir: str | Path, configs: tuple[str, ...] | list[str] | None = None, *,
                   dataset_id: str = DATASET_ID, revision: str = REVISION) -> Path:
    """Record dataset id, revision and the SHA256 of every parquet file of `configs` (atomic write).

    Run it once on a verified download (e.g. `huggingface-cli download Salesforce/wikitext --revision ...`).
    """
    data_dir = Path(data_dir)
    configs = list(configs) if configs else [c for c in CONFIGS if (data_dir / c).is_dir()]
    files = {}
    for config in configs:
        _check_config(config)
        for paths in split_files(data_dir, config).values():
            for p in paths:
                files[p.relative_to(data_dir).as_posix()] = sha256_file(p)
    manifest = {"dataset_id": dataset_id, "revision": revision, "configs": configs, "files": files}
    return atomic_write_json(data_dir / MANIFEST_NAME, manifest)


def read_manifest(data_dir: Path, writer: str) -> tuple[Path, dict]:
    """DIR/manifest.json and its content; ValueError when it is missing (saying which function writes it) or bad."""
    path = data_dir / MANIFEST_NAME
    if not path.is_file():
        raise ValueError(f"data_dir: {data_dir} has no {MANIFEST_NAME}; create it from a verified download with "
                         f"{writer}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"data_dir: {path} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict):
        raise ValueError(f"data_dir: {path} is not a manifest (expected a JSON object)")
    return path, manifest


def verify_manifest(data_dir: str | Path, config: str, *, dataset_id: str = DATASET_ID,
                    revision: str = REVISION) -> dict:
    """Check id, revision, config and the SHA256 of each file of `config`; return the manifest. ValueError if not."""
    _check_config(config)
    data_dir = Path(data_dir)
    path, manifest = read_manifest(data_dir, "oal.data.wikitext.write_manifest")
    if manifest.get("dataset_id") != dataset_id:
        raise ValueError(f"manifest {path}: dataset_id is {manifest.get('dataset_id')!r}, expected {dataset_id!r}")
    if manifest.get("revision") != revision:
        raise ValueError(f"manifest {path}: revision is {manifest.get('revision')!r}, expected {revision!r}")
    if config not in manifest.get("configs", []):
        raise ValueError(f"manifest {path}: config {config!r} not listed (has {manifest.get('configs')})")
    listed = manifest.get("files", {})
    for paths in split_files(data_dir, config).values():
        for p in paths:
            rel = p.relative_to(data_dir).as_posix()
            if rel not in listed:
                raise ValueError(f"manifest {path}: file {rel} is not listed")
            actual = sha256_file(p)
            if actual != listed[rel]:
                raise ValueError(f"manifest {path}: SHA256 mismatch for {rel}: file has {actual}, "
                                 f"manifest says {listed[rel]}")
    expected = {k for k in listed if k.startswith(f"{config}/")}
    present = {p.relative_to(data_dir).as_posix() for ps in split_files(data_dir, config).values() for p in ps}
    if expected - present:
        raise ValueError(f"manifest {path}: files missing on disk: {sorted(expected - present)}")
    return manifest


def _read_entries(paths: list[Path]) -> list[str]:
    import pyarrow.parquet as pq

    entries: list[str] = []
    for p in paths:
        table = pq.read_table(p, columns=["text"])
        entries.extend(table.column("text").to_pylist())
    return entries


def hub_reachable(timeout: float = 3.0) -> bool:
    """False when HF_HUB_OFFLINE is set or the hub endpoint does not answer a TCP connect within `timeout` s.

    The probe (DNS lookup included) runs in a daemon thread, so a hanging resolver cannot stall the caller.
    """
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def _load_from_hub(config: str, revision: str) -> dict[str, list[str]]:
    import datasets

    offline = not hub_reachable()
    saved = datasets.config.HF_HUB_OFFLINE
    try:
        if offline:  # datasets may still answer from its local cache; never retry the network
            datasets.config.HF_HUB_OFFLINE = True
        ds = datasets.load_dataset(DATASET_ID, config, revision=revision)
    except Exception as exc:  # datasets raises several types (ConnectionError, FileNotFoundError, ...)
        if offline:  # bad input, not a bug: the user must point at a local copy
            raise ValueError(
                f"WikiText {config!r} is not reachable: the model hub is offline or unreachable and the dataset "
                f"is not in the local cache; pass a local copy with {MANIFEST_NAME} (--data-dir DIR, data_dir=)"
            ) from exc
        raise
    finally:
        datasets.config.HF_HUB_OFFLINE = saved
    return {s: list(ds[s]["text"]) for s in SPLITS}


def load_wikitext(config: str, data_dir: str | Path | None = None, *, revision: str = REVISION) -> Corpus:
    """WikiText `config` as a Corpus: each split's entries joined in source order with "\\n\\n" (App. F.3)."""
    _check_config(config)
    if data_dir is not None:
        manifest = verify_manifest(data_dir, config, revision=revision)
        entries = {s: _read_entries(ps) for s, ps in split_files(data_dir, config).items()}
        files = {k: v for k, v in manifest["files"].items() if k.startswith(f"{config}/")}
        source = str(Path(data_dir).resolve())
    else:
        entries = _load_from_hub(config, revision)
        files, source = {}, "hub"
    splits = {s: "\n\n".join(entries[s]) for s in SPLITS}
    meta = {"dataset_id": DATASET_ID, "config": config, "revision": revision, "source": source,
            "files_sha256": files, "entries": {s: len(entries[s]) for s in SPLITS}}
    if data_dir is not None:
        meta["data_dir"] = source
    return Corpus(config, splits, meta=meta)
