"""A GGUF file as a base model: dequantised once into a content-addressed safetensors folder in the user's cache.

transformers reads GGUF through the `gguf` package and dequantises it, but the model it returns is marked quantized
and refuses `save_pretrained`. So the tensors are loaded into a plain model of the same config and saved with the
tokenizer into `cache_root("gguf")/<sha256[:16]>-<dtype>/`. From then on every stage sees an ordinary local folder,
and provenance binds as for any other: its config.json records the GGUF's name and SHA256 (`oal_gguf`), and the
hidden file `.oal_record` (written with the folder, renamed into place with it) the SHA256 of every file in it:
config, weights, tokenizer, card. A reuse checks the GGUF SHA256 and dtype it records and every file against it;
one that differs (an edited `rms_norm_eps`, two swapped token ids, a float32 folder copied under the bfloat16 name)
makes the folder be written again from the GGUF file, with one warning; so does a record of another format (an oal
that writes its folders otherwise bumps RECORD_FORMAT) and a file that is not a regular one (a FIFO, named, never
opened). Its files are readable by all (0644, its folders 0755, as all of the cache, whatever the umask;
safetensors writes the weights 0600), so a cache filled by one user serves others.
The record's name has no suffix that `models.provenance.hash_model_dir` hashes, so it leaves a run's model
fingerprint as it was.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import torch

from oal.models.families import SUPPORTED_ARCHITECTURES
from oal.models.folders import bad_model, first_line
from oal.models.provenance import file_sha256
from oal.rundir.user_cache import (
    SHARED_DIR,
    SHARED_FILE,
    cache_root,
    cache_writes,
    changed_file,
    clean_stale,
    entry_lock,
    files_sha256,
    read_record,
    work_dir,
    write_record,
)

__all__ = ["GGUF_RECORD", "RECORD", "cache_problem", "cached_facts", "drop_load_arguments", "gguf_metadata", "is_gguf",
           "materialize_gguf"]

log = logging.getLogger("oal")

GGUF_RECORD = "oal_gguf"  # the config.json key of a dequantised folder: {"file", "sha256", "dtype", ...}
_WEIGHTS = "model.safetensors"
RECORD, RECORD_FORMAT = ".oal_record", "oal-gguf-folder/1"  # the folder's record of its files
# what transformers saves into tokenizer_config.json from the load that made the tokenizer, not from the tokenizer
LOAD_ARGUMENTS = ("local_files_only", "is_local")


def is_gguf(name: str | Path) -> bool:
    return str(name).lower().endswith(".gguf")


def _reader(path: Path):
    try:
        from gguf import GGUFReader
    except ImportError:
        raise bad_model(f"{path}: reading a GGUF file needs the `gguf` package; install the gguf extra: "
                        "pip install 'oal-attention[gguf]' (or pip install 'gguf>=0.10')") from None
    try:
        return GGUFReader(str(path))
    except (ValueError, IndexError, KeyError, OSError) as exc:
        raise bad_model(f"{path}: not a readable GGUF file, truncated or damaged ({first_line(exc)})") from None


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def gguf_metadata(path: str | Path) -> dict:
    """{"architecture" (GGUF's), "model_type" (transformers'), "name", "license", "organization", "basename"};
    a one-line error for a file that is missing, truncated, of an architecture oal does not convert, or when the
    `gguf` package is missing."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise bad_model(f"no such GGUF file: {path}")
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    name = _field(reader, "general.name") or ""
    if not isinstance(arch, str):
        raise bad_model(f"{path}: a GGUF file without general.architecture (damaged)")
    # llama.cpp names Mistral models "llama" (transformers tells them apart by general.name, as here)
    model_type = "mistral" if arch == "llama" and "mistral" in name.lower() else arch
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise bad_model(f"{path}: GGUF architecture {arch!r} is not one oal converts; supported: "
                        f"{', '.join(SUPPORTED_ARCHITECTURES)}")
    # the tensors' extent must lie inside the file: a truncated download fails here, before any dequantisation
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise bad_model(f"{path}: truncated GGUF file ({size} bytes, its tensors reach byte {end})")
    return {"architecture": arch, "model_type": model_type, "name": name,
            "license": _field(reader, "general.license"), "organization": _field(reader, "general.organization"),
            "basename": _field(reader, "general.basename"), "context_length": _field(reader, f"{arch}.context_length")}


def cache_problem(folder: Path, sha: str, dtype: str | None = None) -> str | None:
    """None when `folder` holds exactly the files its record lists, as written from the GGUF file of SHA256 `sha`
    (in `dtype`, when given: "float32", ...); else what is wrong, naming the file."""
    if not folder.is_dir():
        return "missing"
    record = read_record(folder / RECORD)
    if record is None:
        return f"{RECORD} is missing or damaged (no record of the files written)"
    if record.get("format") != RECORD_FORMAT:  # written by an oal whose folders hold other files, or other bytes
        return f"{RECORD} records the format {record.get('format')!r}, not {RECORD_FORMAT!r}"
    gguf = record.get("gguf")
    if not isinstance(gguf, dict) or gguf.get("sha256") != sha:
        return f"{RECORD} records another GGUF file"
    if dtype is not None and gguf.get("dtype") != dtype:  # a folder copied or renamed under another dtype's name
        return f"{RECORD} records the dtype {gguf.get('dtype')!r}, not {dtype!r}"
    changed = changed_file(folder, record.get("files"), file_sha256, skip=(RECORD,))
    return None if changed is None else f"its files differ from the record written with them ({changed})"


