"""The documentation site (issue 49) and the README that points into it.

The site builds with `mkdocs build --strict` (every warning fails it: a link to a missing file or anchor, a
docstring griffe cannot read), and a broken copy is shown to fail. Every object of the API reference has a
docstring of its own, and every public name of `oal` is in the reference. Every command's `--help` names the page
that explains it, and that page and anchor exist. The README stays short, its links resolve, and its two set-up
commands are the ones `.ci/run` runs.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
API_PAGE = DOCS / "reference" / "api.md"
MAX_README_LINES = 250


def _mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's end-of-life banner is not a build warning
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, env=env, cwd=config.parent, timeout=600)


# ------------------------------------------------------------------------------------------------ the strict build

def test_the_site_builds_strictly_with_its_assets_local(tmp_path):
    done = _mkdocs_build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-4000:]
    home = (tmp_path / "site" / "index.html").read_text()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "oal.linearize" in api and "oal.ops.oal_attention" in api and "RunConfig" in api
    for page in (home, api):  # the theme's fonts, scripts and styles come with the site, not from a CDN
        assert not re.findall(r'<(?:script|link)[^>]+(?:src|href)="https?://', page)
    assert (tmp_path / "site" / "reference" / "frontier_smollm2_retimed.png").is_file()  # served by docs/hooks


def _mini_site(tmp_path: Path, page: str) -> Path:
    """The project's theme, markdown and `validation` settings over two pages: `broken.md` (holding `page`) and an
    index with one section."""
    cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir(parents=True)
    (docs / "index.md").write_text("# Home\n\n## The default run\n\nText.\n")
    (docs / "broken.md").write_text(page)
    cfg.update(docs_dir="docs", nav=["index.md", "broken.md"], plugins=["search"], exclude_docs="")
    cfg.pop("hooks", None)
    config = tmp_path / "mkdocs.yml"
    config.write_text(yaml.safe_dump(cfg))
    return config


@pytest.mark.parametrize("link,message", [
    ("[x](index.md#no-such-section)", "does not contain an anchor '#no-such-section'"),
    ("[x](#no-such-heading)", "no-such-heading"),
    ("[x](guides/no-such-page.md)", "not found among documentation files"),
])
def test_a_link_to_a_missing_anchor_or_file_fails_the_build(tmp_path, link, message):
    broken = _mkdocs_build(_mini_site(tmp_path, f"# A page\n\n{link}\n"), tmp_path / "site")
    assert broken.returncode != 0 and message in broken.stderr, broken.stderr[-2000:]


def test_the_same_small_site_with_sound_links_builds(tmp_path):
    sound = _mkdocs_build(_mini_site(tmp_path, "# A page\n\n[x](index.md#the-default-run) [y](#a-page)\n"),
                          tmp_path / "site")
    assert sound.returncode == 0, sound.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ docstrings

def _api_objects(text: str) -> list[tuple[str, list[str]]]:
    """(dotted path, listed members) of every `::: path` directive of an API page."""
    out = []
    for m in re.finditer(r"^::: (\S+)\n((?:[ \t]+.*\n)*)", text, re.M):
        members = re.search(r"members: \[(.*)\]", m.group(2))
        out.append((m.group(1), [x.strip() for x in members.group(1).split(",")] if members else []))
    return out


def _resolve(path: str):
    try:
        return importlib.import_module(path)
    except ImportError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def _own_doc(obj) -> str:
    """The object's own docstring: not inherited, and not the signature dataclasses write for a class without one."""
    target = obj.fget if isinstance(obj, property) else obj
    doc = (target.__dict__.get("__doc__") if inspect.isclass(target) else getattr(target, "__doc__", None)) or ""
    if inspect.isclass(target) and dataclasses.is_dataclass(target) and doc.startswith(f"{target.__name__}("):
        return ""
    return doc.strip()


def missing_docstrings(objects: list[tuple[str, list[str]]]) -> list[str]:
    """The dotted names among `objects` (and their listed members) without a docstring of their own."""
    missing = []
    for path, members in objects:
        obj = _resolve(path)
        if not _own_doc(obj):
            missing.append(path)
        missing += [f"{path}.{m}" for m in members if not _own_doc(inspect.getattr_static(obj, m))]
    return missing


