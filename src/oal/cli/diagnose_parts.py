"""`oal diagnose`'s options that only some parts read (or only outside a run directory): refused where nothing would
read them, as `oal evaluate`'s modes are (`--steps 50 --parts table2` calibrated Table 2 with its own budget, in
silence); and `--head`'s reading."""

from __future__ import annotations

import typer

from oal.cli.modes import refuse_unless

# option (parameter name) -> the parts that read it
READERS = {"controls": ("table1",), "sequences": ("table1", "offset"), "paper": ("table1", "budget", "table2"),
           "head": ("budget",), "max_budget": ("budget",), "methods": ("table2",), "layer": ("offset",),
           "offsets": ("offset",), "steps": ("offset",)}


def refuse_unread(ctx: typer.Context, parts: list[str], run_dir: bool) -> None:
    """typer's one-line error for the first option given that none of `parts` reads; --data / --data-dir on an `oal
    run` directory, whose own corpus and split plan are read."""
    for name, readers in READERS.items():
        refuse_unless(ctx, bool(set(readers) & set(parts)), (name,), f"--parts {' or '.join(readers)}")
    refuse_unless(ctx, not run_dir, ("data", "data_dir"), "an --out that is not an `oal run` directory (this one's "
                  "own corpus and split plan are read)")


def budget_head(head: str | None, layers: list[int], n_heads: int, default: tuple[int, int]) -> tuple[int, int]:
    """Fig. 2(b)'s head from --head 'LAYER:HEAD' (LAYER among `layers`), else `default`."""
    if not head:
        return default
    try:
        layer, index = (int(x) for x in head.split(":"))
        assert layer in layers and 0 <= index < n_heads
    except (ValueError, AssertionError):
        raise typer.BadParameter(f"expected 'LAYER:HEAD' with LAYER in {layers} and HEAD in [0, {n_heads}), got "
                                 f"{head!r}", param_hint="--head") from None
    return layer, index