def cached_facts(folder: Path) -> dict | None:
    """{"file", "sha256", "license", "base_model"} of a dequantised folder whose files match its record (the
    licence: oal's own record of a model it fetches, else the GGUF file's general.license), or None for a folder
    that is not one or does not verify."""
    record = read_record(Path(folder) / RECORD)
    gguf = record.get("gguf") if record else None
    if not isinstance(gguf, dict) or cache_problem(Path(folder), gguf.get("sha256")) is not None:
        return None
    from oal.models.fetch import LOCAL_MODELS

    spec = next((s for s in LOCAL_MODELS.values() if s["sha256"] == gguf.get("sha256")), None)
    if spec is not None:
        return {"file": gguf.get("file"), "sha256": gguf["sha256"], "license": spec.get("license"),
                "base_model": spec.get("base_model")}
    lic = record.get("license")
    return {"file": gguf.get("file"), "sha256": gguf["sha256"], "license": lic if isinstance(lic, str) else None,
            "base_model": None}


def drop_load_arguments(folder: Path) -> None:
    """Remove LOAD_ARGUMENTS from `folder`'s tokenizer_config.json (a folder being filled: written in place): they
    say whether the saving process ran with HF_HUB_OFFLINE, so the same tokenizer would give other bytes (and model
    fingerprints) in another shell, and a user loading the folder elsewhere would inherit them."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return
    config = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(config, dict) and any(k in config for k in LOAD_ARGUMENTS):
        kept = {k: v for k, v in config.items() if k not in LOAD_ARGUMENTS}
        path.write_text(json.dumps(kept, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _card(meta: dict, record: dict, source: dict | None) -> str:
    lic = meta.get("license") or "unknown"
    lines = ["---", f"license: {lic}", "library_name: transformers", "---", "",
             f"# {meta.get('name') or record['file']} (dequantised by oal)", "",
             f"Dequantised to {record['dtype']} from the GGUF file `{record['file']}` "
             f"(SHA256 `{record['sha256']}`) with transformers' GGUF reader.",
             f"Licence: {lic}" + ("" if meta.get("license") else " (the GGUF file names none)") + "."]
    if source:
        lines += ["", f"Source: {source['source']}.", f"Original model: {source['base_model']}."]
        card = Path(__file__).resolve().parents[1] / "assets" / source["card"] if source.get("card") else None
        if card is not None and card.is_file():  # oal's card of this model: its measured tables
            lines += ["", card.read_text().strip()]
    return "\n".join(lines) + "\n"


def materialize_gguf(path: str | Path, dtype: torch.dtype = torch.float32, *, source: dict | None = None) -> Path:
    """The safetensors folder of GGUF file `path` in `dtype`, written once (atomically) into the user's cache.

    A cached folder is used only when every file in it is the one its record lists (`cache_problem`); otherwise
    one warning names the file and the folder is written again from the GGUF file.
    `source` (optional) names where the file came from for the folder's model card ({"source", "base_model"}).
    """
    path = Path(path).expanduser().resolve()
    meta = gguf_metadata(path)
    sha = file_sha256(path)
    dname = str(dtype).replace("torch.", "")
    folder = cache_root("gguf") / f"{sha[:16]}-{dname}"
    clean_stale(folder.parent)  # what a killed dequantisation left, on every use
    problem = cache_problem(folder, sha, dname)
    if problem is None:
        return folder
    if problem != "missing":  # said before any write: a read-only cache then fails, and this says why it wrote
        log.warning("%s: %s; writing it again from %s", folder, problem, path.name)
    # several processes at once: one dequantises, the others wait and use its folder
    with cache_writes(f"the dequantised {path.name}", folder.parent), entry_lock(folder):
        if cache_problem(folder, sha, dname) is None:  # written by another process meanwhile
            return folder
        log.info("dequantising %s to %s (once; cached in %s)", path.name, dname, folder)
        with work_dir(folder.parent, folder.name) as work:
            out = work / "folder"
            _write_folder(path, meta, sha, dtype, source, out)
            if folder.exists() or folder.is_symlink():
                os.replace(folder, work / "old")  # removed with the work folder
            os.replace(out, folder)
    return folder


def _write_folder(path: Path, meta: dict, sha: str, dtype: torch.dtype, source: dict | None, out: Path) -> None:
    """Dequantise GGUF file `path` into folder `out`: weights, config (with the `oal_gguf` record), tokenizer,
    card, and the record of every file's SHA256 (RECORD)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise bad_model(f"{path}: transformers cannot read this GGUF file ({first_line(exc)})") from None
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "model_type"}, model_type=cfg["model_type"])
    config.dtype = dtype
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(model.state_dict(), assign=True, strict=True)
    plain.tie_weights()
    # the GGUF tokenizer says 1e30; the true context is the model's
    tokenizer.model_max_length = int(meta.get("context_length") or config.max_position_embeddings)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    drop_load_arguments(out)  # the same bytes with HF_HUB_OFFLINE set or not
    dname = str(dtype).replace("torch.", "")
    record = {"file": path.name, "sha256": sha, "dtype": dname, "architecture": meta["architecture"],
              "weights_sha256": file_sha256(out / _WEIGHTS), **({"base_model": source["base_model"]} if source else {})}
    cfg_path = out / "config.json"
    written = json.loads(cfg_path.read_text())
    written[GGUF_RECORD] = record
    cfg_path.write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    (out / "README.md").write_text(_card(meta, record, source))
    # safetensors writes the weights 0600, and under umask 077 the folders are 0700: another user of a shared cache
    # could not read them
    for p in [out, *out.rglob("*")]:
        os.chmod(p, SHARED_DIR if p.is_dir() else SHARED_FILE)
    write_record(out / RECORD, {"format": RECORD_FORMAT, "gguf": record, "license": meta.get("license"),
                                "files": files_sha256(out, file_sha256, skip=(RECORD,))})
