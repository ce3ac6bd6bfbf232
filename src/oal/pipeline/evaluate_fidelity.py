"""Frozen-attention fidelity of a run directory's calibrated kernels, into its metrics.json (`oal evaluate`).

The base model is the one the kernels record (or the one named), checked against that record by the SHA256 of its
tensors and files: kernels are never evaluated on another model. In an `oal run` directory the data and split plan
default to the run's own; each method's entry records the data and the number of blocks it was measured on. Each
measurement is recorded with the SHA256 of the files it was made on (`rundir.metrics.record_evaluation`), then
metrics.json and report.md are rebuilt from the records that verify (`pipeline.publish.republish`), all under the
directory's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from rich.table import Table

from oal.errors import InputError, message_of
from oal.pipeline.records import run_config
from oal.rundir.lock import own_dir

__all__ = ["evaluate_fidelity"]

log = logging.getLogger("oal")


def evaluate_fidelity(out_dir: str | Path, methods: Sequence[str] | None = None, *, model: str | None = None,
                      data: str | None = None, data_dir: str | None = None, preset: str | None = None,
                      blocks: int | None = None, adapter: bool | None = False, device: str = "cpu",
                      dtype: str | None = None, progress: bool = True, console=None) -> dict:
    """Fidelity (Table 2 metrics) of `methods`' kernels in `out_dir` on the held-out fidelity blocks (the first
    `blocks` of them; more than there are: all of them, with a warning), into `out_dir`/metrics.json; returns
    {"fidelity": {method: metrics}, "fidelity_adapted": {method: metrics}}.

    `adapter` as in `artefact.arms.load_converted` (None: the run's adapter for a method when it has one). Without an
    adapter the calibrated kernels are compared with the base model's softmax attention (Table 2) under "fidelity";
    with one, the trained kernels with the softmax attention of the same LoRA-merged weights under
    "fidelity_adapted". The base model is loaded in `dtype` (default: the run's own).
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise InputError(f"{out_dir} is not a directory with calibrated kernels", "--out", "out_dir")
    if blocks is not None and (not isinstance(blocks, int) or blocks < 1):
        raise InputError(f"expected a number of blocks >= 1, got {blocks!r}", "--blocks", "blocks")
    with own_dir(out_dir):
        res = _evaluate(out_dir, methods, model=model, data=data, data_dir=data_dir, preset=preset, blocks=blocks,
                        adapter=adapter, device=device, dtype=dtype, progress=progress, console=console)
    from oal.pipeline.runs import refresh_aggregate

    refresh_aggregate(out_dir, console)  # a seed of a multi-seed run: its aggregate takes the new numbers
    return res


def _evaluate(out_dir: Path, methods, *, model, data, data_dir, preset, blocks, adapter, device, dtype, progress,
              console) -> dict:
    from oal.artefact.arms import arm_inputs, load_converted
    from oal.artefact.export import softmax_twin
    from oal.data import SplitPlan, default_plan, load_corpus, plan_blocks
    from oal.data.splits import PLAN_PRESETS
    from oal.device import resolve_dtype
    from oal.evaluate.fidelity import fidelity
    from oal.models.attention import converted_methods
    from oal.models.provenance import model_dtype
    from oal.models.registry import preset_for
    from oal.pipeline.publish import check_publishable, republish
    from oal.rundir.metrics import record_evaluation

    if preset is not None and preset not in PLAN_PRESETS:  # before any model is loaded
        raise InputError(f"expected one of {', '.join(sorted(PLAN_PRESETS))}, got {preset!r}", "--preset", "preset")
    check_publishable(out_dir)
    run = run_config(out_dir) if (out_dir / "config.json").is_file() else None
    recorded = (run or {}).get("config") or {}
    if methods is None:
        methods = [m for m in recorded.get("methods", ["oal", "global"]) if m != "softmax"]
    methods = list(methods)
    if not methods:
        raise InputError("expected at least one calibrated method", "--methods", "methods")
    # none recorded (a directory made stage by stage): the dtype its kernels record (`load_converted`), not float32
    dtype = resolve_dtype(dtype or recorded["dtype"]) if dtype or recorded.get("dtype") else None
    data = data or recorded.get("data") or "builtin"
    data_dir = data_dir or recorded.get("data_dir")
    res: dict[str, dict] = {"fidelity": {}, "fidelity_adapted": {}}
    base, held_out, name, corpus, layers = None, None, None, None, None
    for m in methods:
        # the kernels (and adapter) on their recorded base model, checked against it by tensors and files
        converted, tok, info = load_converted(out_dir, m, adapter, model=model, dtype=dtype, device=device)
        if held_out is None:
            name = info["base_model"]
            try:
                corpus = load_corpus(data, data_dir=data_dir)
                if preset is None and run is not None and data == recorded.get("data"):
                    plan = SplitPlan.from_dict(run["split_plan"])  # the run's own held-out blocks
                else:
                    plan = default_plan(preset or preset_for(converted))
                held_out = plan_blocks(corpus, tok, plan, data_dir=data_dir)["fidelity"]
            except (ValueError, OSError) as exc:
                raise InputError(message_of(exc, data), "--data", "data") from exc
            if blocks and blocks > held_out.shape[0]:
                log.warning("--blocks %d: the split plan has only %d fidelity blocks; using all %d", blocks,
                            held_out.shape[0], held_out.shape[0])
            held_out = (held_out[:blocks] if blocks else held_out).to(device)
        key = "fidelity_adapted" if info["adapter"] else "fidelity"
        if info["adapter"]:
            teacher = softmax_twin(converted, name, device=device)  # the same LoRA-merged weights, softmax attention
        else:
            base = base if base is not None else softmax_twin(converted, name, device=device)
            teacher = base
        res[key].update(fidelity(teacher, held_out, {m: converted_methods(converted)}, progress=progress))
        layers = layers or sorted(converted_methods(converted))
        # the base model's dtype it was measured in: `--dtype` may differ from the run's (a wider one casts it)
        res[key][m].update({"data": corpus.name, "n_blocks": int(held_out.shape[0]),
                            "block_len": int(held_out.shape[1]), "dtype": model_dtype(converted)})
        record_evaluation(out_dir, f"{key}:{m}", [((key, m), res[key][m])], arm_inputs(out_dir, m, info["adapter"]),
                          defaults={"model": name, "converted_layers": layers})
    republish(out_dir, console)
    return res


def fidelity_table(res: dict) -> Table:
    """`evaluate_fidelity`'s result for the terminal: calibrated and adapted rows per method."""
    table = Table(title="frozen-attention fidelity on the held-out blocks")
    for col in ("method", "kernels", "blocks", "MSE", "RelMSE", "MSE post-o", "RelMSE post-o"):
        table.add_column(col, justify="right")
    for key, kind in (("fidelity", "calibrated"), ("fidelity_adapted", "adapted")):
        for m, r in res[key].items():
            table.add_row(m, kind, f"{r['n_blocks']} x {r['block_len']}",
                          *(f"{r[k]:.4g}" for k in ("mse", "relmse", "mse_post_o", "relmse_post_o")))
    return table
