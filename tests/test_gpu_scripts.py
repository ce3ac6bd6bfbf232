"""The prepared GPU scripts (scripts/gpu_*.sh) run only on a lent GPU, minutes at a time, so an option renamed in the
CLI or a benchmark would first show there, with the device minutes already spent. Here, without a GPU: each script
parses as bash, and every `oal` command and every `python -m benchmarks.X` / `scripts/X` in it exists with each
option it passes (the static check of the documentation's bash blocks, `test_docs_blocks`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_docs_blocks import _cli_problems, _command_lines, _tool_problems

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "scripts").glob("gpu_*.sh"))


def _group():
    import typer.main

    from oal.cli import load_commands

    return typer.main.get_command(load_commands())


def _problems(text: str) -> tuple[list[str], int, int]:
    """(problems, oal commands checked, benchmark/script commands checked) of a script's text."""
    group, problems, n_oal, n_tools = _group(), [], 0, 0
    for command in _command_lines(text):
        if " -m oal " in f" {command} ":
            n_oal += 1
        if " -m benchmarks." in command or "scripts/" in command:
            n_tools += 1
        problems += _cli_problems(command, group) + _tool_problems(command)
    return problems, n_oal, n_tools


def test_there_are_gpu_scripts():
    assert {p.name for p in SCRIPTS} >= {"gpu_check.sh", "gpu_perf.sh", "gpu_budget.sh", "gpu_budget_prep.sh"}


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_gpu_script_parses_and_names_only_existing_commands_and_options(script):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    problems, n_oal, n_tools = _problems(script.read_text())
    assert problems == []
    if script.name == "gpu_check.sh":  # the end-to-end matrix: every command of the issue
        assert n_oal >= 14 and n_tools >= 2, (n_oal, n_tools)


def test_the_check_finds_a_renamed_option():
    text = '"$PY" -m oal run --out "$ALL" --stepz 20\n"$PY" -m benchmarks.generate --contextz 8192\n'
    problems, n_oal, n_tools = _problems(text)
    assert n_oal == 1 and n_tools == 1
    assert len(problems) == 2 and "--stepz" in problems[0] and "--contextz" in problems[1]
