"""The typer application shared by every command module, and the options every command has.

Errors: bad input anywhere below a command (a `ValueError`, such as the library's `InputError`, an `OSError`, a
model that cannot be fetched, or a click usage error) is printed as one line, `Error: ...`, naming the argument or
file, with exit code 2 and no traceback; `oal --debug COMMAND ...` shows the traceback instead. Ctrl-C prints one
line too (exit code 130).
"""

import logging

import typer
from typer.core import TyperGroup

from oal.cli.consoles import INTERRUPTED, QUIET, setup_logging
from oal.cli.docs import PANELS, arrange, docs_line
from oal.cli.failures import bad_input_message, drop_stdout

_STATE = {"debug": False}


class _Group(TyperGroup):
    """Runs a command; turns the errors of bad input into one line and exit code 2 (unless --debug)."""

    def get_command(self, ctx, name):  # help ends with the page that explains the command (`oal.cli.docs`)
        if (command := super().get_command(ctx, name)) is not None:
            arrange(name, command)  # its panel and one line in `oal --help`, its options' panels
        return command

    def list_commands(self, ctx):  # the panels' order, then any command they do not name
        order = [n for names in PANELS.values() for n in names]
        return sorted(super().list_commands(ctx), key=lambda n: order.index(n) if n in order else len(order))

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except KeyboardInterrupt:  # Ctrl-C: one line (typer would exit 130 in silence, a progress bar last)
            from oal.errors import InputError
            from oal.launch import reports_error

            # it reaches every process of a launch alike, as bad input does: printed where bad input would be
            if reports_error(InputError(INTERRUPTED)):
                typer.echo(INTERRUPTED, err=True)
            raise typer.Exit(130) from None
        except BrokenPipeError:  # whoever read stdout has gone (`oal fetch NAME | head -0`): nothing to report
            drop_stdout()
            raise typer.Exit(1) from None
        except Exception as exc:
            sub = super().get_command(ctx, ctx.invoked_subcommand or "")
            options = [o for p in (sub.params if sub else ()) for o in p.opts]
            message = None if _STATE["debug"] else bad_input_message(exc, options)
            if message is None:
                raise
            code = getattr(exc, "exit_code", 2) if isinstance(exc, typer.TyperException) else 2
            from oal.launch import env_rank, reports_error

            if reports_error(exc):  # the main process's error reaches every process of a launch; it says it
                rank = f"(process {env_rank()}) " if env_rank() else ""
                typer.echo(f"Error: {rank}{' '.join(str(message).split())}", err=True)
            raise typer.Exit(code) from None


app = typer.Typer(
    name="oal",
    cls=_Group,
    help="Outlier-Aware Attention Linearization: convert a causal LM's softmax attention into a positive "
    "grouped quadratic kernel that runs in linear time.",
    no_args_is_help=True,
    epilog=docs_line(""),
    add_completion=True,  # --install-completion / --show-completion (bash, zsh, fish, PowerShell)
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        from oal import __version__

        typer.echo(f"oal {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    ctx: typer.Context,
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only warnings and errors."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug messages and transformers' own warnings "
                                 "too."),
    debug: bool = typer.Option(False, "--debug", help="On an error, show the full traceback (default: one line)."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bars in any command (--quiet "
                                     "implies it; a command's own --progress turns them back on)."),
) -> None:
    """Outlier-Aware Attention Linearization (OAL)."""
    _STATE["debug"], QUIET["on"] = debug, quiet
    if quiet and verbose:
        raise typer.BadParameter("choose one of --quiet and --verbose", param_hint="--quiet")
    if quiet or no_progress:  # every command's --progress defaults to off (click's default_map)
        ctx.default_map = {name: {"progress": False} for name in ctx.command.list_commands(ctx)}
    from oal.launch import show_progress

    show_progress(not (quiet or no_progress))  # and the bars of a command without --progress (diagnose)
    ctx.call_on_close(lambda: show_progress(True))
    setup_logging(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
