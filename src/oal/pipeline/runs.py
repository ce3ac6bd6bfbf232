"""The commands that write a run directory, each under the directory's lock (`rundir.lock.own_dir`: one writer at
a time, every write confined to the directory): `run` (`oal run`), `run_seed`, `adapt_arm` (`oal adapt`) and
`run_selection` (`oal select-layers`)."""

import hashlib
import json
import logging
import numbers
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from rich.console import Console

from oal.errors import InputError
from oal.launch import log_console, process_device, ranks
from oal.methods.base import get_method
from oal.models.encoder import is_encoder_model
from oal.pipeline.base import REFERENCE, Stop
from oal.pipeline.config import ALL_METHODS, RunConfig, parse_seeds
from oal.pipeline.decoder import SELECTION_FILE, Run
from oal.pipeline.inputs import causal_lm_run
from oal.pipeline.records import run_config, selection_record
from oal.pipeline.selection import SELECTION_KEYS
from oal.rundir.claim import multi_seed_layout
from oal.rundir.files import atomic_write_json, check_out_dir, clean_tmp
from oal.rundir.lock import own_dir

log = logging.getLogger("oal")


def _check_cfg(cfg) -> None:
    """`cfg` is a RunConfig: a preset's name or a dict failed on a missing attribute, deep inside."""
    if not isinstance(cfg, RunConfig):
        hint = (f"RunConfig.from_preset({cfg!r})" if isinstance(cfg, str) else "RunConfig.from_dict(d)"
                if isinstance(cfg, dict) else "RunConfig.from_preset('default')")
        raise ValueError(f"cfg: expected a RunConfig ({hint}), got {type(cfg).__name__}")


def _seeds(seeds) -> list[int]:
    """`run`'s seeds read as `--seeds` is: "0,1" ran the seeds "0", "," and "1" (after making seed-0/), [0, 0]
    seed 0 twice, 0.5 failed on len()."""
    items = seeds if isinstance(seeds, (list, tuple, range)) else [seeds]
    if any(isinstance(s, bool) or not isinstance(s, (str, numbers.Integral)) for s in items):
        raise ValueError(f"seeds: expected a list of integers or a string such as '42,43,44', got {seeds!r}")
    return parse_seeds(seeds)


def for_protocol(cfg: RunConfig) -> RunConfig:
    """`cfg` with `--methods all` meaning every method that applies: on an encoder, all but the sliding windows
    (causal only). An explicit list is kept as given (`run_class` refuses a window on an encoder)."""
    import dataclasses

    if set(cfg.methods) != set(ALL_METHODS) or not is_encoder_model(cfg.model):
        return cfg
    kept = [m for m in cfg.methods if not get_method(m).positional]
    log.info("--methods all on an encoder: %s (the sliding windows are causal)", ", ".join(kept))
    return dataclasses.replace(cfg, methods=kept)


def run_class(cfg: RunConfig) -> type[Run]:
    """The protocol of `cfg.model`: `EncoderRun` for a local BERT-family encoder folder, `Run` otherwise."""
    if is_encoder_model(cfg.model):
        from oal.pipeline.encoder import EncoderRun

        if cfg.select:
            raise InputError("layer selection (auto:K) is for causal LMs; give encoder layers explicitly", "--layers",
                             "layers")
        if any(get_method(m).positional for m in cfg.methods):
            raise InputError("the sliding windows (swa, oal-swa, global-swa) are causal; an encoder attends both ways",
                             "--methods", "methods")

        return EncoderRun
    return Run


def run_seed(cfg: RunConfig, out_dir: str | Path, *, console: Console | None = None, progress: bool = True,
             stop_after: str | None = None, force: bool = False, arms: list[str] | None = None,
             allow_changes: tuple[str, ...] = (), recorded: dict | None = None,
             check: Callable[[Run], None] | None = None) -> dict:
    """All stages for one seed; returns metrics.json's content.

    `arms`: run the adapt/perplexity stages of these methods only (the others are reported when their recorded
    outputs verify); `force`/`allow_changes`/`recorded`: see `StagedRun`; `check(run)` refuses, once the model is
    loaded and before any stage, what would fail after them (`oal run --passkey`'s lengths). metrics.json and
    report.md are always rewritten from the stage records that verify, so they describe exactly the files on disk.
    """
    _check_cfg(cfg)
    cfg = for_protocol(cfg)
    r = run_class(cfg)(cfg, out_dir, console=console, progress=progress, stop_after=stop_after, force=force,
                       allow_changes=allow_changes, recorded=recorded)
    with own_dir(r.dir, r.ranks):
        try:
            r.setup(check)
            r.stages(arms)
        except Stop:
            return {}
        return r.ranks.on_main(r.publish)  # the main process writes; every process returns the same metrics


