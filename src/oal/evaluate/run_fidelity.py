"""Frozen-attention fidelity of a run directory's calibrated kernels, merged into its metrics.json (`oal evaluate`).

The base model is the one the kernels record (or the one named), checked against that record by the SHA256 of its
tensors and files: kernels are never evaluated on another model. In an `oal run` directory the data and split plan
default to the run's own; each method's entry records the data and the number of blocks it was measured on, and
the merge goes through `oal.metrics.update_metrics` (which also rewrites report.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import InputError
from ..runio import load_json, sha256_tree

__all__ = ["evaluate_fidelity"]


def evaluate_fidelity(out_dir: str | Path, methods: Sequence[str] | None = None, *, model: str | None = None,
                      data: str | None = None, data_dir: str | None = None, preset: str | None = None,
                      blocks: int | None = None, device: str = "cpu", dtype: str | None = None,
                      progress: bool = True, console=None) -> dict:
    """Fidelity (Table 2 metrics) of `methods`' kernels in `out_dir` on the held-out fidelity blocks (the first
    `blocks` of them); returns {method: metrics} after merging it into `out_dir`/metrics.json. The base model is
    loaded in `dtype` (default: the run's own)."""
    from ..data import SplitPlan, default_plan, load_corpus, plan_blocks
    from ..device import resolve_dtype
    from ..io import check_kernels_base, kernel_dir, load_kernels, model_fingerprint, recorded_base_model
    from ..metrics import update_metrics
    from ..models.registry import load_model, preset_for
    from .fidelity import fidelity

    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise InputError(f"{out_dir} is not a directory with calibrated kernels", "--out", "out_dir")
    if blocks is not None and (not isinstance(blocks, int) or blocks < 1):
        raise InputError(f"expected a number of blocks >= 1, got {blocks!r}", "--blocks", "blocks")
    run = load_json(out_dir / "config.json") if (out_dir / "config.json").is_file() else None
    if run is not None and "seeds" in run:
        raise InputError(f"{out_dir} is a multi-seed run; evaluate one seed (--out {out_dir}/seed-<s>) with "
                         "`oal run` instead", "--out", "out_dir")
    recorded = (run or {}).get("config") or {}
    if methods is None:
        methods = [m for m in recorded.get("methods", ["oal", "global"]) if m != "softmax"]
    methods = list(methods)
    if not methods:
        raise InputError("expected at least one calibrated method", "--methods", "methods")
    name = model or recorded_base_model(kernel_dir(out_dir, methods[0])) or "default"
    dtype = resolve_dtype(dtype or recorded.get("dtype") or "float32")
    mdl, tok, provenance = load_model(name, device=device, dtype=dtype)
    sets, inputs = {}, {}
    for m in methods:
        kdir = kernel_dir(out_dir, m)
        try:
            sets[m], meta = load_kernels(kdir, fingerprint=model_fingerprint(mdl))
        except ValueError as exc:
            raise InputError(f"{m}: {exc}", "--methods", "methods") from exc
        check_kernels_base(kdir, meta, mdl, provenance)
        inputs.update(sha256_tree(out_dir, kdir.relative_to(out_dir) / "kernels.safetensors"))
        inputs.update(sha256_tree(out_dir, kdir.relative_to(out_dir) / "kernels.json"))
    data = data or recorded.get("data") or "builtin"
    data_dir = data_dir or recorded.get("data_dir")
    try:
        corpus = load_corpus(data, data_dir=data_dir)
        if preset is None and run is not None and data == recorded.get("data"):
            plan = SplitPlan.from_dict(run["split_plan"])  # the run's own held-out blocks
        else:
            plan = default_plan(preset or preset_for(mdl))
        held_out = plan_blocks(corpus, tok, plan, data_dir=data_dir)["fidelity"]
    except (ValueError, OSError) as exc:
        raise InputError(f"{data}: {exc}", "--data", "data") from exc
    held_out = held_out[:blocks] if blocks else held_out
    res = fidelity(mdl, held_out.to(device), sets, progress=progress)
    for r in res.values():
        r.update({"data": corpus.name, "n_blocks": int(held_out.shape[0]), "block_len": int(held_out.shape[1])})
    update_metrics(out_dir, {"fidelity": res}, inputs, console=console,
                   defaults={"model": name, "converted_layers": sorted(next(iter(sets.values())))})
    return res
