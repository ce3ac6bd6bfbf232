"""Text corpora with train/validation/test splits: the offline `builtin` corpus and local text files.

The `builtin` corpus is assembled at run time from documentation every CPython install carries
(`pydoc_data.topics` and the docstrings of the top-level standard-library modules), so no third-party text is
committed to the repository and every machine can build it offline.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import re
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

SPLITS = ("train", "validation", "test")
# Fractions of the text (in characters) that go to train / validation / test, in that order.
DEFAULT_FRACTIONS = (0.90, 0.05, 0.05)
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")


@dataclass
class Corpus:
    """A named corpus: `splits` maps "train"/"validation"/"test" to text; `sha256` holds one hash per split."""

    name: str
    splits: dict[str, str]
    sha256: dict[str, str] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [s for s in SPLITS if s not in self.splits]
        if missing:
            raise ValueError(f"splits: expected keys {SPLITS}, missing {missing}")
        if not self.sha256:
            self.sha256 = {s: sha256_text(self.splits[s]) for s in SPLITS}

    def fingerprint(self) -> str:
        """One hash over the three split hashes (what the default model card records)."""
        return sha256_text("\n".join(f"{s}:{self.sha256[s]}" for s in SPLITS))


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def normalize_whitespace(text: str) -> str:
    """Tabs to spaces, no trailing spaces, at most one blank line in a row, no leading/trailing blank lines."""
    lines = [line.rstrip() for line in text.expandtabs(4).replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip("\n")


def split_text(text: str, fractions: tuple[float, float, float] = DEFAULT_FRACTIONS) -> dict[str, str]:
    """Cut `text` into contiguous train/validation/test parts by character fractions.

    Each cut moves forward to the next paragraph break ("\\n\\n") so no document is torn mid-paragraph.
    """
    if len(fractions) != 3 or any(f <= 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions: expected three positive numbers summing to 1, got {fractions}")
    n = len(text)

    def cut(pos: int) -> int:
        nxt = text.find("\n\n", pos)
        return n if nxt < 0 else nxt

    a = cut(int(n * fractions[0]))
    b = max(a, cut(int(n * (fractions[0] + fractions[1]))))
    parts = {"train": text[:a], "validation": text[a:b], "test": text[b:]}
    return {k: v.strip("\n") for k, v in parts.items()}


def _stdlib_docstrings() -> list[str]:
    """Docstrings of the top-level stdlib modules, parsed (not imported: no side effects), in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs: list[str] = []
    for path in sorted(root.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):  # breadth-first, deterministic for a given file
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and doc.strip():
                    docs.append(doc)
    return docs


def builtin_text() -> str:
    """The full normalised text of the builtin corpus: pydoc topics (sorted by key), then stdlib docstrings."""
    import pydoc_data.topics as topics

    docs = [topics.topics[key] for key in sorted(topics.topics)] + _stdlib_docstrings()
    docs = [normalize_whitespace(d) for d in docs]
    return "\n\n".join(d for d in docs if d)


@functools.lru_cache(maxsize=1)
def _builtin_text_cached() -> str:
    return builtin_text()  # deterministic per interpreter, so computing it once per process is enough


def builtin_corpus() -> Corpus:
    text = _builtin_text_cached()
    meta = {
        "source": "pydoc_data.topics + top-level stdlib docstrings",
        "python_version": sys.version.split()[0],
        "fractions": list(DEFAULT_FRACTIONS),
        "chars": len(text),
        "sha256_full": sha256_text(text),
    }
    return Corpus("builtin", split_text(text), meta=meta)


def _read_text(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"name_or_path: {path} is not UTF-8 text ({exc})") from exc
    if "\x00" in text:  # valid UTF-8 can still be a binary file
        raise ValueError(f"name_or_path: {path} is binary (it holds NUL bytes), not text")
    return text


def local_corpus(path: str | Path) -> Corpus:
    """A local text file or folder.

    - a file: normalised and split 90/5/5;
    - a folder with `train.txt`, `validation.txt` and `test.txt`: those are the splits, as they are;
    - any other folder: every text file (suffixes .txt .md .rst .text) below it, in sorted path order,
      normalised, joined with a blank line and split 90/5/5.
    """
    path = Path(path)
    if path.is_file():
        text = normalize_whitespace(_read_text(path))
        files = [path.name]
        splits = split_text(text)
    elif path.is_dir():
        named = {s: path / f"{s}.txt" for s in SPLITS}
        if all(p.is_file() for p in named.values()):
            splits = {s: _read_text(p) for s, p in named.items()}
            files = [p.name for p in named.values()]
        else:
            paths = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES)
            if not paths:
                raise ValueError(f"name_or_path: folder {path} holds no text files ({', '.join(TEXT_SUFFIXES)})")
            text = "\n\n".join(t for t in (normalize_whitespace(_read_text(p)) for p in paths) if t)
            files = [str(p.relative_to(path)) for p in paths]
            splits = split_text(text)
    else:
        raise ValueError(f"name_or_path: expected 'builtin', a WikiText config or an existing path, got {path!s}")
    if not splits["train"].strip():
        raise ValueError(f"name_or_path: corpus at {path} has an empty train split")
    return Corpus(path.name or str(path), splits, meta={"source": str(path.resolve()), "files": files})
