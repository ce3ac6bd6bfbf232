"""`load_corpus`: a corpus by name or path (the builtin one, WikiText at its pinned revision, a local file or
folder)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from oal.data.corpus import Corpus, builtin_corpus, local_corpus
from oal.data.wikitext import CONFIGS as WIKITEXT_CONFIGS
from oal.data.wikitext import MANIFEST_NAME, load_wikitext

__all__ = ["load_corpus"]

log = logging.getLogger("oal")


_TRAINING_SUMMARY = Path(__file__).resolve().parents[1] / "assets" / "default_model" / "training_summary.json"


def _warn_if_builtin_differs(corpus: Corpus) -> None:
    """One warning line when this Python's builtin corpus is not the one the default model was trained on."""
    if not _TRAINING_SUMMARY.is_file():
        return
    trained = json.loads(_TRAINING_SUMMARY.read_text()).get("corpus", {})
    if trained.get("fingerprint") and trained["fingerprint"] != corpus.fingerprint():
        log.warning("builtin corpus differs from the one the default model was trained on (Python %s there, %s here); "
                    "continuing", trained.get("python_version", "?"), corpus.meta.get("python_version", "?"))
    corpus.meta["matches_default_model"] = trained.get("fingerprint") == corpus.fingerprint()


def load_corpus(name_or_path: str | Path = "builtin", *, data_dir: str | Path | None = None) -> Corpus:
    """A corpus by name or path.

    - "builtin": Python's own documentation (offline, any machine);
    - "wikitext-2-raw-v1" / "wikitext-103-raw-v1": WikiText at the pinned revision, from `data_dir` (verified by
      its manifest) or from the hub;
    - a folder holding a WikiText `manifest.json`: the single config listed there;
    - any other local file or folder of text, JSON-lines or parquet (see `local_corpus`).
    """
    name = str(name_or_path)
    if name == "builtin":
        corpus = builtin_corpus()
        _warn_if_builtin_differs(corpus)
        return corpus
    if name in WIKITEXT_CONFIGS:
        return load_wikitext(name, data_dir)
    path = Path(name)
    if path.is_dir() and (path / MANIFEST_NAME).is_file():
        configs = json.loads((path / MANIFEST_NAME).read_text()).get("configs", [])
        if len(configs) != 1:
            raise ValueError(f"name_or_path: {path} holds WikiText configs {configs}; name one of them and pass "
                             f"data_dir={str(path)!r}")
        return load_wikitext(configs[0], path)
    if path.exists():
        return local_corpus(path)
    raise ValueError(f"name_or_path: expected 'builtin', one of {WIKITEXT_CONFIGS} or an existing path, got {name!r}")
