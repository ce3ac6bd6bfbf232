"""The distribution's name (issue 37): `oal` on PyPI is another project, so the package is published as
`oal-attention` and every install line in the code, the README, the documentation site and the model card names
that."""

import re
from pathlib import Path

import pytest

from oal.artefact.base_facts import DISTRIBUTION

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]


def test_the_distribution_is_not_the_other_projects_oal():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == DISTRIBUTION == "oal-attention"
    assert project["scripts"] == {"oal": "oal.cli:main"}  # the command keeps its name
    for extra in project["optional-dependencies"].values():
        assert not [r for r in extra if re.match(r"oal\[", r)], extra  # self-references name the distribution


def test_every_install_line_names_the_distribution():
    pages = [ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "src").rglob("*.py")]
    texts = {p: p.read_text() for p in pages}
    for path, text in texts.items():
        for line in re.findall(r"pip install [^`\n]*", text):
            assert not re.search(r"pip install (-e )?'?oal(\[|\b(?!-attention))", line), (path, line)
