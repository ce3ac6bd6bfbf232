"""What the docs quote from the code, checked against it (tests/test_docs_claims.py checks options, variables, names
and numbers; this file the rest):

- every message the pages quote in their prose (an inline `Error: ...` / `ValueError: ...` span, or a sentence-like
  span) is a string the code builds: oal's own, or the transformers / peft message of a route the export guide
  says refuses. Placeholders (`FOLDER`, `ADDR:PORT`, `...`) stand for any text, and so does a value the code
  formats in (`{path}`);
- the getting-started table of a run directory names every entry `oal run` writes (`RUN_ENTRIES`);
- the benchmarks page lists every benchmark module.

Each check is shown to fail on a page with the error injected.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import cache
from pathlib import Path

from test_docs_blocks import PAGES, ROOT, _name

# transformers' and peft's modules whose refusals docs/guides/export.md quotes
FOREIGN_MODULES = ("transformers.modeling_utils", "transformers.models.auto.configuration_auto", "peft.config")
WILD = None  # a stretch of any text: a formatted value in the code, a placeholder on a page


def _prose(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def quoted_messages(text: str) -> list[str]:
    """The messages a page's prose quotes: inline spans that start `Error: ` / `SomeError: `, or that read as a
    sentence (a lowercase word first, five words or more, no code characters)."""
    out = []
    for span in re.findall(r"`([^`]+)`", _prose(text)):
        span = " ".join(span.split())
        sentence = re.match(r"[a-z]", span) and len(span.split()) >= 5 and not re.search(r"[=_{}/<>]|--", span)
        if (re.match(r"\w*Error: ", span) or sentence) and not re.match(r"(oal|python) ", span) \
                and _literal(_doc_items(span)) >= 15:
            out.append(span)
    return out


def _doc_items(message: str) -> list[str | None]:
    """The message as characters, less the CLI's and the exception's prefixes, placeholders as WILD."""
    message = re.sub(r"^\w*Error: ", "", message)
    message = re.sub(r"^Invalid value for '?[-\w]+'?: ", "", message)
    items: list[str | None] = []
    for part in re.split(r"(\.\.\.|\b[A-Z][A-Z0-9_]{2,}(?::[A-Z]+)?\b)", message):
        if part == "..." or re.fullmatch(r"[A-Z][A-Z0-9_]{2,}(?::[A-Z]+)?", part or "-"):
            items.append(WILD)
        else:
            items.extend(part)
    return items


def _template(node: ast.AST) -> list[str | None] | None:
    """A string node of the code as characters, its formatted values (and %-placeholders) as WILD."""
    parts = node.values if isinstance(node, ast.JoinedStr) else [node]
    items: list[str | None] = []
    for part in parts:
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            for piece in re.split(r"(%[-.\d]*[sdrf])", re.sub(r"\s+", " ", part.value.replace("`", ""))):
                items.extend([WILD] if re.fullmatch(r"%[-.\d]*[sdrf]", piece) else piece)
        else:
            items.append(WILD)
    return items


def _sources() -> list[Path]:
    files = sorted((ROOT / "src" / "oal").rglob("*.py"))
    for module in FOREIGN_MODULES:  # found without importing them (peft's import takes seconds)
        package, _, rest = module.partition(".")
        spec = importlib.util.find_spec(package)
        files.append(Path(spec.origin).parent.joinpath(*rest.split(".")).with_suffix(".py"))
    return files


@cache
def templates() -> tuple[tuple[tuple[str | None, ...], str], ...]:
    """(items, literal text) of every string constant and f-string of oal's source and FOREIGN_MODULES."""
    out = []
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.JoinedStr) or (isinstance(node, ast.Constant) and isinstance(node.value, str)):
                items = _template(node)
                text = "".join(c for c in items if c is not WILD)
                if len(text) >= 10:
                    out.append((tuple(items), " ".join(text.split())))
    return tuple(out)


def _literal(items: list[str | None]) -> int:
    return sum(1 for c in items if c is not WILD)


