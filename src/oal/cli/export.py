"""`oal export`: a run's converted model, with its adapter, as one folder that transformers and oal.load reload."""

from __future__ import annotations

from pathlib import Path

import typer

from oal.cli.app import app
from oal.cli.options import AdapterOpt, BaseModelOpt
from oal.errors import InputError, message_of


def export_or_fail(out: Path, method: str, to: Path, **kwargs) -> Path:
    """`oal.pipeline.publish.export_run` (the card quotes verified numbers only); bad input becomes a clean error on
    the option it concerns."""
    from oal.pipeline.publish import export_run

    try:
        path = export_run(out, method, to, **kwargs)
    except ValueError as exc:
        if isinstance(exc, InputError) and exc.param:  # it names its option: the CLI's one line names it too
            raise
        given = {"base_model": "--model"} if kwargs.get("model") else {}  # the base model --model named
        hint = {"to": "--to", "merge": "--no-merge", **given}.get(str(exc).partition(":")[0], "--out")
        raise typer.BadParameter(message_of(exc), param_hint=hint) from None  # the option named once
    auto = "AutoModel" if _is_encoder(path) else "AutoModelForCausalLM"
    if method == "softmax":
        typer.echo(f"wrote {path}: reload it with {auto}.from_pretrained('{path}')")
    else:
        typer.echo(f"wrote {path}: reload it with oal.load('{path}'), or with {auto}.from_pretrained('{path}') "
                   "after `import oal`")
    return path


def _is_encoder(folder: Path) -> bool:
    from oal.models.families import is_encoder_type
    from oal.rundir.files import load_json

    return is_encoder_type(load_json(folder / "config.json").get("model_type", ""))


@app.command("export")
def export_cmd(
    out: Path = typer.Option(..., "--out", help="Run directory (`oal run`)."),
    method: str = typer.Option("oal", help="Which arm: a converted one (oal, global, performer, ...) or softmax (the "
                               "reference, its adapter merged: a plain transformers folder)."),
    to: Path = typer.Option(..., "--to", help="Folder to write (created; an earlier export there is replaced)."),
    adapter: AdapterOpt = None,
    merge: bool = typer.Option(True, "--merge/--no-merge", help="Merge LoRA into the base weights (--no-merge: keep "
                               "it separate in the folder, adapter_model.safetensors; oal's class attaches it on "
                               "load)."),
    model: BaseModelOpt = None,
    dtype: str = typer.Option(None, help="dtype of the written base weights: float32, float16 or bfloat16 "
                              "(default: the run's). Kernels keep their own (float32)."),
) -> None:
    """Write the converted model (base weights, conversion, kernels, adapter, tokenizer, SHA256 manifest, model
    card). The family's own class and peft's loaders refuse the folder rather than give a softmax model."""
    import torch

    if dtype is not None and dtype not in ("float32", "float16", "bfloat16"):
        raise typer.BadParameter(f"expected float32, float16 or bfloat16, got {dtype!r}", param_hint="--dtype")
    export_or_fail(out, method, to, adapter=adapter, merge=merge, model=model,
                   dtype=getattr(torch, dtype) if dtype else None)
