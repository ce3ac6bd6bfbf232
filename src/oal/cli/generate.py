"""`oal generate`: greedy generation with a converted model (O(1) recurrent state in converted layers)."""

from __future__ import annotations

from pathlib import Path

import typer

from oal.cli.app import app
from oal.cli.options import AdapterOpt, BaseModelOpt, DeviceOpt, Max, RunDtypeOpt
from oal.pipeline.inputs import causal_lm_run, converted_or_fail, one_seed_run


@app.command("generate")
def generate_cmd(
    prompt: str = typer.Argument(..., help="Prompt text (UTF-8)."),
    out: Path = typer.Option(..., "--out", help="Run directory with calibrated kernels."),
    model: BaseModelOpt = None,
    method: str = typer.Option("oal", help="Which arm: a calibrated method, or softmax (the run's base model with "
                               "its adapter, to compare against)."),
    max_new_tokens: int = typer.Option(64, min=1, max=Max.TOKENS, help="Tokens to generate."),
    chat: bool = typer.Option(False, "--chat", help="Send the prompt as one user message through the tokenizer's "
                              "chat template and print the reply alone (an instruct model may end a bare "
                              "question at once)."),
    adapter: AdapterOpt = None,
    device: DeviceOpt = "auto",
    dtype: RunDtypeOpt = None,
) -> None:
    """Greedy generation with the converted model (recurrent O(1) state in converted layers), adapted when the run
    has an adapter for the method; `--method softmax` generates with the run's softmax arm. The prompt plus
    --max-new-tokens must fit the model's maximum positions (max_position_embeddings): a longer request is refused,
    not truncated, so the model never runs on positions it was not trained for.
    """
    import torch

    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise typer.BadParameter(f"not valid UTF-8 text ({exc.reason} at character {exc.start})",
                                 param_hint="PROMPT") from None
    if not prompt:  # refused before the model loads
        raise typer.BadParameter("the prompt is empty", param_hint="PROMPT")
    one_seed_run(out)
    causal_lm_run(out, "`oal generate` continues text with a causal LM's next-token head, which an encoder has not")
    mdl, tok, _ = converted_or_fail(out, model, method, device, adapter, dtype, softmax=True)
    if chat and not getattr(tok, "chat_template", None):
        raise typer.BadParameter("the model's tokenizer has no chat template: give the text to continue without "
                                 "--chat", param_hint="--chat")
    enc = (tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                   return_dict=True, return_tensors="pt") if chat
           else tok(prompt, return_tensors="pt", add_special_tokens=False))
    n_prompt = enc["input_ids"].shape[1]
    if n_prompt == 0:
        raise typer.BadParameter("the prompt encodes to no tokens", param_hint="PROMPT")
    max_pos = getattr(mdl.config, "max_position_embeddings", None)
    if max_pos is not None and n_prompt + max_new_tokens > max_pos:
        raise typer.BadParameter(f"the prompt is {n_prompt} tokens; with --max-new-tokens {max_new_tokens} that "
                                 f"exceeds the model's {max_pos} positions (max_position_embeddings): shorten the "
                                 "prompt or lower --max-new-tokens",
                                 param_hint="--max-new-tokens" if max_new_tokens >= max_pos else "PROMPT")
    with torch.no_grad():
        seq = mdl.generate(**{k: v.to(mdl.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")},
                           max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                           pad_token_id=tok.pad_token_id or tok.eos_token_id)
    text = tok.decode(seq[0, n_prompt:], skip_special_tokens=True)
    if not text.strip():  # only the prompt came back: say why rather than look as if nothing ran
        templated = not chat and getattr(tok, "chat_template", None)
        hint = "; an instruct model answers a question with --chat" if templated else ""
        typer.echo(f"note: the model generated no text (only special tokens, such as its end token){hint}", err=True)
    typer.echo(text if chat else prompt + text)
