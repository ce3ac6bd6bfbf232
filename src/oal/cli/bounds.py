"""Bounds of the commands' numeric options, and lists of numbers given as one option."""

from __future__ import annotations

import os

import typer


class Max:
    """Upper bounds of the numeric options: far above any real use, low enough that a typo is refused at once (with
    typer's one-line error) rather than found later as a crash (`--threads 100000` segfaults OpenMP) or an
    allocation of terabytes."""

    THREADS = 4 * (os.cpu_count() or 1)  # more torch threads than that only wait on each other
    SEED = 2**32 - 1  # numpy's seeds
    STEPS, TOKENS, WINDOW = 10**7, 2**20, 2**20  # updates (intervals, patience); sequence lengths, new tokens
    COUNT, TRIALS, REPEATS, BATCH = 10**6, 10**4, 1000, 4096  # examples, sequences, blocks, bootstrap draws: COUNT
    HEADS, DIM, LAYERS = 1024, 1024, 4096  # DIM: head dims and group counts


def positive_examples(value: int | None) -> int | None:
    """--limit's callback: `oal evaluate --zeroshot --limit 0` said 'limit: ...', the library's argument, where `oal
    run` names --limit (RunConfig's check, in the same words)."""
    if value is not None and value < 1:
        raise typer.BadParameter(f"expected a positive number of examples, got {value}")
    return value


def parse_numbers(text: str | None, kind, option: str, low: float, high: float) -> list | None:
    """A comma-separated list of `kind` (int or float) in [low, high], or None for None; typer's error on `option`."""
    if text is None:
        return None
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(low <= v <= high for v in values):
        raise typer.BadParameter(f"expected comma-separated numbers in [{low}, {high}], got {text!r}",
                                 param_hint=option)
    return values