def adapt_arm(out_dir: str | Path, method: str, *, steps: int | None = None, device: str | None = None,
              dtype: str | None = None, console: Console | None = None, progress: bool = True,
              batch_size: int | None = None, grad_accum: int | None = None,
              lora_dropout: float | None = None, window: int | None = None, sinks: int | None = None) -> dict:
    """`oal adapt`: (re)adapt one arm of an existing single-seed run, optionally with other adaptation settings
    (`steps`, `batch_size`, `grad_accum`, `lora_dropout`; recorded in config.json as that arm's `adapt_overrides`).
    Its adapt and perplexity stages rerun when their keys changed, and metrics.json and report.md are rewritten, so
    they describe the adapter now on disk. `window`/`sinks` change the run's sliding windows (config.json's
    `window`/`sinks`; calibration reruns). Returns the new metrics (on every process of a launch)."""
    out_dir = check_out_dir(out_dir)
    group = ranks(process_device(device or "auto"))
    settings = {k: v for k, v in (("steps", steps), ("batch_size", batch_size), ("grad_accum", grad_accum),
                                  ("lora_dropout", lora_dropout)) if v is not None}
    windows = {k: v for k, v in (("window", window), ("sinks", sinks)) if v is not None}
    with own_dir(out_dir, group):
        old, d = group.on_main(lambda: _arm_config(out_dir, method, dtype, settings, windows))
        if device is not None:
            d["device"] = old["device"] = device  # a runtime choice, not part of the run's configuration
        cfg = RunConfig.from_dict(d)
        # config.json keeps the recorded settings until the adapter trained with the new ones is on disk
        return run_seed(cfg, out_dir, console=console, progress=progress, arms=[method],
                        allow_changes=("config.adapt_overrides", "config.methods", "config.window", "config.sinks"),
                        recorded=RunConfig.from_dict(old).to_dict())


def _arm_config(out_dir: Path, method: str, dtype: str | None, settings: dict,
                windows: dict | None = None) -> tuple[dict, dict]:
    """The run configuration of `oal adapt`: (the recorded one, the recorded one with `method`'s arm, its adapt
    `settings` and any new `windows` settings)."""
    cfg_path = out_dir / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"{out_dir} has no config.json; run `oal run --out {out_dir}` first", "--out", "out_dir")
    config = run_config(cfg_path)
    parent = out_dir.parent / "config.json"
    if "seeds" in config or (out_dir.name.startswith("seed-") and parent.is_file() and "seeds" in run_config(parent)):
        raise InputError(f"{out_dir} is (part of) a multi-seed run, whose aggregate would then mix settings; rerun "
                         "all seeds with `oal run --seeds ... --steps N` instead", "--out", "out_dir")
    if config.get("protocol") == "encoder":
        raise InputError(f"{out_dir} is an encoder run; adaptation is implemented for causal LMs only", "--out",
                         "out_dir")
    old = dict(config["config"])
    d = dict(old)
    if method not in d["methods"]:
        from oal.methods import method_names
        from oal.methods.base import unknown_method

        if method not in method_names():
            also = [] if REFERENCE in d["methods"] else [REFERENCE]  # it read "oal, softmax (...) or softmax"
            raise InputError(unknown_method(method, [*d["methods"], *also], whose=" (this run's arms)"), "--method",
                             "method")
        if method != REFERENCE:
            have = ",".join(d["methods"])
            raise InputError(f"{out_dir} has no calibrated kernels for {method!r} (it calibrated {have}); a run "
                             f"directory holds one configuration, so run `oal run --out NEW_DIR --methods "
                             f"{have},{method}` (or add --force to replace this run)", "--method", "method")
        d["methods"] = [*d["methods"], method]
    if dtype is not None and dtype != d.get("dtype", "float32"):
        raise InputError(f"the run was made with dtype {d.get('dtype', 'float32')}, not {dtype}", "--dtype", "dtype")
    if settings:
        overrides = dict(d.get("adapt_overrides") or {})
        overrides[method] = {**overrides.get(method, {}), **settings}
        d["adapt_overrides"] = overrides
    d.update(windows or {})
    RunConfig.from_dict(d)  # a bad setting (e.g. lora_dropout 1.5) fails here, on the main process, for every one
    return old, d


