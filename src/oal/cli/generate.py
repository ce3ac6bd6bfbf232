"""`oal generate`: greedy generation with a converted model (O(1) recurrent state in converted layers)."""

from __future__ import annotations

from pathlib import Path

import typer

from ._common import AdapterOpt, BaseModelOpt, DeviceOpt, converted_or_fail
from .app import app


@app.command("generate")
def generate_cmd(
    prompt: str = typer.Argument(..., help="Prompt text."),
    out: Path = typer.Option(..., "--out", help="Run directory with calibrated kernels."),
    model: BaseModelOpt = None,
    method: str = typer.Option("oal", help="Which calibrated kernels to use."),
    max_new_tokens: int = typer.Option(64, help="Tokens to generate."),
    adapter: AdapterOpt = None,
    device: DeviceOpt = "cpu",
) -> None:
    """Greedy generation with the converted model (recurrent O(1) state in converted layers), adapted when the run
    has an adapter for the method."""
    import torch

    if max_new_tokens < 1:
        raise typer.BadParameter("expected >= 1", param_hint="--max-new-tokens")
    mdl, tok, _ = converted_or_fail(out, model, method, device, adapter)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    if enc["input_ids"].shape[1] == 0:
        raise typer.BadParameter("the prompt encodes to no tokens", param_hint="PROMPT")
    with torch.no_grad():
        seq = mdl.generate(**{k: v.to(device) for k, v in enc.items()}, max_new_tokens=max_new_tokens,
                           do_sample=False, use_cache=True, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    typer.echo(prompt + tok.decode(seq[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
