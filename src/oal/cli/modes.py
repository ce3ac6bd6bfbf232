"""`oal evaluate`'s three modes (fidelity; --zeroshot; --passkey): an option of another mode than the one asked for
is refused, not silently ignored."""

from __future__ import annotations

import typer

# the options (parameter names) of each mode only; fidelity is the mode without --zeroshot or --passkey
MODE_OPTIONS = {"fidelity": ("data", "data_dir", "preset", "blocks_limit"),
                "zeroshot": ("tasks", "task_file", "zeroshot_dir", "limit", "log_samples"),
                "passkey": ("lengths", "depths", "trials")}


def refuse_other_modes(ctx: typer.Context, mode: str) -> None:
    """typer's one-line error for the first option of another mode than `mode` given on the command line."""
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    for other, names in MODE_OPTIONS.items():
        # typer vendors click: compare the source by name, not with click's own enum
        given = [flags[n] for n in names
                 if other != mode and getattr(ctx.get_parameter_source(n), "name", None) == "COMMANDLINE"]
        if given:
            needs = {"fidelity": "fidelity (neither --zeroshot nor --passkey)"}.get(other, f"--{other}")
            raise typer.BadParameter(f"applies to {needs} only", param_hint=given[0])
