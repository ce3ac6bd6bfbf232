"""The typer application shared by every command module."""

import typer

app = typer.Typer(
    name="oal",
    help="Outlier-Aware Attention Linearization: convert a causal LM's softmax attention into a positive "
    "grouped quadratic kernel that runs in linear time.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _root() -> None:
    """Outlier-Aware Attention Linearization (OAL)."""