def run(cfg: RunConfig, out_dir: str | Path, seeds: list[int] | str | None = None, *,
        console: Console | None = None, progress: bool = True, force: bool = False, results: Console | None = None,
        check: Callable[[Run], None] | None = None) -> dict:
    """`oal run`: one seed writes DIR directly; several seeds write DIR/seed-<s>/ and aggregate into DIR.

    `seeds`: distinct integers >= 0, as a list or as `--seeds` takes them ("42,43,44"); default: `cfg.seed`.

    `console` gets what the stages say while they work (default: stderr), `results` the final table (default:
    stdout); both on the main process only. `check`: as `run_seed`'s, for each seed.

    DIR keeps one configuration and one layout (single or multi-seed): anything else is refused unless `force`;
    a multi-seed DIR given its seeds and more keeps its seeds and adds the others.
    A local BERT-family encoder folder runs the encoder protocol (`oal.pipeline.encoder.EncoderRun`).
    """
    _check_cfg(cfg)
    seeds = [cfg.seed] if seeds is None else _seeds(seeds)
    out_dir = check_out_dir(out_dir)
    group = ranks(process_device(cfg.device))
    # before any seed: processes given other --seeds lists ran apart (one seed-42/, the other DIR itself) until
    # a collective of seed 43 found no peer ("lost contact"); each seed's own settings are agreed in its setup
    group.agree({"seeds": seeds}, {"seeds": "--seeds"})
    console = (console or log_console()) if group.is_main else Console(quiet=True)  # the main process reports
    results = (results or Console()) if group.is_main else Console(quiet=True)
    cfg = for_protocol(cfg)
    protocol = run_class(cfg)
    with own_dir(out_dir, group):
        group.on_main(lambda: multi_seed_layout(out_dir, _layout_seeds(out_dir, seeds), force=force))
        if len(seeds) == 1:
            one = _amended(cfg.with_seed(seeds[0]), out_dir, force)
            metrics = run_seed(one, out_dir, console=console, progress=progress, force=force,
                               allow_changes=SELECTION_KEYS, check=check)
        else:
            group.on_main(lambda: clean_tmp(out_dir))
            for s in seeds:
                console.rule(f"[bold]seed {s}")
                run_seed(cfg.with_seed(s), out_dir / f"seed-{s}", console=console, progress=progress, force=force,
                         allow_changes=SELECTION_KEYS, check=check)
            # each seed's metrics.json as it is now, not as run_seed returned it: `oal evaluate` on a finished seed
            # while a later one ran rewrote it (and could not refresh DIR, which this run holds)
            metrics = group.on_main(lambda: _write_aggregate(protocol, out_dir, seeds, console))
    results.print(protocol.summary(metrics))
    return metrics


def _amended(cfg: RunConfig, out_dir: Path, force: bool) -> RunConfig:
    """`cfg` with the arm settings `oal adapt` recorded in OUT/config.json (`adapt_overrides`), where `cfg` sets
    none: `oal run` resumes a run `oal adapt --steps N` amended (it was refused as another configuration, and
    --force, which deletes the run, was the only way on). The same for the softmax arm `oal adapt --method softmax`
    appended to the run's methods."""
    path = out_dir / "config.json"
    if force or not path.is_file():
        return cfg
    try:
        config = run_config(path)["config"]
    except ValueError:
        return cfg  # the run's own checks name the damage
    if REFERENCE not in cfg.methods and config.get("methods") == [*cfg.methods, REFERENCE]:
        log.info("%s: keeping the %s arm `oal adapt --method %s` added (methods %s)", path, REFERENCE, REFERENCE,
                 ",".join(config["methods"]))
        cfg = replace(cfg, methods=list(config["methods"]))
    recorded = config.get("adapt_overrides")
    if cfg.adapt_overrides:
        return cfg
    kept = {m: v for m, v in recorded.items() if m in cfg.methods} if isinstance(recorded, dict) else {}
    if not kept:
        return cfg
    log.info("%s: keeping the arm settings `oal adapt` recorded (%s)", path,
             "; ".join(f"{m}: {', '.join(f'{k} {v}' for k, v in settings.items())}" for m, settings in kept.items()))
    return replace(cfg, adapt_overrides=kept)


def _layout_seeds(out_dir: Path, seeds: list[int]) -> list[int]:
    """The seeds `multi_seed_layout` checks: a multi-seed DIR given all its recorded seeds and more (or the same in
    another order) keeps what it has, each seed resumed as recorded, and adds the new ones (rerunning them all
    under --force was the only way); fewer seeds than recorded stay refused."""
    try:
        recorded = _recorded_seeds(out_dir)
    except ValueError:
        return seeds  # multi_seed_layout names the damage
    if len(seeds) > 1 and isinstance(recorded, list) and set(recorded) <= set(seeds):
        return recorded
    return seeds


