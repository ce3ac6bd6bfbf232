"""Passkey retrieval of a run directory's arms (`oal evaluate --passkey`, `oal run --passkey`), into its metrics.json.

Every arm is measured twice when it can be: before adaptation (calibrated kernels, no adapter) and after (the run's
LoRA adapter, merged). The softmax arm is the reference. Results go to metrics.json["passkey"][<method>] as
{"no_adapt": {...}, "adapted": {...}}: each variant is recorded with the SHA256 of the kernel and adapter files it
came from (`rundir.metrics.record_evaluation`) and metrics.json and report.md are rebuilt from the records that
verify (`pipeline.publish.republish`), under the directory's lock. Each (arm, variant) result is also kept in
DIR/.oal/passkey/ under a key made of the settings and those hashes, so a run killed part way resumes at the next arm
and a finished one is not measured again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from oal.errors import InputError
from oal.rundir.files import atomic_write_json
from oal.rundir.hashes import config_hash
from oal.rundir.lock import own_dir

__all__ = ["evaluate_passkey_run", "passkey_after_run", "passkey_rich_table"]

log = logging.getLogger("oal")


def evaluate_passkey_run(out_dir: str | Path, methods: Sequence[str], *, model: str | None = None,
                         lengths: Sequence[int] | None = None, depths: Sequence[float] | None = None,
                         trials: int = 4, seed: int = 0, adapter: bool | None = None, device: str = "cpu",
                         dtype=None, progress: bool = True, console=None) -> dict[str, dict]:
    """{method: {"no_adapt": result, "adapted": result}} (a variant is absent when it cannot be built: no adapter in
    the run, or `adapter` False/True asking for one of them only); `result` as `evaluate_passkey` returns it."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise InputError(f"no such run directory: {out_dir}", "--out", "out_dir")
    if not methods:
        raise InputError("expected at least one method", "--methods", "methods")
    if trials < 1:
        raise InputError(f"expected trials >= 1, got {trials}", "--trials", "trials")
    with own_dir(out_dir):
        res = _evaluate(out_dir, methods, model=model, lengths=lengths, depths=depths, trials=trials, seed=seed,
                        adapter=adapter, device=device, dtype=dtype, progress=progress, console=console)
    from oal.pipeline.runs import refresh_aggregate

    refresh_aggregate(out_dir, console)  # a seed of a multi-seed run: its aggregate takes the new numbers
    return res


