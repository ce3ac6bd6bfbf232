"""Which page of the documentation site explains each command: `oal --help` and every command's `--help` end with
it (`app._Group` reads this mapping). The pages live in the repository's docs/ folder; `mkdocs serve` shows the
site. tests/test_docs_site.py checks that every command has a page here and that every page and anchor exists."""

from __future__ import annotations

# command -> page of docs/ (with an anchor where one section explains it); "" is `oal --help` itself
PAGES = {
    "": "reference/cli.md",
    "run": "getting-started.md#the-default-run",
    "analyze": "guides/regime.md",
    "calibrate": "guides/convert.md#stage-by-stage",
    "convert": "guides/convert.md#stage-by-stage",
    "generate": "guides/convert.md#stage-by-stage",
    "export": "guides/export.md",
    "evaluate": "guides/evaluation.md",
    "select-layers": "guides/layers-and-methods.md#which-layers-to-convert",
    "adapt": "guides/convert.md#adapting-a-run-again",
    "diagnose": "guides/regime.md#the-papers-diagnostics",
    "demo": "design/backends.md",
    "fetch": "guides/convert.md#from-the-command-line",
    "tune-cpu": "performance/tuning.md",
}


def docs_line(command: str) -> str:
    """The help's last line for `command` ("" for the command line itself)."""
    return f"Docs: docs/{PAGES[command]} in the oal repository (`mkdocs serve` shows the site)."
