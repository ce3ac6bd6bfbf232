"""Text corpora with train/validation/test splits: the offline `builtin` corpus and local text files.

The `builtin` corpus is assembled at run time from what every CPython install carries: `pydoc_data.topics`, the
docstrings of the standard-library modules and their source code (PSF License), so no third-party text is
committed to the repository and every machine with the same Python version builds the same text offline. Its
train split starts with held-out prose (the text `oal run` groups, calibrates, evaluates and adapts on); the
embedded model was pretrained only on the rest of train (see `builtin_layout` and `oal.data.splits`).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import logging
import re
import sys
import sysconfig
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

from oal.data.builtin_cache import cached_layout

log = logging.getLogger("oal")

SPLITS = ("train", "validation", "test")
# Fractions of the text (in characters) that go to train / validation / test, in that order.
DEFAULT_FRACTIONS = (0.90, 0.05, 0.05)
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
JSONL_SUFFIXES = (".jsonl",)
PARQUET_SUFFIXES = (".parquet",)
FOLDER_SUFFIXES = TEXT_SUFFIXES + JSONL_SUFFIXES + PARQUET_SUFFIXES
DOCUMENT_SUFFIXES = (".txt", ".jsonl", ".parquet")  # of the named split files (train.txt, train.jsonl, ...)


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

    Each cut moves forward to the next paragraph break ("\\n\\n") so no document is torn mid-paragraph; when the
    part it would cut into has none (text without blank lines, one long last paragraph), to its next line break,
    then its next space, then it cuts where it is, so validation and test are never emptied by the layout.
    """
    if len(fractions) != 3 or any(f <= 0 for f in fractions) or abs(sum(fractions) - 1.0) > 1e-9:
        raise ValueError(f"fractions: expected three positive numbers summing to 1, got {fractions}")
    n = len(text)

    def cut(lo: int, hi: int) -> tuple[int, int]:
        """(end of the part before, start of the part after) at the first separator in text[lo:hi]."""
        for sep in ("\n\n", "\n", " "):
            i = text.find(sep, lo, hi)
            if i >= 0:
                return i, i + len(sep)
        return lo, lo

    pos_a, pos_b = int(n * fractions[0]), int(n * (fractions[0] + fractions[1]))
    a_end, a_next = cut(pos_a, pos_b)
    b_end, b_next = cut(max(pos_b, a_next), n)
    parts = {"train": text[:a_end], "validation": text[a_next:b_end], "test": text[b_next:]}
    return {k: v.strip("\n") for k, v in parts.items()}


# The standard-library files of the builtin corpus: every `.py` file under the stdlib folder except test suites,
# packages that Linux distributions ship separately or patch (so the text is the same on every install of one
# Python version), generated tables (encodings) and machine-specific files.
STDLIB_EXCLUDED_DIRS = frozenset({
    "site-packages", "test", "tests", "idle_test", "__pycache__", "lib-dynload", "idlelib", "tkinter", "turtledemo",
    "lib2to3", "distutils", "ensurepip", "venv", "encodings", "pydoc_data"})
STDLIB_EXCLUDED_FILES = frozenset({"site.py", "sysconfig.py"})
# Shares of the prose (pydoc topics + docstrings, in characters) held out from pretraining: the head of the
# train split (grouping, calibration, fidelity and adaptation text), validation and test. The rest of the prose
# and all of the code are the embedded model's pretraining text.
HELDOUT_FRACTIONS = {"train": 0.30, "validation": 0.05, "test": 0.05}
MIN_REPEAT = 32  # paragraphs at least this long occur once in the whole builtin corpus
BUILTIN_SOURCE = ("CPython standard library (PSF License): pydoc_data.topics, the docstrings of the stdlib modules "
                  "and their source code with the docstrings removed")


