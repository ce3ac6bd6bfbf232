"""`oal evaluate`'s three modes (fidelity; --zeroshot; --passkey): an option of another mode than the one asked for
is refused, not silently ignored; `refuse_unless` does the same for any option that applies only with another;
`decoder_run` refuses an encoder's run, whose measures `oal run` took."""

from __future__ import annotations

from pathlib import Path

import typer

# `oal run`'s options that only a causal LM's run reads: given for an encoder, they would be ignored
DECODER_ONLY = ("steps", "val_every", "batch_size", "grad_accum", "lora_dropout", "window", "sinks", "tasks",
                "limit", "zeroshot_dir", "task_file", "passkey", "passkey_depths", "passkey_trials")

# the options (parameter names) of each mode only; fidelity is the mode without --zeroshot or --passkey
MODE_OPTIONS = {"fidelity": ("data", "data_dir", "preset", "blocks_limit"),
                "zeroshot": ("tasks", "task_file", "zeroshot_dir", "limit", "log_samples"),
                "passkey": ("lengths", "depths", "trials")}


def refuse_other_modes(ctx: typer.Context, mode: str) -> None:
    """typer's one-line error for the first option of another mode than `mode` given on the command line."""
    for other, names in MODE_OPTIONS.items():
        needs = {"fidelity": "fidelity (neither --zeroshot nor --passkey)"}.get(other, f"--{other}")
        refuse_unless(ctx, other == mode, names, needs)


def refuse_run_options(ctx: typer.Context, *, layers: str | None, passkey: str | None, methods: str,
                       tasks: str) -> None:
    """`oal run`'s options that apply only with another, refused where given without it (a value equal to the
    default included: it would be recorded, yet change nothing)."""
    from oal.methods import get_method, method_names
    from oal.pipeline.config import parse_methods

    refuse_unless(ctx, passkey is not None, ("passkey_depths", "passkey_trials"), "--passkey")
    refuse_unless(ctx, (layers or "").strip().lower().startswith("auto"), ("select_by",), "--layers auto:K")
    try:
        names = parse_methods(methods)
    except ValueError:
        return  # RunConfig names the bad --methods
    given = _given(ctx, ("window", "sinks"))
    if given and not any(get_method(m).settings for m in names if m in method_names()):  # as RunConfig words it
        raise typer.BadParameter("applies to the sliding-window methods (swa, oal-swa, global-swa) only, and methods "
                                 f"{','.join(names)} have none", param_hint=given[0])
    refuse_unless(ctx, tasks.strip().lower() != "none", ("limit", "zeroshot_dir", "task_file"),
                  "zero-shot tasks (--tasks other than none)")


def refuse_unless(ctx: typer.Context, applies: bool, names: tuple[str, ...], needs: str) -> None:
    """typer's one-line error for the first option of `names` given on the command line where it does not apply
    (`applies` False): it would be ignored."""
    given = _given(ctx, names)
    if given and not applies:
        raise typer.BadParameter(f"applies only to {needs}", param_hint=given[0])


def _given(ctx: typer.Context, names: tuple[str, ...]) -> list[str]:
    """The flags of `names` given on the command line."""
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    # typer vendors click: compare the source by name, not with click's own enum
    return [flags[n] for n in names if getattr(ctx.get_parameter_source(n), "name", None) == "COMMANDLINE"]


def decoder_run(out: Path) -> Path:
    """--out's callback: a causal LM's run (an encoder's held-out blocks, perplexity, passkey and zero-shot tasks
    do not exist; its plan read as a decoder's failed on --data)."""
    from oal.errors import InputError
    from oal.pipeline.inputs import causal_lm_run

    try:
        causal_lm_run(out, f"`oal evaluate` measures causal LMs, and `oal run --out {out}` measured this encoder "
                           "(fidelity, embedding agreement: report.md)")
    except InputError as exc:
        raise typer.BadParameter(exc.message) from None
    return out
