"""The stages of `oal run`, resumable from the run directory (design.md "run directory and metrics").

    setup -> analyze -> calibrate -> fidelity -> adapt:<method> -> perplexity:<method> -> report

Each stage has a key: the hash of the configuration it reads and of the keys of the stages it depends on. A stage
whose key matches the marker in `DIR/.oal/stages.json` and whose outputs exist is skipped, so a killed run
continues where it stopped (adaptation itself also resumes mid-way from its checkpoint). Evaluation always
rebuilds the model from the files on disk (kernels + adapter), so a resumed run and an uninterrupted one measure
exactly the same model.

Stages call the public functions of the other modules: `oal.models.registry.load_model`, `oal.data`,
`oal.analysis.analyze`, `oal.calibrate`, `oal.models.convert`, `oal.io.save_kernels/load_kernels`,
`oal.evaluate.fidelity`, `oal.adapt`, `oal.evaluate.perplexity`, `oal.report`.
"""

from __future__ import annotations

import copy
import math
import shutil
import statistics
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from .adapt import adapt, load_adapter, save_adapter
from .analysis import analysis_inputs, analyze, load_groups
from .calibrate import NOT_CALIBRATED, CalibConfig, calibrate_methods, capture_layer_data
from .config import RunConfig
from .data import SplitPlan, default_plan, load_corpus, plan_blocks
from .evaluate.fidelity import fidelity
from .evaluate.perplexity import block_nll
from .io import kernel_dir, load_kernels, save_kernels
from .models.convert import convert
from .models.encoder import is_encoder_model
from .models.registry import default_layers, load_model
from .report import write_report
from .runio import (
    StageLog,
    Timer,
    atomic_write_json,
    config_hash,
    load_json,
    tensor_hash,
    versions,
)

__all__ = ["Run", "aggregate_seeds", "run", "run_seed", "STAGES"]

STAGES = ("setup", "analyze", "calibrate", "fidelity", "adapt", "perplexity", "report")
# Methods without an approximation (the reference arm) and methods that need stable-gap groups.
REFERENCE = "softmax"
NEEDS_GROUPS = ("oal",)


class _Stop(Exception):
    """Raised by `stop_after` (tests): simulate a kill right after a stage finished."""