def stdlib_files() -> list[Path]:
    """The stdlib `.py` files of the builtin corpus, in sorted path order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(p in STDLIB_EXCLUDED_DIRS or p.startswith("config-") for p in rel.parts[:-1]):
            continue
        if rel.name in STDLIB_EXCLUDED_FILES or rel.name.startswith("_sysconfigdata"):
            continue
        out.append(path)
    return out


def _docstrings_and_code(source: str) -> tuple[list[str], str]:
    """(docstrings in ast.walk order, the source with every docstring's lines removed); parsed, never imported."""
    tree = ast.parse(source)
    docs, drop = [], set()
    for node in ast.walk(tree):  # breadth-first, deterministic for a given file
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc is not None:
                expr = node.body[0]
                drop.update(range(expr.lineno, expr.end_lineno + 1))
                if doc.strip():
                    docs.append(doc)
    code = "\n".join(line for i, line in enumerate(source.split("\n"), 1) if i not in drop)
    return docs, code


def _stable_rank(key: str) -> str:
    return hashlib.sha256(f"oal-builtin/{key}".encode()).hexdigest()


def builtin_units() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(prose units, code units) of the builtin corpus as (id, normalised text).

    Prose: one unit per pydoc topic ("topic:<key>") and per stdlib file ("doc:<path>": its docstrings, each kept
    only at its first occurrence in path order, so no docstring appears in two units). Code: one unit per file
    ("code:<path>"), the source with the docstrings removed.
    """
    import pydoc_data.topics as topics

    prose = [(f"topic:{key}", normalize_whitespace(topics.topics[key])) for key in sorted(topics.topics)]
    code, seen = [], set()
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_files():
        try:
            with tokenize.open(path) as f:  # honours coding cookies
                source = f.read()
            docs, stripped = _docstrings_and_code(source)
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        rel = path.relative_to(root).as_posix()
        fresh = []
        for d in (normalize_whitespace(d) for d in docs):
            if d and d not in seen:
                seen.add(d)
                fresh.append(d)
        if fresh:
            prose.append((f"doc:{rel}", "\n\n".join(fresh)))
        stripped = normalize_whitespace(stripped)
        if stripped:
            code.append((f"code:{rel}", stripped))
    return [(k, t) for k, t in prose if t], code


def _drop_repeats(units: list[tuple[str, str]], seen: set[str]) -> list[tuple[str, str]]:
    """Units without the paragraphs (of at least MIN_REPEAT characters) already in `seen`, which gains the rest.

    pydoc topics repeat whole sections of one another and docstrings repeat boilerplate, so without this a
    held-out paragraph could also sit in the pretraining text."""
    out = []
    for uid, text in units:
        kept = []
        for par in text.split("\n\n"):
            if len(par) >= MIN_REPEAT and par in seen:
                continue
            seen.add(par)
            kept.append(par)
        if kept:
            out.append((uid, "\n\n".join(kept)))
    return out


def builtin_layout() -> dict:
    """The builtin corpus, split: prose units in a fixed pseudo-random order (by a hash of their id) go to the
    held-out head of train, validation and test by `HELDOUT_FRACTIONS`; the remaining prose and all the code
    form the pretraining text, which follows the held-out head in the train split. A paragraph that occurs more
    than once is kept only in the first of test, validation, held-out head, pretraining.

    Returns {"splits": {train, validation, test}, "pretrain_start": character offset of the pretraining text in
    train, "units": {part: [unit ids]}}.
    """
    prose, code = builtin_units()
    prose = sorted(prose, key=lambda u: _stable_rank(u[0]))
    total = sum(len(t) for _, t in prose)
    parts: dict[str, list[tuple[str, str]]] = {"heldout_train": [], "validation": [], "test": []}
    done = 0
    for name, split in (("heldout_train", "train"), ("validation", "validation"), ("test", "test")):
        size = 0
        while done < len(prose) and size < HELDOUT_FRACTIONS[split] * total:
            parts[name].append(prose[done])
            size += len(prose[done][1])
            done += 1
    parts["pretrain"] = prose[done:] + code
    seen: set[str] = set()
    for name in ("test", "validation", "heldout_train", "pretrain"):  # earlier parts keep a repeated paragraph
        parts[name] = _drop_repeats(parts[name], seen)

    def join(units):
        return "\n\n".join(t for _, t in units)

    head, pretrain = join(parts["heldout_train"]), join(parts["pretrain"])
    return {"splits": {"train": f"{head}\n\n{pretrain}", "validation": join(parts["validation"]),
                       "test": join(parts["test"])},
            "pretrain_start": len(head) + 2,
            "units": {k: [u for u, _ in v] for k, v in parts.items()}}


def builtin_inputs() -> tuple[Path, list[Path]]:
    """(the stdlib folder, every file `builtin_layout` reads): the stdlib files, then pydoc's topics."""
    import pydoc_data.topics as topics

    return Path(sysconfig.get_paths()["stdlib"]), [*stdlib_files(), Path(topics.__file__)]


@functools.lru_cache(maxsize=1)
def _builtin_layout_cached() -> dict:
    root, files = builtin_inputs()  # deterministic per interpreter: once per process, read from the user's cache
    return cached_layout(builtin_layout, Path(__file__), files, root, SPLITS)


def builtin_corpus() -> Corpus:
    """Python's own documentation and source (see `builtin_layout`); meta records where pretraining text starts."""
    lay = _builtin_layout_cached()
    pretrain = lay["splits"]["train"][lay["pretrain_start"]:]
    meta = {
        "source": BUILTIN_SOURCE,
        "licence": "PSF-2.0",
        "python_version": sys.version.split()[0],
        "heldout_fractions": dict(HELDOUT_FRACTIONS),
        "chars": {s: len(t) for s, t in lay["splits"].items()},
        "pretrain_start_char": lay["pretrain_start"],
        "pretrain_sha256": sha256_text(pretrain),
        "units": {k: len(v) for k, v in lay["units"].items()},
    }
    return Corpus("builtin", dict(lay["splits"]), meta=meta)


def _read_text(path: Path) -> str:
    try:  # utf-8-sig: a byte-order mark is not text; universal newlines turn CRLF into LF
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ValueError(f"name_or_path: {path} is not UTF-8 text ({exc})") from exc
    if "\x00" in text:  # valid UTF-8 can still be a binary file
        raise ValueError(f"name_or_path: {path} is binary (it holds NUL bytes), not text")
    return text


def _text_field(value, where: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"name_or_path: {where}: expected a string 'text', got {type(value).__name__}")
    return value


def _read_jsonl(path: Path) -> list[str]:
    """The "text" field of every object of a JSON-lines file (blank lines skipped)."""
    docs = []
    for i, line in enumerate(_read_text(path).split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"name_or_path: {path} line {i} is not JSON ({exc})") from None
        if not isinstance(row, dict) or "text" not in row:
            raise ValueError(f"name_or_path: {path} line {i}: expected an object with a 'text' field, got "
                             f"{line[:80]!r}")
        docs.append(_text_field(row["text"], f"{path} line {i}"))
    return docs


def _read_parquet(path: Path) -> list[str]:
    """The "text" column of a parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(path).names
        rows = pq.read_table(path, columns=["text"]).column("text").to_pylist() if "text" in names else None
    except (OSError, pa.ArrowException) as exc:
        raise ValueError(f"name_or_path: {path} is not a readable parquet file ({exc})") from exc
    if rows is None:
        raise ValueError(f"name_or_path: {path} has no 'text' column (columns: {', '.join(names)})")
    return [_text_field(t, f"{path} row {i}") for i, t in enumerate(rows)]


def read_documents(path: Path) -> str:
    """The text of one local file: a text file as it is (no BOM, LF line ends), the "text" field of a JSON-lines
    file (.jsonl) or the "text" column of a parquet file, one document after another with a blank line between."""
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "\n\n".join(_read_jsonl(path))
    if suffix in PARQUET_SUFFIXES:
        return "\n\n".join(_read_parquet(path))
    return _read_text(path)


def _paragraphs(text: str):
    """The stripped blank-line separated paragraphs of `text` of at least MIN_REPEAT characters, one at a time."""
    pos = 0
    while pos <= len(text):
        nxt = text.find("\n\n", pos)
        nxt = len(text) if nxt < 0 else nxt
        par = text[pos:nxt].strip()
        if len(par) >= MIN_REPEAT:
            yield par
        pos = nxt + 2


def _overlap_warning(splits: dict[str, str], where: Path) -> None:
    """Warn when paragraphs (of at least MIN_REPEAT characters) of validation or test also occur in an earlier
    split: the held-out numbers would then measure text the run calibrated, adapted or selected on. Only the two
    held-out splits are held in memory; train is streamed."""
    held = {s: set(_paragraphs(splits[s])) for s in SPLITS[1:]}
    shared = {(s, "train"): set() for s in held}
    for par in _paragraphs(splits["train"]):
        for s, pars in held.items():
            if par in pars:
                shared[(s, "train")].add(par)
    shared[("test", "validation")] = held["test"] & held["validation"]
    for (s, earlier), pars in shared.items():
        if pars:
            log.warning("corpus at %s: %d of the %d paragraphs of %s also occur in %s, so %s is not held out from "
                        "it (evaluation leakage)", where, len(pars), len(held[s]), s, earlier, s)


def local_corpus(path: str | Path) -> Corpus:
    """A local file or folder of text (.txt .md .rst .text or any other suffix for a file given by name),
    JSON-lines (.jsonl, the "text" field of each line) or parquet (.parquet, the "text" column).

    - a file: normalised and split 90/5/5 (cuts at paragraph breaks, see `split_text`);
    - a folder with one `train`, `validation` and `test` file each (`train.txt`, `train.jsonl`, ...): those are the
      splits, as they are (a byte-order mark dropped, CRLF read as LF);
    - a folder with two of those but not the third: refused (merging them would put test text in train);
    - any other folder: every text, JSON-lines and parquet file below it, in sorted path order, normalised, joined
      with a blank line and split 90/5/5; files of other suffixes are skipped.

    Paragraphs of validation or test that also occur in an earlier split are reported in a warning (leakage).
    """
    path = Path(path)
    if path.is_file():
        text = normalize_whitespace(read_documents(path))
        files = [path.name]
        splits = split_text(text)
    elif path.is_dir():
        named = {s: [path / f"{s}{x}" for x in DOCUMENT_SUFFIXES if (path / f"{s}{x}").is_file()] for s in SPLITS}
        if all(named.values()):
            ambiguous = {s: [p.name for p in ps] for s, ps in named.items() if len(ps) > 1}
            if ambiguous:
                raise ValueError(f"name_or_path: folder {path} holds more than one file for a split: {ambiguous}")
            splits = {s: read_documents(ps[0]) for s, ps in named.items()}
            files = [ps[0].name for ps in named.values()]
        else:
            partial = [ps[0].name for ps in named.values() if ps]
            if len(partial) > 1:  # merged and re-split, the user's test text would land in train
                missing = [s for s, ps in named.items() if not ps]
                raise ValueError(f"name_or_path: folder {path} holds split files {partial} but none for {missing}; "
                                 f"add {', '.join(f'{s}.txt' for s in missing)} (or .jsonl/.parquet) to use them "
                                 "as the splits, or rename them to have the folder's text split 90/5/5")
            paths = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in FOLDER_SUFFIXES)
            if not paths:
                raise ValueError(f"name_or_path: folder {path} holds no text files ({', '.join(FOLDER_SUFFIXES)})")
            text = "\n\n".join(t for t in (normalize_whitespace(read_documents(p)) for p in paths) if t)
            files = [str(p.relative_to(path)) for p in paths]
            splits = split_text(text)
    else:
        raise ValueError(f"name_or_path: expected 'builtin', a WikiText config or an existing path, got {path!s}")
    if not splits["train"].strip():
        raise ValueError(f"name_or_path: corpus at {path} has an empty train split")
    _overlap_warning(splits, path)
    return Corpus(path.name or str(path), splits, meta={"source": str(path.resolve()), "files": files})