def _best(doc: list[str | None], tpl: tuple[str | None, ...]) -> int:
    """How well a stretch of `doc` aligns with a stretch of `tpl`, WILD on either side standing for any text: 4 a
    character matched literally, 1 a character of `doc` taken by a formatted value of `tpl`, -8 a literal character
    of `doc` left outside the stretch (a message built of several strings, `f"{a}: {b}"`, is quoted whole)."""
    n, m = len(doc), len(tpl)
    suffix = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] + (doc[i] is not WILD)
    below, top = [0] * (m + 1), -(1 << 30)  # row i + 1 (row n: nothing of doc left)
    for i in range(n - 1, -1, -1):
        d, stop = doc[i], -8 * suffix[i]
        row = [stop] * (m + 1)
        for j in range(m - 1, -1, -1):
            t, best = tpl[j], stop
            if d is WILD:
                best = max(best, below[j], row[j + 1])
            elif t is WILD:
                best = max(best, below[j] + 1, row[j + 1])
            elif d == t:
                best = max(best, 4 + below[j + 1])
            row[j] = best
        top, below = max(top, max(row) - 8 * (suffix[0] - suffix[i])), row
    return top


def message_found(message: str) -> bool:
    """Whether some string of the code aligns with `message`: `_best` at least 4 x max(15, half its literal
    characters). A word changed right beside a placeholder can pass (the code's value may be that word); one
    changed elsewhere, or a sentence the code does not build, fails."""
    doc = _doc_items(" ".join(message.split()))
    words = set(re.findall(r"[A-Za-z']{5,}", "".join(c for c in doc if c is not WILD)))
    need = max(1, len(words) // 2)
    for items, text in templates():
        if sum(w in text for w in words) >= need and _best(doc, items) >= 4 * max(15, 0.5 * _literal(doc)):
            return True
    return False


def test_every_quoted_message_is_one_the_code_builds():
    quoted = [(_name(page), m) for page in PAGES for m in quoted_messages(page.read_text())]
    assert len(quoted) >= 8 and any(p == "docs/guides/distributed.md" for p, _ in quoted)  # the scan finds them
    assert [(page, m) for page, m in quoted if not message_found(m)] == []


def test_the_message_check_can_fail():
    assert message_found("did not meet the others at ADDR:PORT within 600 s")
    assert message_found("Error: Invalid value for '--model': FOLDER holds pickle weights only (pytorch_model.bin)")
    assert not message_found("did not join the others at ADDR:PORT within 600 s")
    assert not message_found("lost contact with one process of this launch")
    assert not message_found("ValueError: directory: EXPORT is a converted folder; load it with no base_model")
    assert quoted_messages("It says `lost contact with another process of this launch` once.")
    assert not quoted_messages("```\n`lost contact with another process of this launch`\n```\n`z_m = L0m + s`")


# ------------------------------------------------------------------------------------------------ run directory

def run_dir_missing(text: str) -> list[str]:
    """The entries of RUN_ENTRIES that getting-started's table of a run directory does not name."""
    from oal.rundir.claim import RUN_ENTRIES

    section = text.split("## What a run directory holds", 1)[1].split("\n## ", 1)[0]
    table = "\n".join(row for row in section.splitlines() if row.startswith("| "))
    named = {re.split(r"/", span, maxsplit=1)[0] for span in re.findall(r"`([^`]+)`", table)}
    return [entry for entry in RUN_ENTRIES if entry not in named]


def test_the_run_directory_table_names_every_entry_oal_run_writes():
    text = (ROOT / "docs" / "getting-started.md").read_text()
    assert run_dir_missing(text) == []
    assert run_dir_missing(text.replace("`selection.json`, ", "")) == ["selection.json"]


# ------------------------------------------------------------------------------------------------ benchmarks

def benchmarks_missing(text: str) -> list[str]:
    """The benchmark modules (benchmarks/NAME.py, not _private) the page never runs as `-m benchmarks.NAME`."""
    modules = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.stem.startswith("_"))
    return [m for m in modules if not re.search(rf"-m benchmarks\.{m}\b", text)]


def test_the_benchmarks_page_lists_every_benchmark():
    text = (ROOT / "docs" / "performance" / "benchmarks.md").read_text()
    assert benchmarks_missing(text) == []
    assert benchmarks_missing(text.replace("-m benchmarks.window ", "-m benchmarks.windows ")) == ["window"]