class Run:
    """One seed's run directory and the lazily loaded model, corpus and token blocks."""

    def __init__(self, cfg: RunConfig, out_dir: str | Path, *, console: Console | None = None,
                 progress: bool = True, stop_after: str | None = None):
        self.cfg = cfg
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.console = console or Console()
        self.progress = progress
        self.stop_after = stop_after
        self.log = StageLog(self.dir)
        self.keys: dict[str, str] = {}
        self.ran: list[str] = []
        self.skipped: list[str] = []
        self._base = None

    # ------------------------------------------------------------------------------------------------ loading

    def _load_model(self):
        return load_model(self.cfg.model, dtype=getattr(torch, self.cfg.dtype), device=self.cfg.device)

    def setup(self) -> None:
        """Model, tokenizer, corpus, split plan and token blocks; writes config.json (cheap, always runs)."""
        with Timer() as t:
            self.model, self.tokenizer, self.provenance = self._load_model()
            self.model.eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
            self.corpus = load_corpus(self.cfg.data, data_dir=self.cfg.data_dir)
            self.plan = (SplitPlan.from_dict(self.cfg.plan) if self.cfg.plan
                         else default_plan(self.cfg.preset))
            self.blocks = plan_blocks(self.corpus, self.tokenizer, self.plan, data_dir=self.cfg.data_dir)
            self.layers = self.cfg.layers if self.cfg.layers is not None else self._default_layers()
            n_layers = self.model.config.num_hidden_layers
            if any(i >= n_layers for i in self.layers):
                raise ValueError(f"layers: {self.layers} out of range for a model with {n_layers} layers")
        config = {
            "config": self.cfg.to_dict(),
            "converted_layers": self.layers,
            "split_plan": self.plan.to_dict(),
            "blocks": {r: {"shape": list(b.shape), "sha256_16": tensor_hash(b)} for r, b in self.blocks.items()},
            "model": _jsonable_provenance(self.provenance),
            "data": {"name": self.corpus.name, "sha256": self.corpus.sha256,
                     "meta": _jsonable_provenance(self.corpus.meta)},
            "versions": versions(),
        }
        self.keys["setup"] = config_hash({k: config[k] for k in ("converted_layers", "split_plan", "blocks", "model",
                                                                "data")} | {"dtype": self.cfg.dtype})
        atomic_write_json(self.dir / "config.json", config)
        self.log.mark("setup", self.keys["setup"], t.seconds)

    def _default_layers(self) -> list[int]:
        return list(default_layers(self.model))

    def base_model(self):
        """A fresh copy of the pristine base model (stages modify models in place)."""
        return copy.deepcopy(self.model)

    @property
    def kernel_methods(self) -> list[str]:
        return [m for m in self.cfg.methods if m != REFERENCE]

    # ------------------------------------------------------------------------------------------------ stages

    def stage(self, name: str, deps: dict, outputs, fn) -> bool:
        """Run `fn()` unless `name` already finished with the same key; True when the stage is complete."""
        key = config_hash({"stage": name, **deps})
        self.keys[name] = key
        if self.log.done(name, key, outputs):
            self.skipped.append(name)
            self.console.print(f"[dim]skip {name}: already done for this configuration[/dim]")
            return True
        self.console.rule(f"[bold]{name}")
        with Timer() as t:
            fn()
        self.log.mark(name, key, t.seconds)
        self.ran.append(name)
        if self.stop_after == name:
            raise _Stop(name)
        return True

    def analyze(self) -> bool:
        if not any(m in NEEDS_GROUPS for m in self.cfg.methods):
            return True
        deps = {"setup": self.keys["setup"], "grouping": self.cfg.grouping, "seed": self.cfg.seed}

        def fn():
            # held-out prompts and one long sequence give the App. A.3 stability checks (Fig. 6, Table 4)
            extra = analysis_inputs(self.corpus, self.tokenizer, self.plan, data_dir=self.cfg.data_dir)
            analyze(self.model, self.tokenizer, self.blocks["grouping"], self.layers, self.dir,
                    heldout=extra["heldout"], long_sequence=extra["long_sequence"], seed=self.cfg.seed,
                    console=self.console, **self.cfg.grouping)

        return self.stage("analyze", deps, ["groups.json"], fn)

    def _calib_config(self):
        return CalibConfig(**{**self.cfg.calib, "seed": self.cfg.seed})

    def kernel_dir(self, method: str) -> Path:
        return kernel_dir(self.dir, method)

    def calibrate(self) -> bool:
        methods = self.kernel_methods
        if not methods:
            return True
        deps = {"setup": self.keys["setup"], "analyze": self.keys.get("analyze"), "calib": self.cfg.calib,
                "methods": methods, "seed": self.cfg.seed}
        outputs = ["calibration.json"] + [str((self.kernel_dir(m) / "kernels.safetensors").relative_to(self.dir))
                                          for m in methods]
        return self.stage("calibrate", deps, outputs, lambda: self._calibrate(methods))

    def _capture(self, role: str, layer: int):
        return capture_layer_data(self.model, self.blocks[role], layer, batch_size=1)

    def _calibrate(self, methods: list[str]) -> None:
        cfg = self._calib_config()
        groups = load_groups(self.dir) if "oal" in methods else {}
        layer_methods: dict[str, dict[int, object]] = {m: {} for m in methods}
        report: dict[str, dict] = {m: {} for m in methods}
        for layer in self.layers:
            self.console.print(f"calibrate layer {layer}: {', '.join(methods)}")
            train, val = self._capture("calib_train", layer), self._capture("calib_val", layer)
            done = calibrate_methods(methods, train, val, layer=layer, groups=groups.get(layer), cfg=cfg,
                                     seed=self.cfg.seed)
            for m, (method, res) in done.items():
                layer_methods[m][layer] = method
                report[m][str(layer)] = res.summary() if res is not None else NOT_CALIBRATED
        model_hashes = self.provenance.get("sha256") if isinstance(self.provenance.get("sha256"), dict) else None
        for m in methods:
            save_kernels(layer_methods[m], self.kernel_dir(m), base_model=str(self.cfg.model),
                         model_hashes=model_hashes, extra={"method": m, "seed": self.cfg.seed})
        atomic_write_json(self.dir / "calibration.json", {"config": cfg.to_dict(), "methods": report})

    def load_methods(self, method: str) -> dict:
        methods, _ = load_kernels(self.kernel_dir(method))
        return methods

    def fidelity(self) -> bool:
        methods = self.kernel_methods
        if not methods:
            return True
        deps = {"calibrate": self.keys.get("calibrate"), "methods": methods}

        def fn():
            sets = {m: self.load_methods(m) for m in methods}
            res = fidelity(self.model, self.blocks["fidelity"], sets, self.layers, progress=self.progress)
            atomic_write_json(self.dir / ".oal" / "fidelity.json", res)

        return self.stage("fidelity", deps, [".oal/fidelity.json"], fn)

    def model_for(self, method: str):
        """Base model with `method`'s calibrated kernels in the converted layers (softmax: the base model)."""
        model = self.base_model()
        if method != REFERENCE:
            convert(model, self.layers, self.load_methods(method))
        return model

    def adapt(self, method: str) -> bool:
        deps = {"setup": self.keys["setup"], "calibrate": None if method == REFERENCE else self.keys.get("calibrate"),
                "adapt": self.cfg.adapt_config().to_dict(), "method": method}
        out = self.dir / "adapter" / method
        ckpt = self.dir / ".oal" / "checkpoints" / method

        def fn():
            # the base copy is frozen; kernel parameters keep their own requires_grad (trainable ones train
            # jointly with LoRA, App. F.2; fixed random features stay fixed)
            model = self.model_for(method)
            peft_model, result = adapt(model, self.blocks["adapt_train"], self.blocks["val"],
                                       self.cfg.adapt_config(), ckpt_dir=ckpt, progress=self.progress,
                                       description=f"adapt {method}")
            save_adapter(peft_model, out, result)
            shutil.rmtree(ckpt, ignore_errors=True)

        return self.stage(f"adapt:{method}", deps, [f"adapter/{method}/adapter_config.json"], fn)

    def perplexity(self, method: str, adapted: bool) -> bool:
        name = f"perplexity:{method}" if adapted else f"perplexity_no_adapt:{method}"
        deps = {"setup": self.keys["setup"], "calibrate": None if method == REFERENCE else self.keys.get("calibrate"),
                "adapt": self.keys.get(f"adapt:{method}") if adapted else None, "method": method,
                "batch": self.cfg.eval_batch_size}
        path = self.dir / ".oal" / f"{name.replace(':', '_')}.json"

        def fn():
            model = self.model_for(method)
            if adapted:
                model = load_adapter(model, self.dir / "adapter" / method)
            total, count = block_nll(model, self.blocks["test"], batch_size=self.cfg.eval_batch_size,
                                     progress=self.progress, description=name)
            atomic_write_json(path, {"nll_sum": total, "tokens": count, "ppl": math.exp(total / count)})

        return self.stage(name, deps, [str(path.relative_to(self.dir))], fn)

    # ------------------------------------------------------------------------------------------------ metrics

    def metrics(self) -> dict:
        out = {"model": str(self.cfg.model), "converted_layers": self.layers, "seed": self.cfg.seed,
               "methods": self.cfg.methods, "fidelity": {}, "perplexity": {}, "perplexity_no_adapt": {},
               "adapt": {}}
        fid = self.dir / ".oal" / "fidelity.json"
        if fid.exists() and "fidelity" in self.keys:
            out["fidelity"] = load_json(fid)
        for m in self.cfg.methods:
            for key, prefix in (("perplexity", "perplexity"), ("perplexity_no_adapt", "perplexity_no_adapt")):
                p = self.dir / ".oal" / f"{prefix}_{m}.json"
                if p.exists() and f"{prefix}:{m}" in self.keys and self.log.done(f"{prefix}:{m}",
                                                                                 self.keys[f"{prefix}:{m}"]):
                    out[key][m] = load_json(p)["ppl"]
            a = self.dir / "adapter" / m / "adapt.json"
            if a.exists():
                res = load_json(a)
                out["adapt"][m] = {k: res[k] for k in ("best_step", "best_val_nll", "steps", "n_lora_params",
                                                        "n_kernel_params", "kernel_change")}
        out["elapsed_s"] = {k: v for k, v in self.log.elapsed().items() if k != "report"}
        return out