def test_every_object_of_the_api_reference_has_its_own_docstring():
    objects = _api_objects(API_PAGE.read_text())
    assert len(objects) >= 15
    assert missing_docstrings(objects) == []


def test_every_public_name_of_oal_is_in_the_api_reference():
    import oal

    documented = {path for path, _ in _api_objects(API_PAGE.read_text())}
    assert {f"{oal._LAZY[name]}.{name}" for name in oal.__all__} <= documented
    assert "oal.ops.oal_attention" in documented


def test_the_docstring_check_can_fail():
    @dataclasses.dataclass
    class Settings:
        steps: int = 1

    class Method:
        """Documented."""

        def forward(self):
            pass

    def bare():
        pass

    here = sys.modules[__name__]
    try:
        here.Settings, here.Method, here.bare = Settings, Method, bare
        found = missing_docstrings([(f"{__name__}.Settings", []), (f"{__name__}.Method", ["forward"]),
                                    (f"{__name__}.bare", []), (f"{__name__}.missing_docstrings", [])])
    finally:
        del here.Settings, here.Method, here.bare
    assert found == [f"{__name__}.Settings", f"{__name__}.Method.forward", f"{__name__}.bare"]


# ------------------------------------------------------------------------------------------------ links and anchors

def _slug(heading: str) -> str:
    from markdown.extensions.toc import slugify

    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return slugify(text, "-")


def anchors(page: Path) -> set[str]:
    """The heading ids of a markdown page as the site's toc makes them (plus mkdocstrings' object ids)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    ids = {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}
    return ids | {path for path, _ in _api_objects(text)}


def broken_links(page: Path) -> list[str]:
    """Relative links of a markdown page whose file or anchor does not exist."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and (file.suffix != ".md" or anchor not in anchors(file))):
            bad.append(target)
    return bad


def test_the_readme_is_short_and_its_links_resolve():
    assert len(README.read_text().splitlines()) <= MAX_README_LINES
    assert broken_links(README) == []
    assert "docs/index.md" in README.read_text()


def test_the_link_check_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# Title\n\n## A section\n")
    page = tmp_path / "README.md"
    page.write_text("[a](docs/page.md#a-section) [b](docs/page.md#gone) [c](docs/none.md) [d](https://x.org)\n")
    assert broken_links(page) == ["docs/page.md#gone", "docs/none.md"]


def test_the_readme_set_up_commands_are_the_ones_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), re.S)
    install, tests = blocks[0].strip(), blocks[1].strip()
    assert install == ("python3 -m venv .venv && .venv/bin/pip install -e '.[dev]' && "
                       ".venv/bin/oal run --out runs/default")
    assert "python3 -m venv .venv" in ci and ".venv/bin/pip install -q -e '.[dev]'" in ci
    assert tests in ci


# ------------------------------------------------------------------------------------------------ help -> page

@pytest.fixture(scope="module")
def cli():
    import typer.main

    from oal.cli import load_commands

    app = load_commands()
    return app, typer.main.get_command(app)


def test_every_command_has_a_page_that_exists(cli):
    from oal.cli.docs import PAGES

    _, group = cli
    assert set(PAGES) == {"", *group.commands}
    for command, target in PAGES.items():
        path, _, anchor = target.partition("#")
        assert (DOCS / path).is_file(), (command, target)
        assert not anchor or anchor in anchors(DOCS / path), (command, target)


def test_every_help_names_its_page(cli):
    from typer.testing import CliRunner

    from oal.cli.docs import PAGES, docs_line

    app, _ = cli
    runner = CliRunner()
    for command in PAGES:
        result = runner.invoke(app, [command, "--help"] if command else ["--help"], env={"COLUMNS": "300"},
                               prog_name="oal")
        assert result.exit_code == 0, result.output
        assert " ".join(docs_line(command).split()) in " ".join(result.output.split()), command


def test_the_cli_page_lists_the_same_pages():
    from oal.cli.docs import PAGES

    text = (DOCS / "reference" / "cli.md").read_text()
    rows = dict(re.findall(r"^\| `oal (?:--help|([\w-]+))` \| \[([^\]]+)\]", text, re.M))
    assert rows == PAGES