def _evaluate(out_dir: Path, methods, *, model, lengths, depths, trials, seed, adapter, device, dtype, progress,
              console) -> dict[str, dict]:
    from oal.artefact.arms import adapter_dir, arm_inputs, calibrated_methods, load_arm
    from oal.evaluate.passkey import DECODING_VERSION, DEPTHS, answer_tokens, default_lengths, evaluate_passkey
    from oal.pipeline.publish import check_publishable, republish
    from oal.rundir.metrics import record_evaluation

    check_publishable(out_dir)
    cache = out_dir / ".oal" / "passkey"
    # the requested settings (lengths None: the model's default lengths) make each arm's cache key with its files
    settings = {"lengths": sorted(set(lengths)) if lengths else None, "depths": sorted(set(depths or DEPTHS)),
                "trials": trials, "seed": seed, "decoding": DECODING_VERSION}
    # every method is checked before the first is measured: a typo in the last one fails now, not an arm later
    calibrated, plan = calibrated_methods(out_dir), {}
    for m in methods:
        if m != "softmax" and m not in calibrated:
            raise InputError(f"the run did not calibrate {m!r} (calibrated: {', '.join(calibrated) or 'none'})",
                             "--methods", "methods")
        has_adapter = (adapter_dir(out_dir, m) / "oal_adapter.json").is_file()
        if adapter and not has_adapter:
            raise InputError(f"{adapter_dir(out_dir, m)}: the run has no adapter for {m!r}", "--adapter", "adapter")
        plan[m] = [v for v, on in (("no_adapt", adapter is not True), ("adapted", adapter is not False and
                                                                       has_adapter)) if on]
    results: dict[str, dict] = {}
    for m, variants in plan.items():
        for variant in variants:
            adapted = variant == "adapted"
            used = arm_inputs(out_dir, m, adapter_dir(out_dir, m) if adapted else None)
            # checked before the arm is loaded, so a resumed evaluation does not load the arms it already measured
            key = config_hash({**settings, "inputs": used, "device": str(device), "dtype": str(dtype)})
            path = cache / f"{m}_{variant}.json"
            cached = _cached(path)
            if cached.get("key") == key and isinstance(cached.get("result"), dict):
                log.info("passkey %s (%s): already measured for these settings and files", m, variant)
                res = cached["result"]
            else:
                arm, tok, _ = load_arm(out_dir, m, adapted, model=model, dtype=dtype, device=device)
                max_pos = getattr(arm.config, "max_position_embeddings", None)
                lens = settings["lengths"] or default_lengths(max_pos, reserve=answer_tokens(tok))
                res = evaluate_passkey(arm, tok, lengths=lens, depths=settings["depths"], trials=trials, seed=seed,
                                       progress=progress, description=f"passkey:{m} ({variant})")
                atomic_write_json(path, {"key": key, "result": res})
            results.setdefault(m, {})[variant] = res
            record_evaluation(out_dir, f"passkey:{m}:{variant}", [(("passkey", m, variant), res)], used,
                              versions={"passkey_decoding": DECODING_VERSION})
    if results:
        republish(out_dir, console)
    return results


def _cached(path: Path) -> dict:
    """The result kept for one arm's variant ({} when none); a damaged file is measured again, with a warning."""
    from oal.models.pretrained import read_json_object

    if not path.is_file():
        return {}
    try:
        return read_json_object(path, "a passkey result kept by `oal evaluate --passkey`")
    except ValueError as exc:
        log.warning("%s; measuring it again", exc)
        return {}


def passkey_check(lengths: Sequence[int], depths: Sequence[float] | None = None, trials: int = 4):
    """What `oal run --passkey` checks once the run's model is loaded and before any stage (`run(check=...)`):
    every prompt fits its length and the model's positions, so a bad length fails now, not after the run."""
    from oal.evaluate.passkey import DEPTHS, check_settings

    def check(r) -> None:
        try:
            check_settings(r.model, r.tokenizer, lengths=lengths, depths=depths or DEPTHS, trials=trials)
        except InputError as exc:  # the option of `oal evaluate` it names is --passkey here
            raise InputError(exc.message, "--passkey", "passkey") from None

    return check


def passkey_after_run(out_dir: str | Path, methods: Sequence[str], *, lengths: Sequence[int],
                      depths: Sequence[float] | None = None, trials: int = 4, device: str = "cpu",
                      console=None) -> dict[str, dict]:
    """`oal run --passkey`: passkey retrieval of every arm of a finished run, into its metrics.json and report.md:
    the adapted arms where the run adapted every one of them (what the run's perplexity is quoted for), else each
    arm before adaptation and, where it has an adapter, after."""
    from oal.artefact.arms import adapter_dir

    out_dir = Path(out_dir)
    adapted = all((adapter_dir(out_dir, m) / "oal_adapter.json").is_file() for m in methods)
    return evaluate_passkey_run(out_dir, methods, lengths=lengths, depths=depths, trials=trials,
                                adapter=True if adapted else None, device=device, console=console)


def passkey_rich_table(res: dict) -> Table:
    """`evaluate_passkey_run`'s result for the terminal (the report's table, as rich)."""
    from oal.evaluate.passkey import passkey_table

    _, header, rows = passkey_table(res)
    table = Table(title="passkey retrieval accuracy by context length (greedy, exact match)")
    for col in header:
        table.add_column(col, justify="right")
    for row in rows:
        table.add_row(*row)
    return table