def _jsonable_provenance(obj):
    """Provenance dicts may hold Paths or tensors; keep JSON-able values, stringify the rest."""
    if isinstance(obj, dict):
        return {str(k): _jsonable_provenance(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable_provenance(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def run_seed(cfg: RunConfig, out_dir: str | Path, *, console: Console | None = None, progress: bool = True,
             stop_after: str | None = None) -> dict:
    """All stages for one seed; returns metrics.json's content."""
    r = Run(cfg, out_dir, console=console, progress=progress, stop_after=stop_after)
    try:
        r.setup()
        r.analyze()
        r.calibrate()
        r.fidelity()
        for m in cfg.methods:
            r.perplexity(m, adapted=False)
            if r.adapt(m):
                r.perplexity(m, adapted=True)
    except _Stop:
        return {}
    metrics = r.metrics()
    atomic_write_json(r.dir / "metrics.json", metrics)
    with Timer() as t:
        write_report(r.dir, console=r.console)
    r.log.mark("report", config_hash(metrics), t.seconds)
    metrics["elapsed_s"]["report"] = round(t.seconds, 3)
    atomic_write_json(r.dir / "metrics.json", metrics)
    return metrics


def _mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def aggregate_seeds(per_seed: dict[int, dict]) -> dict:
    """Mean and sample std (n-1) over seeds of every perplexity and fidelity number; per-seed values kept."""
    seeds = sorted(per_seed)
    first = per_seed[seeds[0]]
    out = {"model": first["model"], "converted_layers": first["converted_layers"], "seeds": seeds,
           "methods": first["methods"], "per_seed": {str(s): per_seed[s] for s in seeds},
           "perplexity": {}, "perplexity_std": {}, "perplexity_no_adapt": {}, "fidelity": {}, "fidelity_std": {},
           "seed": seeds[0]}
    for key in ("perplexity", "perplexity_no_adapt"):
        for m in first[key]:
            vals = [per_seed[s][key][m] for s in seeds if m in per_seed[s][key]]
            if len(vals) == len(seeds):
                mean, std = _mean_std(vals)
                out[key][m] = mean
                if key == "perplexity":
                    out["perplexity_std"][m] = std
    for m in first["fidelity"]:
        out["fidelity"][m], out["fidelity_std"][m] = {}, {}
        for metric in ("mse", "relmse", "mse_post_o", "relmse_post_o"):
            vals = [per_seed[s]["fidelity"][m][metric] for s in seeds if m in per_seed[s]["fidelity"]]
            if len(vals) == len(seeds):
                out["fidelity"][m][metric], out["fidelity_std"][m][metric] = _mean_std(vals)
        layers = first["fidelity"][m].get("per_layer", {})
        if layers and all("per_layer" in per_seed[s]["fidelity"].get(m, {}) for s in seeds):
            out["fidelity"][m]["per_layer"] = {
                layer: {k: statistics.fmean(per_seed[s]["fidelity"][m]["per_layer"][layer][k] for s in seeds)
                        for k in row} for layer, row in layers.items()}
    out["adapt"] = first.get("adapt", {})  # curves and selection of the first seed (see per_seed for the rest)
    out["elapsed_s"] = {}
    for s in seeds:
        for stage, sec in per_seed[s]["elapsed_s"].items():
            out["elapsed_s"][stage] = out["elapsed_s"].get(stage, 0.0) + sec
    return out


def run(cfg: RunConfig, out_dir: str | Path, seeds: list[int] | None = None, *, console: Console | None = None,
        progress: bool = True) -> dict:
    """`oal run`: one seed writes DIR directly; several seeds write DIR/seed-<s>/ and aggregate into DIR.

    A local BERT-family encoder folder runs the encoder protocol instead (`oal.encoder_pipeline`)."""
    if is_encoder_model(cfg.model):
        from .encoder_pipeline import run_encoder

        return run_encoder(cfg, out_dir, seeds, console=console, progress=progress)
    console = console or Console()
    out_dir = Path(out_dir)
    seeds = seeds or [cfg.seed]
    if len(seeds) == 1:
        metrics = run_seed(cfg.with_seed(seeds[0]), out_dir, console=console, progress=progress)
    else:
        per_seed = {}
        for s in seeds:
            console.rule(f"[bold]seed {s}")
            per_seed[s] = run_seed(cfg.with_seed(s), out_dir / f"seed-{s}", console=console, progress=progress)
        metrics = aggregate_seeds(per_seed)
        atomic_write_json(out_dir / "config.json", load_json(out_dir / f"seed-{seeds[0]}" / "config.json"))
        atomic_write_json(out_dir / "metrics.json", metrics)
        write_report(out_dir, console=console)
    console.print(summary_table(metrics))
    return metrics


def summary_table(metrics: dict) -> Table:
    """methods x (fidelity, PPL) for the terminal."""
    multi = "perplexity_std" in metrics
    table = Table(title=f"oal run: {metrics.get('model')} (layers {metrics.get('converted_layers')})")
    for col in ("method", "RelMSE", "RelMSE post-o", "PPL no adapt", "PPL (LoRA)"):
        table.add_column(col, justify="right")
    for m in metrics.get("methods", []):
        f = metrics.get("fidelity", {}).get(m, {})
        ppl = metrics.get("perplexity", {}).get(m)
        cell = "-" if ppl is None else f"{ppl:.3f}"
        if multi and ppl is not None:
            cell += f" ± {metrics['perplexity_std'][m]:.3f}"
        pre = metrics.get("perplexity_no_adapt", {}).get(m)
        table.add_row(m, f"{f['relmse']:.4f}" if "relmse" in f else "-",
                      f"{f['relmse_post_o']:.4f}" if "relmse_post_o" in f else "-",
                      "-" if pre is None else f"{pre:.3f}", cell)
    return table
