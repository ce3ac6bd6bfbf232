"""The command line as a researcher meets it: `oal --help` lists each command on one line, grouped and in the
order of a first session; `oal --quiet` and `oal --no-progress` reach every command; the library's errors name the
option the user typed."""

from __future__ import annotations

import click
import pytest
import typer
from typer.testing import CliRunner

from oal.cli import load_commands
from oal.cli.docs import PANELS, short_help
from oal.cli.failures import bad_input_message


def _invoke(*args):
    return CliRunner().invoke(load_commands(), [str(a) for a in args])


def _commands():
    app = load_commands()
    group = typer.main.get_command(app)
    ctx = click.Context(group)
    return group, ctx, {name: group.get_command(ctx, name) for name in group.list_commands(ctx)}


def test_top_level_help_lists_each_command_on_one_line_in_panels():
    """The listing showed each command's whole help, hard line breaks included ('... manifest,\\n model card')."""
    group, ctx, commands = _commands()
    assert set(commands) == {n for names in PANELS.values() for n in names}  # every command in a panel
    assert list(commands)[0] == "run"
    for name, cmd in commands.items():
        assert "\n" not in cmd.short_help and cmd.short_help.endswith(".") and len(cmd.short_help) < 300, name
        assert " ".join(cmd.help.split()).startswith(cmd.short_help[:-1]), name
    text = _invoke("--help").output
    assert all(panel in text for panel in PANELS) and text.index(" run ") < text.index(" demo ")


@pytest.mark.parametrize("text, line", [
    ("Joint LoRA + kernel adaptation (App. F.2) of one arm, then its test perplexity; metrics.json ...",
     "Joint LoRA + kernel adaptation (App. F.2) of one arm, then its test perplexity."),
    ("Find dims (paper Sec. 3, 4.2, App. A, B).", "Find dims (paper Sec. 3, 4.2, App. A, B)."),
    ("Write the model (weights,\n    card). The family's class", "Write the model (weights, card)."),
])
def test_short_help_is_the_first_sentence_outside_parentheses(text, line):
    assert short_help(text) == line


def _options(cmd) -> list:
    # by kind, not class: typer 0.29 vendors click, so its options are no `click.Option` (that check saw none)
    options = [p for p in cmd.params if p.param_type_name == "option"]
    assert options, cmd.name
    return options


def test_every_option_has_help_and_long_commands_take_no_progress():
    _, _, commands = _commands()
    for name, cmd in commands.items():
        assert cmd.help, name
        for p in _options(cmd):
            if p.name != "help":
                assert p.help, f"{name} {p.opts}"
    for name in ("run", "adapt", "calibrate", "select-layers", "analyze", "evaluate"):
        assert "--no-progress" in [o for p in commands[name].params for o in p.secondary_opts], name


def test_no_option_states_its_default_twice():
    """`oal calibrate --help` printed '--window ... (default: 64). [default: 64]'."""
    _, _, commands = _commands()
    for name, cmd in commands.items():
        for p in _options(cmd):
            if "(default:" in (p.help or ""):
                assert not p.show_default or p.default is None, f"{name} {p.opts}"


@pytest.fixture
def pipeline_call(monkeypatch):
    """What `oal run` hands the pipeline, the pipeline itself not run."""
    import oal.pipeline.runs

    seen = {}
    monkeypatch.setattr(oal.pipeline.runs, "run", lambda cfg, out, seeds, **kw: seen.update(kw))
    return seen


@pytest.mark.parametrize("root, progress, quiet", [
    ([], True, False), (["--no-progress"], False, False), (["--quiet"], False, True), (["-q"], False, True)])
def test_quiet_and_no_progress_reach_the_command(tmp_path, pipeline_call, root, progress, quiet):
    """`oal --quiet run` printed every stage rule, skip line and progress bar; there was no global --no-progress."""
    res = _invoke(*root, "run", "--out", tmp_path / "r")
    assert res.exit_code == 0, res.output
    assert pipeline_call["progress"] is progress and pipeline_call["console"].quiet is quiet