def _recorded_seeds(out_dir: Path):
    """The "seeds" DIR/config.json records (None without one); ValueError for a damaged config.json."""
    top = out_dir / "config.json"
    return run_config(top).get("seeds") if top.is_file() else None


def _write_aggregate(protocol: type[Run], out_dir: Path, seeds: list[int], console: Console) -> dict:
    """The multi-seed aggregate of `protocol` from each seed's metrics.json on disk (each read once: the numbers
    and the SHA256 recorded of them are of the same bytes): metrics.json, config.json and report.md of DIR (main
    process)."""
    per_seed, sha = {}, {}
    for s in seeds:
        data = (out_dir / f"seed-{s}" / "metrics.json").read_bytes()
        per_seed[s], sha[f"seed-{s}/metrics.json"] = json.loads(data), hashlib.sha256(data).hexdigest()
    metrics = protocol.aggregate(per_seed)
    metrics["sha256"] = sha
    config = run_config(out_dir / f"seed-{seeds[0]}" / "config.json")
    atomic_write_json(out_dir / "config.json", {**config, "seeds": list(seeds)})
    atomic_write_json(out_dir / "metrics.json", metrics)
    protocol.report(out_dir, console)
    return metrics


def refresh_aggregate(seed_dir: str | Path, console: Console | None = None) -> dict | None:
    """After `oal evaluate` on DIR/seed-<s> of a multi-seed `oal run`: DIR's metrics.json and report.md aggregated
    again from every seed's metrics.json, so that they include what was just measured (else DIR would go on showing
    the older numbers). None where `seed_dir` is no such seed, or (with a warning) where a seed's run is unfinished
    or its metrics.json no longer matches its record: DIR is then left as it was."""
    from oal.rundir.stages import StageLog

    seed_dir = Path(seed_dir)
    try:
        seeds = _recorded_seeds(seed_dir.parent)
    except ValueError:
        return None
    if not isinstance(seeds, list) or seed_dir.name not in {f"seed-{s}" for s in seeds}:
        return None
    for s in seeds:
        d = seed_dir.parent / f"seed-{s}"
        try:
            finished = (d / ".oal" / "stages.json").is_file() and StageLog(d).verified("report")
        except ValueError:
            finished = False
        if not finished:
            log.warning("%s not updated: %s is not a finished run whose records verify (`oal run --out %s --seeds "
                        "%s` with the run's options finishes it and aggregates)", seed_dir.parent / "metrics.json", d,
                        seed_dir.parent, ",".join(map(str, seeds)))
            return None
    try:
        with own_dir(seed_dir.parent):
            return _write_aggregate(Run, seed_dir.parent, seeds, console or Console(quiet=True))
    except InputError as exc:  # another command holds DIR: the seed's own numbers are written; say what is not
        log.warning("%s not updated: %s", seed_dir.parent / "metrics.json", exc.message)
        return None


def run_selection(cfg: RunConfig, out_dir: str | Path, *, console: Console | None = None, progress: bool = True,
                  force: bool = False) -> dict:
    """`oal select-layers`: the stages of `oal run --layers auto:K` up to the layer selection (selection.json); `oal
    run` with the same options continues from there. Another K or criterion than recorded reuses the calibration
    and the scores; where the run went on past the selection, metrics.json and report.md are rebuilt from the
    records that still verify (the arms of the old selection's kernels drop out until `oal run` redoes them)."""
    _check_cfg(cfg)
    if not cfg.select:
        raise InputError("expected a layer selection such as auto:2", "--k", "select")
    causal_lm_run(Path(out_dir), "layer selection ranks layers by a causal LM's perplexity, which an encoder has not")
    r = Run(cfg, out_dir, console=console, progress=progress, force=force, allow_changes=SELECTION_KEYS)
    with own_dir(r.dir, r.ranks):
        r.setup()
        r.analyze()
        r.calibrate()
        r.select()
        if r.ranks.is_main and "select" in r.ran and "report" in r.log.stages:  # the run went on past the old one
            from oal.pipeline.publish import republish

            republish(r.dir, r.console)
            r.console.print(f"metrics.json and report.md rebuilt for this selection; `oal run --out {r.dir} --layers "
                            f"auto:{cfg.select['k']} --select-by {cfg.select['by']}` redoes what depends on it")
        return selection_record(r.dir / SELECTION_FILE)
