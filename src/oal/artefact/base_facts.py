"""What an export's model card says about its base model and its data, read from files, never from a machine path.

- `base_model_facts(name, folder)`: the base model's id (a hub id when the name is one or the folder is a pinned
  checkpoint; else the folder's name) and its licence, named from the folder's own files: the `license:` of its
  README.md front matter, else a LICENSE file whose text names a licence; the embedded default ships inside oal
  under oal's own licence. A dequantised GGUF folder in the user's cache is named by the records oal wrote with it
  and checks (`models.gguf.cached_facts`: the licence of a model oal fetches is oal's record of it), never by its
  README.md, which the cache writes but a user may edit. Otherwise the licence is "unknown", with the reason.
- `data_facts(config, metrics)`: the hub datasets behind the numbers (front matter) and one line per corpus.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from oal.models.gguf import RECORD as GGUF_FOLDER_RECORD
from oal.models.gguf import cached_facts

__all__ = ["DISTRIBUTION", "PACKAGE_LICENSE", "PAPER", "base_model_facts", "data_facts"]

DISTRIBUTION = "oal-attention"  # the name on PyPI (`oal` there is another project); the import name stays `oal`
PACKAGE_LICENSE = "apache-2.0"  # pyproject.toml's licence, which covers the embedded default model's files
PAPER = "https://arxiv.org/abs/2610.13674"

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_LICENSE_TEXTS = (("apache license", "version 2.0", "apache-2.0"), ("mit license", "", "mit"),
                  ("bsd 3-clause", "", "bsd-3-clause"), ("gnu general public license", "version 3", "gpl-3.0"),
                  ("llama 3.2 community license", "", "llama3.2"), ("llama 3.1 community license", "", "llama3.1"))


def hub_id(name) -> str | None:
    """`name` when it is a hub repository id, not a local path."""
    if isinstance(name, str) and _REPO_ID.match(name) and not Path(name).exists():
        return name
    return None


def _front_matter_license(readme: Path) -> str | None:
    text = readme.read_text(encoding="utf-8", errors="replace")
    if not text.startswith("---"):
        return None
    head = text[3:].split("\n---", 1)[0]
    m = re.search(r"^license:\s*['\"]?([^'\"\n#]+?)['\"]?\s*$", head, re.M)
    return m.group(1).strip() if m else None


def _license_file(folder: Path) -> tuple[str, str] | None:
    """(licence id, file name) of the first LICENSE file of `folder` whose text names a known licence."""
    for f in sorted(folder.iterdir()):
        if f.is_file() and f.name.upper().startswith(("LICENSE", "LICENCE")):
            text = " ".join(f.read_text(encoding="utf-8", errors="replace")[:4000].lower().split())
            for first, second, spdx in _LICENSE_TEXTS:
                if first in text and second in text:
                    return spdx, f.name
            return "other", f.name
    return None


def _gguf_facts(folder: Path | None) -> dict | None:
    """What a dequantised GGUF folder (`oal.models.gguf`) came from, from records oal wrote and checks, never from
    its README.md: {"id" (the upstream model id of a model oal fetches, else the GGUF file's name), "license",
    "license_note"}; None for a folder that is not one."""
    if folder is None or not ((folder / GGUF_FOLDER_RECORD).exists() or _has_gguf_record(folder)):
        return None
    facts = cached_facts(folder)
    if facts is None:
        return {"id": None, "license": "unknown", "license_note": "the dequantised GGUF folder's files do not match "
                "the record written with them, so nothing in it is quoted; load the model again to rewrite it"}
    known = facts["base_model"] is not None  # a model oal fetches: its licence is oal's record of it
    note = ("from oal's record of the model it fetches" if known else "from the GGUF file's general.license"
            if facts["license"] else "the GGUF file names no licence; check its source before you share this model")
    return {"id": facts["base_model"] or facts["file"], "license": facts["license"] or "unknown",
            "license_note": note}


def _has_gguf_record(folder: Path) -> bool:
    try:
        return "oal_gguf" in json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, TypeError):
        return False


def base_model_facts(name: str | None, folder: str | Path | None, identified: str | None = None) -> dict:
    """{"id", "license", "license_note"} of the base model `name` loaded from `folder` (`identified`: the pinned hub
    checkpoint the folder's files were identified as, if any)."""
    folder = Path(folder) if folder else None
    if name == "default":
        return {"id": "oal-default-model", "license": PACKAGE_LICENSE,
                "license_note": f"the embedded default model ships inside the {DISTRIBUTION} package, under its "
                                "Apache-2.0 licence (its pretraining text is the CPython standard library, PSF-2.0)"}
    registry_name = name if isinstance(name, str) and name and not any(c in name for c in "/\\") and not Path(
        name).exists() else None  # a name the model registry resolves (a preset such as a GGUF's), not a path
    gguf = _gguf_facts(folder if folder is not None and folder.is_dir() else None)
    base_id = identified or hub_id(name) or (gguf or {}).get("id") or registry_name or (
        folder.name if folder else None) or "unknown"
    if gguf is not None:
        return {"id": base_id, "license": gguf["license"], "license_note": gguf["license_note"]}
    if folder is None or not folder.is_dir():
        return {"id": base_id, "license": "unknown",
                "license_note": "the base model's folder was not available to read its licence from"}
    for card in ("README.md", "MODEL_CARD.md"):
        if (folder / card).is_file() and (lic := _front_matter_license(folder / card)):
            return {"id": base_id, "license": lic, "license_note": f"from the base model's {card} front matter"}
    found = _license_file(folder)
    if found:
        lic, fname = found
        return {"id": base_id, "license": lic, "license_note": f"from the base model's {fname}"
                + ("" if lic != "other" else " (a licence oal does not name; read that file)")}
    return {"id": base_id, "license": "unknown",
            "license_note": "the base model's folder names no licence (no `license:` in a README.md front matter, "
                            "no LICENSE file); check its source before you share this model"}


def data_facts(config: dict | None, metrics: dict | None) -> tuple[list[str], list[str]]:
    """(hub dataset ids for the front matter, one markdown line per corpus behind the numbers)."""
    datasets: list[str] = []
    lines: list[str] = []
    data = (config or {}).get("data") or {}
    name = data.get("name")
    if name:
        meta = data.get("meta") or {}
        if str(name).startswith("wikitext"):
            datasets.append("Salesforce/wikitext")
            what = f"WikiText (`Salesforce/wikitext`, config `{name}`, revision `{meta.get('revision', '?')}`)"
        elif name == "builtin":
            what = ("oal's `builtin` corpus: the CPython standard library's documentation and docstrings "
                    f"(PSF-2.0; Python {meta.get('python_version', '?')})")
        else:
            what = f"a local text corpus `{Path(str(name)).name}`"
        sha = data.get("sha256")
        sha = sha.get("test") if isinstance(sha, dict) else sha  # per split: perplexity is on the test split
        lines.append(f"- Perplexity and attention fidelity: {what}, test split SHA256 `{str(sha or '?')[:16]}`; "
                     "grouping, calibration, adaptation and the test blocks are disjoint blocks of it (the run's "
                     "split plan, in its config.json).")
    for task, prov in sorted(((metrics or {}).get("zeroshot_data") or {}).items()):
        if not isinstance(prov, dict):
            continue
        if prov.get("source") == "task_file":
            lines.append(f"- Zero-shot {task}: a local JSON-lines file (unverified), SHA256 "
                         f"`{str(prov.get('sha256', '?'))[:16]}`.")
        elif prov.get("dataset_id"):
            datasets.append(prov["dataset_id"])
            lines.append(f"- Zero-shot {task}: `{prov['dataset_id']}` ({prov.get('config')}, {prov.get('split')}), "
                         f"revision `{str(prov.get('revision', '?'))[:12]}`.")
    return sorted(set(datasets)), lines
