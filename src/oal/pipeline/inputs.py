"""The inputs the commands share, checked once below the command line: the model, the split plan's token blocks,
the layer spec, a run's converted model. Bad input is an `InputError` naming the option (`--model`, `--layers`,
`--data`, ...), which the CLI prints as one line."""

from __future__ import annotations

from pathlib import Path

from oal.errors import InputError, message_of

__all__ = ["blocks_or_fail", "causal_lm_run", "converted_or_fail", "grouping_or_fail", "layer_selection",
           "load_model_or_fail", "one_seed_run", "parse_layers", "registry_preset", "run_methods"]


def load_model_or_fail(model: str, device: str, dtype: str | None = None):
    """`load_model(model, device=device, dtype=dtype)`; a bad name, path or file becomes a clean --model error.
    Under a launch of several processes on CUDA each process loads it on its own GPU."""
    from oal.device import resolve_dtype
    from oal.launch import process_device
    from oal.models.registry import load_model
    from oal.rundir.user_cache import CacheWriteError

    try:
        return load_model(model, device=process_device(device), dtype=resolve_dtype(dtype or "float32"))
    except CacheWriteError:
        raise  # its one line names the cache folder and OAL_CACHE_DIR: not the model's fault
    except (ValueError, RuntimeError, OSError) as exc:
        raise InputError(message_of(exc), "--model") from None


def registry_preset(preset: str | None, mdl) -> str:
    """--preset, or the one detected from the model; must name a registry preset."""
    from oal.models.registry import PRESETS, preset_for

    preset = preset or preset_for(mdl)
    if preset not in PRESETS:
        raise InputError(f"expected one of {sorted(PRESETS)}, got {preset!r}", "--preset")
    return preset


def layer_selection(spec: str | None, by: str, by_option: str = "--select-by") -> dict:
    """RunConfig's `layers` and `select` from --layers ('auto:K' selects, anything else is a fixed list)."""
    from oal.pipeline.selection import CRITERIA, parse_auto

    if by not in CRITERIA:
        raise InputError(f"expected one of {', '.join(CRITERIA)}, got {by!r}", by_option)
    try:
        k = parse_auto(spec)
    except ValueError as exc:
        raise InputError(message_of(exc), "--layers") from None
    if k is not None:
        return {"layers": None, "select": {"k": k, "by": by}}
    return {"layers": parse_layers(spec) if spec is not None else None}


def grouping_or_fail(spec: str) -> dict:
    """RunConfig's `grouping` from --grouping (`oal run`, `oal select-layers`)."""
    from oal.analysis import parse_grouping

    try:
        return parse_grouping(spec)
    except ValueError as exc:
        raise InputError(message_of(exc), "--grouping") from None


def parse_layers(spec: str, n_layers: int | None = None) -> list[int]:
    """"all", "3-20" (inclusive) or "1,4,7" (mixable: "1,3-5") -> sorted layer list.

    Checked against `n_layers` when the model is known; "all" needs it.
    """
    if spec.strip().lower() == "all":
        if n_layers is None:
            raise InputError("'all' needs the model's layer count here; give a range such as 1-4", "--layers")
        return list(range(n_layers))
    out: set[int] = set()
    try:
        for part in spec.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if lo > hi:
                    raise InputError(f"range {part!r} is empty (expected A-B with A <= B)", "--layers")
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
    except InputError:
        raise
    except ValueError:
        raise InputError(f"expected 'all', 'A-B' or 'A,B,C', got {spec!r}", "--layers") from None
    if not out or min(out) < 0 or (n_layers is not None and max(out) >= n_layers):
        where = f"[0, {n_layers})" if n_layers is not None else "[0, number of layers)"
        raise InputError(f"layers must lie in {where}, got {spec!r}", "--layers")
    return sorted(out)


def blocks_or_fail(tokenizer, mdl, data: str, data_dir: str | None, preset: str | None):
    """The split plan's token blocks of `data` for `mdl`'s preset; a bad corpus becomes a clean --data error."""
    from oal.data import default_plan, load_corpus, plan_blocks
    from oal.models.registry import preset_for

    preset = preset or preset_for(mdl)
    try:
        plan = default_plan(preset)
        corpus = load_corpus(data, data_dir=data_dir)
        return plan_blocks(corpus, tokenizer, plan, data_dir=data_dir), plan, preset
    except (ValueError, RuntimeError, OSError) as exc:
        raise InputError(message_of(exc), "--data") from None


def converted_or_fail(out: Path, model: str | None, method: str, device: str, adapter: bool | None = None,
                      dtype: str | None = None, *, softmax: bool = False):
    """(model, tokenizer, info) of `artefact.arms.load_converted`: the run's base model (checked against the
    kernels' record), `method`'s kernels and, by default, its adapter; `dtype` defaults to the run's. `softmax`: the
    softmax arm too (`load_arm`: the base model and its adapter). A base model given as `model` that is not the
    run's is an error on --model."""
    from oal.artefact.arms import load_arm, load_converted
    from oal.device import resolve_dtype

    load = load_arm if softmax else load_converted
    try:
        return load(out, method, adapter, model=model, device=device, dtype=resolve_dtype(dtype) if dtype else None)
    except ValueError as exc:
        # `oal.load`'s errors name its own argument; the base model given on the command line is --model
        if model is None or isinstance(exc, InputError) or not str(exc).startswith("base_model: "):
            raise
        raise InputError(message_of(exc), "--model") from None


def run_methods(out: Path, methods: list[str] | None, fallback: list[str]) -> list[str]:
    """`methods`, or the methods recorded in the run's config.json, or `fallback`; a damaged config.json is a
    ValueError naming it."""
    from oal.pipeline.records import run_config

    if methods is not None:
        return methods
    config = out / "config.json"
    return (run_config(config)["config"].get("methods") if config.is_file() else None) or fallback


def _run_record(out: Path):
    """OUT/config.json as `oal run` wrote it ({} without one)."""
    from oal.rundir.files import load_json

    return load_json(out / "config.json") if (out / "config.json").is_file() else {}


def causal_lm_run(out: Path, why: str) -> None:
    """InputError on --out where OUT is an encoder's run (its config.json's protocol, wherever its model is): `why`
    says what of a causal LM the command needs."""
    config = _run_record(out)
    if isinstance(config, dict) and config.get("protocol") == "encoder":
        model = (config.get("config") or {}).get("model")
        raise InputError(f"{out} is an encoder's run ({model}): {why}", "--out", "out_dir")


def one_seed_run(out: Path, config: dict | None = None) -> None:
    """InputError on --out where OUT is the top of a multi-seed run (its config.json, or `config`, lists "seeds"):
    it holds the aggregate, no model; the message names the seeds' own run directories."""
    if config is None:
        config = _run_record(out)
    seeds = config.get("seeds") if isinstance(config, dict) else None
    if isinstance(seeds, list) and seeds:
        dirs = ", ".join(str(out / f"seed-{s}") for s in seeds)
        raise InputError(f"{out} is a multi-seed run (seeds {seeds}): it holds their aggregate, and each seed's "
                         f"model is in its own run directory; give one of them as --out: {dirs}", "--out", "out_dir")
