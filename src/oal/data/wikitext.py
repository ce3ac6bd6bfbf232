"""WikiText (the paper's data): `Salesforce/wikitext` at a pinned revision, from the hub or a local copy.

A local copy keeps the hub repository's on-disk layout (`<config>/<split>-0000i-of-0000n.parquet`) plus a
`manifest.json` naming dataset id, revision and the SHA256 of every file; the manifest is verified before any
text is read. Without one, the same parquet files come from the Hugging Face cache (HF_HUB_CACHE) at the pinned
revision, downloaded there first where the hub is reachable; offline, `datasets`' own cache is a last resort, used
only when it holds the pinned revision. Text protocol (paper App. F.3): the entries of a split joined in source
order with "\\n\\n".
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from oal.data.corpus import SPLITS, Corpus
from oal.rundir.files import atomic_write_json
from oal.rundir.hashes import sha256_file

DATASET_ID = "Salesforce/wikitext"
REVISION = "b08601e04326c79dfdd32d625aee71d232d685c3"
CONFIGS = ("wikitext-2-raw-v1", "wikitext-103-raw-v1")
MANIFEST_NAME = "manifest.json"
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.parquet$")


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
    for paths in files.values():
        _check_shards(root, paths)
    return files


def _check_shards(root: Path, paths: list[Path]) -> None:
    """An interrupted download leaves some shards of a split: its text would be silently cut short."""
    counts = {m.group(2) for p in paths if (m := _SHARD.search(p.name))}
    if len(counts) == 1:
        n = int(counts.pop())
        have = {int(m.group(1)) for p in paths if (m := _SHARD.search(p.name))}
        absent = sorted(set(range(n)) - have)
        if absent:
            stem = _SHARD.sub("", paths[0].name)
            raise ValueError(f"data_dir: {root} lacks shard(s) {absent} of {n} of {stem} "
                             f"(e.g. {stem}-{absent[0]:05d}-of-{n:05d}.parquet): an incomplete download")


def write_manifest(data_dir: str | Path, configs: tuple[str, ...] | list[str] | None = None, *,
                   dataset_id: str = DATASET_ID, revision: str = REVISION) -> Path:
    """Record dataset id, revision and the SHA256 of every parquet file of `configs` (atomic write).

    Run it once on a verified download (e.g. the folder `hf_download_command(DATASET_ID, REVISION, ["<config>/*.
    parquet"], repo_type="dataset", local_dir=DIR)` fills).
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


def read_manifest(data_dir: Path, writer: str, option: str = "--data-dir") -> tuple[Path, dict]:
    """DIR/manifest.json and its content; ValueError when it is missing (saying which function writes it) or bad."""
    path = data_dir / MANIFEST_NAME
    if not path.is_file():
        raise ValueError(f"data_dir: {data_dir} ({option}) has no {MANIFEST_NAME}; create it from a verified "
                         f"download with {writer}")
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
    path, manifest = read_manifest(data_dir, "oal.data.wikitext.write_manifest(DIR) (layout: DIR/<config>/<split>-"
                                             "0000i-of-0000n.parquet; docs/guides/scale.md)")
    if manifest.get("dataset_id") != dataset_id:
        raise ValueError(f"manifest {path}: dataset_id is {manifest.get('dataset_id')!r}, expected {dataset_id!r}")
    if manifest.get("revision") != revision:
        raise ValueError(f"manifest {path}: revision is {manifest.get('revision')!r}, expected {revision!r}")
    if config not in manifest.get("configs", []):
        raise ValueError(f"manifest {path}: config {config!r} not listed (has {manifest.get('configs')}); put "
                         f"{config}/ in {data_dir} and rerun oal.data.wikitext.write_manifest on it")
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