def test_a_command_progress_flag_wins_over_the_root_one(tmp_path, pipeline_call):
    assert _invoke("--no-progress", "run", "--out", tmp_path / "r", "--progress").exit_code == 0
    assert pipeline_call["progress"] is True


@pytest.mark.parametrize("exc, options, line", [
    (ValueError("methods: unknown"), ["--methods"], "methods: unknown"),  # docs/reliability/errors.md shows it so
    (typer.BadParameter("grouping: expected 'app-b'", param_hint="--grouping"), ["--grouping"],
     "Invalid value for --grouping: expected 'app-b'"),
])
def test_library_errors_name_the_option_typed(exc, options, line):
    assert bad_input_message(exc, options) == line


def test_an_error_names_the_plural_option_the_command_has():
    from oal.errors import InputError

    exc = InputError("the run did not calibrate 'foo'", "--method")
    assert bad_input_message(exc, ["--methods", "--out"]) == "Invalid value for '--methods': the run did not " \
                                                              "calibrate 'foo'"
    assert bad_input_message(exc, ["--method"]).startswith("Invalid value for '--method':")


def test_long_commands_group_their_options():
    """`oal run --help` was one panel of 30 options."""
    _, _, commands = _commands()
    panel = {p.name: p.rich_help_panel for p in commands["run"].params}
    assert panel["steps"].startswith("Adaptation") and panel["passkey"] == "Passkey retrieval"
    assert panel["tasks"].startswith("Zero-shot") and panel["device"] == "Device and runtime" and panel["out"] is None
    assert {p.rich_help_panel for p in commands["analyze"].params} == {None}  # its --batch-size is not adaptation's


def test_a_progress_bar_in_a_log_file_writes_a_line_while_it_moves(monkeypatch):
    """In a log file a 30-minute adaptation showed only its final line: a tail of the log could not tell a moving
    stage from a hung one. A bar now writes its line every LOG_EVERY_S seconds while it moves (not once more at its
    end, where it leaves its last line anyway)."""
    import io

    from rich.console import Console

    from oal import launch

    now = [0.0]  # the bar's clock, moved 40 s before each step
    monkeypatch.setattr(launch, "LOG_EVERY_S", 60.0)
    log = io.StringIO()
    with launch.progress_bar(console=Console(file=log, width=120)) as bar:
        bar.get_time = lambda: now[0]
        bar.logged_at = 0.0
        task = bar.add_task("adapt oal", total=4)
        for _ in range(4):
            now[0] += 40
            bar.advance(task)
    lines = [line for line in log.getvalue().splitlines() if "adapt oal" in line]
    assert len(lines) >= 2 and "4/4" in lines[-1] and "4/4" not in lines[0]
    assert sum("4/4" in line for line in lines) == 1


def test_adapt_says_its_dtype_defaults_to_the_runs():
    _, _, commands = _commands()
    (dtype,) = [p for p in commands["adapt"].params if p.name == "dtype"]
    assert "the run's own" in dtype.help


def test_a_progress_bar_in_a_log_file_leaves_its_last_line():
    """Where stderr is a file (a cluster's log) rich draws nothing while a bar runs, and a transient bar left
    nothing either: a 10-minute passkey evaluation logged no trace of itself. On a terminal it stays transient."""
    import io

    from rich.console import Console

    from oal.launch import progress_bar

    log = io.StringIO()
    with progress_bar(console=Console(file=log, width=120)) as bar:  # not a terminal
        task = bar.add_task("passkey oal", total=4)
        for _ in range(4):
            bar.advance(task)
    assert "passkey oal" in log.getvalue() and "100% 4/4" in log.getvalue()
    tty = io.StringIO()
    with progress_bar(console=Console(file=tty, width=120, force_terminal=True)) as bar:
        bar.advance(bar.add_task("passkey oal", total=1))
    assert bar.live.transient
    with progress_bar(False, console=Console(file=io.StringIO())) as bar:
        assert bar.disable
