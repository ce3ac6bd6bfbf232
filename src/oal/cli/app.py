"""The typer application shared by every command module, and the options every command has."""

import logging

import typer

app = typer.Typer(
    name="oal",
    help="Outlier-Aware Attention Linearization: convert a causal LM's softmax attention into a positive "
    "grouped quadratic kernel that runs in linear time.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"oal {__version__}")
        raise typer.Exit()


def setup_logging(level: int) -> None:
    """`oal` messages through a rich handler on stderr; transformers' own progress bars and advice kept quiet."""
    from rich.logging import RichHandler

    log = logging.getLogger("oal")
    log.handlers[:] = [RichHandler(show_path=False, show_time=False, markup=False)]
    log.setLevel(level)
    log.propagate = False
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Only warnings and errors."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Debug messages too."),
) -> None:
    """Outlier-Aware Attention Linearization (OAL)."""
    if quiet and verbose:
        raise typer.BadParameter("choose one of --quiet and --verbose", param_hint="--quiet")
    setup_logging(logging.WARNING if quiet else logging.DEBUG if verbose else logging.INFO)