def _first_hop(url) -> tuple[str, int]:
    """Where a connection to the hub goes first: the proxy that huggingface_hub's HTTP client takes from the
    environment (HTTPS_PROXY, ALL_PROXY; not for NO_PROXY hosts), else the hub. Behind a proxy-only firewall the hub
    itself never answers, yet downloads work."""
    proxies = urllib.request.getproxies()
    proxy = proxies.get(url.scheme) or proxies.get("all")
    if proxy and not urllib.request.proxy_bypass(url.hostname or ""):
        url = urlparse(proxy if "://" in proxy else f"http://{proxy}")
    return url.hostname, url.port or (443 if url.scheme == "https" else 80)


def hub_reachable(timeout: float = 3.0) -> bool:
    """False when HF_HUB_OFFLINE is set or the hub endpoint (or the proxy to it) does not answer a TCP connect
    within `timeout` s.

    The probe (DNS lookup included) runs in a daemon thread, so a hanging resolver cannot stall the caller.
    """
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    address = _first_hop(urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")))
    result: list[bool] = []

    def probe() -> None:
        try:
            with socket.create_connection(address, timeout=timeout):
                result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(timeout)
    return bool(result and result[0])


def hf_download_command(repo_id: str, revision: str | None, include, *, repo_type: str = "model",
                        local_dir: str | None = None) -> str:
    """The `hf download` command (huggingface_hub's CLI) that fetches the files of `repo_id` matching the glob
    patterns `include` at `revision`: into the Hugging Face cache, where the hub paths read them, or into
    `local_dir`. `--include` is repeated, one pattern each (the CLI reads one per flag)."""
    kind = f" --repo-type {repo_type}" if repo_type != "model" else ""
    rev = f" --revision {revision}" if revision else ""
    where = f" --local-dir {local_dir}" if local_dir else ""
    return f"hf download {repo_id}{kind}{rev} " + " ".join(f"--include '{p}'" for p in include) + where


def cached_revisions(repo_id: str, repo_type: str = "model") -> list[str]:
    """The revisions (snapshot folders) of `repo_id` in the Hugging Face cache, for error messages."""
    from huggingface_hub import constants

    snapshots = Path(constants.HF_HUB_CACHE) / f"{repo_type}s--{repo_id.replace('/', '--')}" / "snapshots"
    return sorted(p.name for p in snapshots.iterdir()) if snapshots.is_dir() else []


def _how_to_get(revision: str) -> str:
    command = hf_download_command(DATASET_ID, revision, [f"{c}/*.parquet" for c in CONFIGS], repo_type="dataset")
    return (f"where the hub is reachable run `{command}` (fills the cache), or pass "
            f"--data-dir DIR (data_dir=): a local copy, DIR/<config>/<split>-0000i-of-0000n.parquet plus "
            f"{MANIFEST_NAME} (docs/guides/scale.md)")


def _not_cached(config: str, revision: str) -> str:
    others = [r for r in cached_revisions(DATASET_ID, "dataset") if r != revision]
    held = f" (it holds revision {', '.join(others)})" if others else ""
    return (f"WikiText {config!r}: {DATASET_ID}@{revision} is not in the Hugging Face cache{held} and the hub is "
            f"unreachable or HF_HUB_OFFLINE is set; {_how_to_get(revision)}")


def _from_hub_cache(config: str, revision: str, online: bool) -> Path:
    """The snapshot folder of `revision` holding every shard of `config`, downloaded first when `online`."""
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(DATASET_ID, repo_type="dataset", revision=revision,
                                    allow_patterns=[f"{config}/*.parquet"], local_files_only=not online))
    try:
        split_files(folder, config)
    except ValueError as exc:  # a snapshot that another config's download (or an interrupted one) left
        raise ValueError(f"WikiText {config!r}: the Hugging Face cache holds {DATASET_ID}@{revision} but not all of "
                         f"{config}'s files ({str(exc).partition('data_dir: ')[2]}); {_how_to_get(revision)}") from None
    return folder


def _file_hashes(folder: Path, config: str) -> dict[str, str]:
    """SHA256 of each shard; the cache names an LFS blob by its SHA256, so a damaged blob shows here."""
    hashes = {}
    for p in (p for ps in split_files(folder, config).values() for p in ps):
        digest, blob = sha256_file(p), p.resolve().name
        if re.fullmatch(r"[0-9a-f]{64}", blob) and blob != digest:
            raise ValueError(f"WikiText {config!r}: {p} is damaged (SHA256 {digest}, its cache blob says {blob}); "
                             f"delete it and download again")
        hashes[p.relative_to(folder).as_posix()] = digest
    return hashes


def _from_datasets_cache(config: str, revision: str) -> dict[str, list[str]] | None:
    """Offline: `datasets`' own cache of an earlier load_dataset (None if it has none), only if it is `revision`:
    offline, datasets takes the newest cached copy of any revision."""
    import datasets

    saved = datasets.config.HF_HUB_OFFLINE
    try:
        datasets.config.HF_HUB_OFFLINE = True  # never retry the network
        ds = datasets.load_dataset(DATASET_ID, config, revision=revision)
    except Exception:  # datasets raises several types (ConnectionError, FileNotFoundError, ...): nothing cached
        return None
    finally:
        datasets.config.HF_HUB_OFFLINE = saved
    found = {Path(f["filename"]).parent.name for s in SPLITS for f in ds[s].cache_files}
    if found != {revision}:
        raise ValueError(f"WikiText {config!r}: the datasets cache holds revision {', '.join(sorted(found))}, not the "
                         f"pinned {revision}; {_how_to_get(revision)}")
    return {s: list(ds[s]["text"]) for s in SPLITS}


def _load_from_hub(config: str, revision: str) -> tuple[dict[str, list[str]], dict[str, str], dict]:
    """Entries per split, SHA256 per file and where they came from: the Hugging Face cache at `revision`
    (downloaded there when the hub is reachable), else, offline, `datasets`' cache of that revision."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    online = hub_reachable()
    try:
        folder = _from_hub_cache(config, revision, online)
    except ValueError:
        raise
    except Exception as exc:  # huggingface_hub raises several types (offline, network, auth, missing revision)
        if online:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ValueError(f"WikiText {config!r}: download of {DATASET_ID}@{revision} failed ({type(exc).__name__}: "
                             f"{why}); {_how_to_get(revision)}") from exc
        entries = _from_datasets_cache(config, revision) if isinstance(exc, LocalEntryNotFoundError) else None
        if entries is None:
            raise ValueError(_not_cached(config, revision)) from exc
        return entries, {}, {"source": "datasets-cache"}
    files = _file_hashes(folder, config)  # before reading: a damaged file is named, not a parquet error
    entries = {s: _read_entries(ps) for s, ps in split_files(folder, config).items()}
    return entries, files, {"source": "hub", "hub_cache": str(folder)}


def load_wikitext(config: str, data_dir: str | Path | None = None, *, revision: str = REVISION) -> Corpus:
    """WikiText `config` as a Corpus: each split's entries joined in source order with "\\n\\n" (App. F.3)."""
    _check_config(config)
    if data_dir is not None:
        manifest = verify_manifest(data_dir, config, revision=revision)
        entries = {s: _read_entries(ps) for s, ps in split_files(data_dir, config).items()}
        files = {k: v for k, v in manifest["files"].items() if k.startswith(f"{config}/")}
        where = {"source": str(Path(data_dir).resolve()), "data_dir": str(Path(data_dir).resolve())}
    else:
        entries, files, where = _load_from_hub(config, revision)
    splits = {s: "\n\n".join(entries[s]) for s in SPLITS}
    meta = {"dataset_id": DATASET_ID, "config": config, "revision": revision, **where,
            "files_sha256": files, "entries": {s: len(entries[s]) for s in SPLITS}}
    return Corpus(config, splits, meta=meta)
