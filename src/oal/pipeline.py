"""The stages of `oal run`, resumable from the run directory (design.md "run directory and metrics").

    setup -> analyze -> calibrate -> [select] -> fidelity -> regime -> budget -> adapt:<method> -> perplexity:<method>
          -> zeroshot:<method> -> [compare:<layers>] -> report

The bracketed stages run with `--layers auto:K` only (oal.selection): every layer is calibrated into candidates/,
`select` ranks them and writes the K best layers' kernels where a fixed range would have them, and `compare` adapts
the paper's range and the criterion's top layers at the paper's K for the report. `regime` measures softmax's
attention regime and where the calibrated kernels sit beyond their vertex; `budget` draws Fig. 2(b)'s group-budget
curve beside App. B's choice.

Each stage has a key: the hash of the configuration it reads and of the SHA256 of the files it reads (the outputs
of earlier stages). A stage whose key matches the marker in `DIR/.oal/stages.json` and whose outputs still have the
SHA256 recorded there is skipped, so a killed run continues where it stopped (calibration resumes per layer and
adaptation mid-way from their checkpoints); a damaged output is reported and its stage recomputed, and every stage
that read it follows, since its input hashes changed. Evaluation always rebuilds the model from the files on disk
(kernels + adapter), so a resumed run and an uninterrupted one measure exactly the same model.

A run directory belongs to one configuration (config.json): another configuration is refused with the differing
keys named, unless `force=True` deletes the old results first. metrics.json records the SHA256 of the files its
numbers were computed from.

Under `torchrun` / `accelerate launch` every process runs these functions: calibration and adaptation run on all of
them (`oal.distributed`), every other stage on the main process while the others wait, and only the main process
reads the stage log and writes the run directory.

Stages call the public functions of the other modules: `oal.models.registry.load_model`, `oal.data`,
`oal.analysis.analyze`, `oal.calibrate`, `oal.models.convert`, `oal.io.save_kernels/load_kernels`,
`oal.evaluate.fidelity`, `oal.adapt`, `oal.evaluate.perplexity`, `oal.evaluate.zeroshot`, `oal.report`.
"""

from __future__ import annotations

import copy
import math
import shutil
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .adapt import adapt, adapt_identity, load_adapter, save_adapter
from .analysis import analysis_inputs, analyze, load_groups
from .analysis.regime import REGIME_FILE, attention_regime
from .calibrate import CalibConfig
from .calibrate_resume import LayerCheckpoints, OnePassCapture, calibrate_layers, write_calibration
from .config import RunConfig
from .data import SplitPlan, bind_pretraining, default_plan, load_corpus, plan_blocks
from .data.zeroshot import DISPLAY_NAMES
from .device import checkpoint_layers, enable_layer_checkpointing, resolve_dtype
from .diagnostics.budget import BUDGET_FILE, RUN_BUDGETS, run_budget
from .distributed import process_device, ranks
from .errors import InputError
from .evaluate.fidelity import fidelity
from .evaluate.perplexity import block_nll
from .evaluate.zeroshot import evaluate_tasks, load_tasks, merge_metrics
from .io import KERNELS_FILE, META_FILE, kernel_dir, load_kernels, model_fingerprint, save_kernels
from .methods.base import newer_versions
from .models.convert import convert
from .models.encoder import is_encoder_model
from .models.registry import default_layers, load_model
from .report import write_report
from .run_dir import claim_run_dir, multi_seed_layout
from .runio import (
    StageLog,
    Timer,
    atomic_write_json,
    check_out_dir,
    clean_tmp,
    config_hash,
    load_json,
    sha256_file,
    tensor_hash,
    versions,
)
from .selection import comparison_sets, select_layers

__all__ = ["Run", "adapt_arm", "aggregate_seeds", "run", "run_class", "run_seed", "run_selection", "STAGES"]

FIDELITY_FILE = ".oal/fidelity.json"
STAGES = ("setup", "analyze", "calibrate", "select", "fidelity", "regime", "budget", "adapt", "perplexity", "zeroshot",
          "compare", "report")
# Methods without an approximation (the reference arm) and methods that need stable-gap groups.
REFERENCE = "softmax"
CANDIDATES = "candidates"  # --layers auto:K: every candidate layer's calibrated kernels and calibration.json
SELECTION_FILE = "selection.json"
NEEDS_GROUPS = ("oal",)


class _Stop(Exception):
    """Raised by `stop_after` (tests): simulate a kill right after a stage finished."""


class Run:
    """One seed's run directory and the lazily loaded model, corpus and token blocks (the decoder protocol).

    Another protocol (`oal.encoder_pipeline.EncoderRun`) subclasses it and overrides the hooks: `_load_model`,
    `_plan_blocks`, `_blocks_record`, `_analysis_inputs`, `_fidelity_data`, `stages`, `results`, `report`,
    `aggregate`, `summary`; setup, the stage mechanism, calibration and provenance stay here.
    """

    protocol: str | None = None  # recorded in config.json when set (the decoder protocol records none)

    def __init__(self, cfg: RunConfig, out_dir: str | Path, *, console: Console | None = None,
                 progress: bool = True, stop_after: str | None = None, force: bool = False,
                 allow_changes: tuple[str, ...] = ()):
        """Nothing is written before `setup()` has loaded and checked the model, the data and the directory.

        force: delete the results of another configuration found in `out_dir` and start clean;
        allow_changes: configuration keys (dotted prefixes) that may differ from the recorded ones (the commands
        that change part of a run, e.g. `oal adapt`).
        """
        self.cfg = cfg
        self.dir = check_out_dir(out_dir)
        # --device auto -> CUDA when present (under a launch: this process's GPU)
        self.device = process_device(self.cfg.device)
        self.ranks = ranks(self.device)
        # the other processes of a launch compute but say nothing (the main process reports)
        self.console = (console or Console()) if self.ranks.is_main else Console(quiet=True)
        self.progress = progress and self.ranks.is_main
        self.stop_after = stop_after
        self.force = force
        self.allow_changes = tuple(allow_changes)
        self.log: StageLog | None = None
        self.keys: dict[str, str] = {}
        self.ran: list[str] = []
        self.skipped: list[str] = []
        self._base = None
        self._zeroshot = None
        self.zeroshot_skipped: dict[str, str] = {}

    # ------------------------------------------------------------------------------------------------ loading

    def _load_model(self):
        # the base model in cfg.dtype, kernels/LoRA/calibration in fp32
        return load_model(self.cfg.model, dtype=resolve_dtype(self.cfg.dtype), device=self.device)

    def setup(self) -> None:
        """Model, tokenizer, corpus, split plan and token blocks; checks that DIR holds no other configuration, then
        writes config.json (cheap, always runs). Every bad input fails here, before anything is written."""
        with Timer() as t:
            self.model, self.tokenizer, self.provenance = self._load_model()
            self.model.eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
            n_layers = self.model.config.num_hidden_layers
            # --layers auto:K: every layer is a candidate (calibrated into candidates/), the K best are converted
            self.layers = self.cfg.layers if self.cfg.layers is not None else (
                list(range(n_layers)) if self.cfg.select else self._default_layers())
            if not self.layers or any(i >= n_layers for i in self.layers):
                raise InputError(f"expected layer indices in [0, {n_layers}) for this model, got {self.layers}",
                                 "--layers", "layers")
            if self.cfg.select and self.cfg.select["k"] > len(self.layers):
                raise InputError(f"expected auto:K with K <= {len(self.layers)} (the candidate layers), got "
                                 f"auto:{self.cfg.select['k']}", "--layers", "layers")
            self.calib_root = self.dir / CANDIDATES if self.cfg.select else self.dir
            try:
                self.corpus = load_corpus(self.cfg.data, data_dir=self.cfg.data_dir)
                self.plan, self.blocks = self._plan_blocks()
            except (ValueError, OSError) as exc:
                raise InputError(f"{self.cfg.data}: {exc}", "--data", "data") from exc
        config = {
            **({"protocol": self.protocol} if self.protocol else {}),
            "config": self.cfg.to_dict(),
            "converted_layers": self.layers if not self.cfg.select else {**self.cfg.select, "candidates": self.layers},
            "split_plan": self.plan.to_dict(),
            "blocks": self._blocks_record(),
            "model": _jsonable_provenance(self.provenance),
            "data": {"name": self.corpus.name, "sha256": self.corpus.sha256,
                     "meta": _jsonable_provenance(self.corpus.meta)},
            "versions": versions(),
        }
        # content, not paths: the same model files and text elsewhere give the same key
        self.keys["setup"] = config_hash({**({"protocol": self.protocol} if self.protocol else {}),
                                          "converted_layers": self.layers, "split_plan": config["split_plan"],
                                          "blocks": config["blocks"], "dtype": self.cfg.dtype,
                                          "model": {k: self.provenance.get(k) for k in ("sha256", "state_dict_sha256")},
                                          "data": self.corpus.sha256})

        def claim():  # the main process only: it alone reads the stage log and writes
            claim_run_dir(self.dir, config, force=self.force, allow=self.allow_changes)
            self.log = StageLog(self.dir)
            atomic_write_json(self.dir / "config.json", config)
            self.log.mark("setup", self.keys["setup"], t.seconds, outputs=["config.json"])

        self.ranks.on_main(claim)

    def _plan_blocks(self) -> tuple:
        """(split plan, {role: token blocks [S, N]}) from the corpus."""
        plan = bind_pretraining(SplitPlan.from_dict(self.cfg.plan) if self.cfg.plan else default_plan(self.cfg.preset),
                                self.provenance, self.corpus)
        return plan, plan_blocks(self.corpus, self.tokenizer, plan, data_dir=self.cfg.data_dir)

    def _blocks_record(self) -> dict:
        """What config.json records of the blocks (shapes and content hashes; part of the setup key)."""
        return {r: {"shape": list(b.shape), "sha256_16": tensor_hash(b)} for r, b in self.blocks.items()}

    def _default_layers(self) -> list[int]:
        return list(default_layers(self.model))

    def base_model(self):
        """A fresh copy of the pristine base model (stages modify models in place)."""
        return copy.deepcopy(self.model)

    @property
    def kernel_methods(self) -> list[str]:
        return [m for m in self.cfg.methods if m != REFERENCE]

    # ------------------------------------------------------------------------------------------------ stages

    def stage(self, name: str, deps: dict, outputs, fn, inputs=(), run: bool = True, parallel: bool = False) -> bool:
        """Run `fn()` unless `name` already finished with the same key and its outputs verify; True when complete.

        The key hashes `deps` (the configuration the stage reads) and the SHA256 of `inputs` (files of the run
        directory it reads). `outputs` (files or folders) are hashed into the marker. With `run=False` the key is
        computed and checked but nothing runs (False when the stage is not complete). Under a launch of several
        processes the main process decides; `fn` runs on every process when `parallel` (it then writes on the main
        process only), else on the main process alone.
        """

        def check():
            read = self.log.outputs_hash(inputs)
            key = config_hash({"stage": name, **deps, "inputs": read})
            return read, key, self.log.done(name, key)

        read, key, done = self.ranks.on_main(check)
        self.keys[name] = key
        if done:
            self.skipped.append(name)
            self.console.print(f"[dim]skip {name}: already done for this configuration[/dim]")
            return True
        if not run:
            return False
        self.console.rule(f"[bold]{name}")
        with Timer() as t:
            fn() if parallel else self.ranks.on_main(fn)
        self.ranks.on_main(lambda: self.log.mark(name, key, t.seconds, outputs=outputs, inputs=read))
        self.ran.append(name)
        if self.stop_after == name:
            raise _Stop(name)
        return True

    def kernel_files(self, method: str, root: Path | None = None) -> list[str]:
        """`method`'s kernel files (under `root`: the run directory by default, or candidates/), relative to the run
        directory (none for the softmax reference)."""
        if method == REFERENCE:
            return []
        d = kernel_dir(root or self.dir, method).relative_to(self.dir)
        return [str(d / KERNELS_FILE), str(d / META_FILE)]

    def analyze(self) -> bool:
        if not any(m in NEEDS_GROUPS for m in self.cfg.methods):
            return True
        deps = {"setup": self.keys["setup"], "grouping": self.cfg.grouping, "seed": self.cfg.seed}

        def fn():
            analyze(self.model, self.tokenizer, self.blocks["grouping"], self.layers, self.dir,
                    **self._analysis_inputs(), seed=self.cfg.seed, console=self.console, **self.cfg.grouping)

        return self.stage("analyze", deps, ["groups.json"], fn)

    def _analysis_inputs(self) -> dict:
        """Held-out prompts and one long sequence: the App. A.3 stability checks (Fig. 6, Table 4)."""
        extra = analysis_inputs(self.corpus, self.tokenizer, self.plan, data_dir=self.cfg.data_dir)
        return {"heldout": extra["heldout"], "long_sequence": extra["long_sequence"]}

    def _calib_config(self):
        return CalibConfig(**{**self.cfg.calib, "seed": self.cfg.seed})

    def kernel_dir(self, method: str) -> Path:
        return kernel_dir(self.dir, method)

    def calibrate(self) -> bool:
        methods = self.kernel_methods
        if not methods:
            return True
        deps = {"setup": self.keys["setup"], "calib": self.cfg.calib, "methods": methods, "seed": self.cfg.seed}
        if versions := newer_versions(methods):  # kernels of an older construction are recalibrated
            deps["versions"] = versions
        root = self.calib_root.relative_to(self.dir)
        outputs = [str(root / "calibration.json")] + [f for m in methods for f in self.kernel_files(m, self.calib_root)]
        inputs = ["groups.json"] if "oal" in methods else []
        return self.stage("calibrate", deps, outputs, lambda: self._calibrate(methods), inputs=inputs, parallel=True)

    def _calibrate(self, methods: list[str]) -> None:
        """On every process of a launch: each calibrates its share of the layers, the main process writes."""
        cfg = self._calib_config()
        groups = load_groups(self.dir) if "oal" in methods else {}
        # per-layer checkpoints, bound to this stage's key: a kill mid-stage resumes at the next layer; the layers
        # still to do are captured in one forward per block (DIR/.oal/capture, removed when done; the other
        # processes of a launch capture their layers into a temporary folder outside the run directory)
        checkpoints = LayerCheckpoints(self.dir, self.keys["calibrate"])
        capture = OnePassCapture(self.model, self.blocks, self.layers, self.dir / ".oal" / "capture",
                                 config_hash({"setup": self.keys["setup"], "layers": self.layers}),
                                 progress=self.progress)
        per_method, report = calibrate_layers(
            methods, self.layers, capture, groups=groups, cfg=cfg, seed=self.cfg.seed, checkpoints=checkpoints,
            progress=self.progress, console=self.console, ranks=self.ranks)
        stats = capture.gathered_stats(self.ranks)
        capture.remove()
        if self.ranks.is_main:
            write_calibration(self.calib_root, per_method, report, cfg, model=self.model,
                              base_model=str(self.cfg.model), provenance=self.provenance,
                              extra={"seed": self.cfg.seed}, capture=stats)
            checkpoints.clear()

    def select(self) -> bool:
        """`--layers auto:K`: rank the calibrated candidates (oal.selection), write the K best layers' kernels where
        a run keeps its kernels, and convert only those from here on."""
        if not self.cfg.select:
            return True
        method = "oal" if "oal" in self.kernel_methods else self.kernel_methods[0]
        deps = {"setup": self.keys["setup"], "select": self.cfg.select, "method": method,
                "batch": self.cfg.eval_batch_size}
        path = self.dir / SELECTION_FILE

        def fn():
            candidates = {m: load_kernels(kernel_dir(self.calib_root, m))[0] for m in self.kernel_methods}
            sel = select_layers(self.model, candidates[method], **self.cfg.select,
                                fidelity_blocks=self.blocks["calib_val"], val_blocks=self.blocks["val"],
                                paper_layers=self._default_layers(), batch_size=self.cfg.eval_batch_size,
                                progress=self.progress)
            for m, ms in candidates.items():
                save_kernels({i: ms[i] for i in sel["chosen"]}, self.kernel_dir(m), base_model=str(self.cfg.model),
                             provenance=self.provenance, fingerprint=model_fingerprint(self.model),
                             extra={"method": m, "seed": self.cfg.seed, "selected_from": sel["candidates"]})
            atomic_write_json(path, {**sel, "method": method})

        done = self.stage("select", deps, [SELECTION_FILE] + [f for m in self.kernel_methods
                                                               for f in self.kernel_files(m)], fn,
                          inputs=[f for m in self.kernel_methods for f in self.kernel_files(m, self.calib_root)])
        self.layers = load_json(path)["chosen"]
        return done

    def compare(self, run: bool = True) -> bool:
        """`--layers auto:K`: the selection's top paper-K layers against the paper's range, each adapted with the
        selection's method and measured on the test blocks (a layer set equal to the converted one reuses its arm)."""
        if not self.cfg.select:
            return True
        sel = load_json(self.dir / SELECTION_FILE)
        method, complete = sel["method"], True
        for tag, layers in comparison_sets(sel).items():
            if layers == self.layers:
                continue
            processes = self.ranks.size if run else 1
            deps = {"setup": self.keys["setup"], "select": self.keys["select"], "layers": layers,
                    "adapt": adapt_identity(self.cfg.adapt_config(method), processes),
                    "batch": self.cfg.eval_batch_size}
            path = self.dir / ".oal" / f"compare_{tag}.json"

            def fn(layers=layers, tag=tag, path=path):
                candidates, _ = load_kernels(kernel_dir(self.calib_root, method))
                model = convert(self.base_model(), layers, {i: candidates[i] for i in layers})
                before = block_nll(model, self.blocks["test"], batch_size=self.cfg.eval_batch_size)
                ckpt = self.dir / ".oal" / "checkpoints" / f"compare-{tag}"
                peft_model, _ = adapt(model, self.blocks["adapt_train"], self.blocks["val"],
                                      self.cfg.adapt_config(method), ckpt_dir=ckpt, progress=self.progress,
                                      description=f"adapt {method} {tag}")
                after = block_nll(peft_model, self.blocks["test"], batch_size=self.cfg.eval_batch_size)
                if self.ranks.is_main:  # every process trained the same tensors (DDP, as in `adapt`); one writes
                    atomic_write_json(path, {"layers": layers, "ppl_no_adapt": math.exp(before[0] / before[1]),
                                             "ppl": math.exp(after[0] / after[1])})
                    shutil.rmtree(ckpt, ignore_errors=True)

            complete &= self.stage(f"compare:{tag}", deps, [str(path.relative_to(self.dir))], fn,
                                   inputs=self.kernel_files(method, self.calib_root), run=run, parallel=True)
        return complete

    def _selection_metrics(self, valid, results: dict) -> dict | None:
        """selection.json with the comparison at the paper's K; a layer set equal to the converted one takes its
        arm's perplexities from `results` (this run's metrics, already read from the stage outputs)."""
        if not (self.cfg.select and valid("select")):
            return None
        sel = load_json(self.dir / SELECTION_FILE)
        m, comparison = sel["method"], {}
        for tag, layers in comparison_sets(sel).items():
            if layers == self.layers and m in results["perplexity"] and m in results["perplexity_no_adapt"]:
                comparison[tag] = {"layers": layers, "ppl_no_adapt": results["perplexity_no_adapt"][m],
                                   "ppl": results["perplexity"][m]}
            elif layers != self.layers and valid(f"compare:{tag}"):
                comparison[tag] = load_json(self.dir / ".oal" / f"compare_{tag}.json")
        return {**sel, "comparison": comparison}

    def load_methods(self, method: str) -> dict:
        methods, _ = load_kernels(self.kernel_dir(method))
        return methods

    def evaluation(self, name: str, path: str, compute) -> bool:
        """A stage over every kernel method's files: `compute(methods)` -> the JSON written to `path` (relative)."""
        methods = self.kernel_methods
        if not methods:
            return True
        deps = {"setup": self.keys["setup"], "methods": methods}
        return self.stage(name, deps, [path], lambda: atomic_write_json(self.dir / path, compute(methods)),
                          inputs=[f for m in methods for f in self.kernel_files(m)])

    def fidelity(self) -> bool:
        def compute(methods):
            ids, kwargs = self._fidelity_data()
            return fidelity(self.model, ids, {m: self.load_methods(m) for m in methods}, self.layers,
                            progress=self.progress, **kwargs)

        return self.evaluation("fidelity", FIDELITY_FILE, compute)

    def _fidelity_data(self) -> tuple:
        """(held-out token blocks on the model's device, extra keyword arguments of `evaluate.fidelity`)."""
        return self.blocks["fidelity"].to(self.device), {}

    def regime(self) -> bool:
        """Softmax's attention regime on the held-out fidelity blocks, and where the calibrated quadratic kernels sit
        beyond their vertex (regime.json)."""
        def compute(methods):
            res = attention_regime(self.model, self.blocks["fidelity"].to(self.device), self.layers,
                                   kernels={m: self.load_methods(m) for m in methods})
            self.console.print(f"attention regime: this model is {res['verdict']['text']}")
            return res

        return self.evaluation("regime", REGIME_FILE, compute)

    def budget(self) -> bool:
        """Fig. 2(b)'s group-budget curve for the first converted layer's head 0, beside App. B's choice."""
        if "oal" not in self.cfg.methods:
            return True
        deps = {"setup": self.keys["setup"], "calib": self.cfg.calib, "seed": self.cfg.seed,
                "budgets": list(RUN_BUDGETS)}
        return self.stage("budget", deps, [BUDGET_FILE], lambda: run_budget(
            self.model, self.blocks, self.dir / "groups.json", self.layers[0], 0, self._calib_config(), self.dir),
            inputs=["groups.json"])

    def model_for(self, method: str):
        """Base model with `method`'s calibrated kernels in the converted layers (softmax: the base model)."""
        model = self.base_model()
        if method != REFERENCE:
            convert(model, self.layers, self.load_methods(method))
        return model

    def adapt(self, method: str, run: bool = True) -> bool:
        # the number of processes sets the global batch (batch_size x processes x grad_accum), so it is part of the
        # key: this launch's for an arm that runs now, the recorded one for an arm that is only checked
        processes = self.ranks.size if run else self._trained_processes(method)
        deps = {"setup": self.keys["setup"], "adapt": adapt_identity(self.cfg.adapt_config(method), processes),
                "method": method}
        out = self.dir / "adapter" / method
        ckpt = self.dir / ".oal" / "checkpoints" / method

        def fn():
            # the base copy is frozen; kernel parameters keep their own requires_grad (trainable ones train
            # jointly with LoRA, App. F.2; fixed random features stay fixed)
            model = self.model_for(method)
            if checkpoint_layers(self.device, self.blocks["adapt_train"].shape[1]):
                enable_layer_checkpointing(model)  # N=4096 on a CPU: recompute layers rather than store them
            peft_model, result = adapt(model, self.blocks["adapt_train"], self.blocks["val"],
                                       self.cfg.adapt_config(method), ckpt_dir=ckpt, progress=self.progress,
                                       description=f"adapt {method}")
            if self.ranks.is_main:  # every process holds the same tensors; one writes them
                save_adapter(peft_model, out, result)
                shutil.rmtree(ckpt, ignore_errors=True)

        return self.stage(f"adapt:{method}", deps, [f"adapter/{method}"], fn, inputs=self.kernel_files(method),
                          run=run, parallel=True)

    def _trained_processes(self, method: str) -> int:
        """How many processes trained `method`'s adapter on disk (its adapt.json; 1 when unknown)."""
        try:
            return int(load_json(self.dir / "adapter" / method / "adapt.json").get("processes", 1))
        except (ValueError, TypeError, AttributeError):
            return 1

    def perplexity(self, method: str, adapted: bool, run: bool = True) -> bool:
        name = f"perplexity:{method}" if adapted else f"perplexity_no_adapt:{method}"
        deps = {"setup": self.keys["setup"], "method": method, "batch": self.cfg.eval_batch_size}
        inputs = self.kernel_files(method) + ([f"adapter/{method}"] if adapted else [])
        path = self.dir / ".oal" / f"{name.replace(':', '_')}.json"

        def fn():
            model = self.model_for(method)
            if adapted:
                model = load_adapter(model, self.dir / "adapter" / method)
            total, count = block_nll(model, self.blocks["test"], batch_size=self.cfg.eval_batch_size,
                                     progress=self.progress, description=name)
            atomic_write_json(path, {"nll_sum": total, "tokens": count, "ppl": math.exp(total / count)})

        return self.stage(name, deps, [str(path.relative_to(self.dir))], fn, inputs=inputs, run=run)

    def zeroshot_sets(self) -> dict:
        """The selected zero-shot tasks' examples (loaded once). A task whose data is unavailable is skipped with
        one line saying how to provide it; a bad folder or file raises ValueError here, before any training."""
        if self._zeroshot is None:
            self._zeroshot, self.zeroshot_skipped = load_tasks(
                self.cfg.zeroshot_tasks, data_dir=self.cfg.zeroshot_dir, task_files=self.cfg.zeroshot_files,
                limit=self.cfg.zeroshot_limit)
            for reason in self.zeroshot_skipped.values():
                self.console.print(f"[yellow]skip zero-shot {reason}[/yellow]")
        return self._zeroshot

    def zeroshot(self, method: str, run: bool = True) -> bool:
        """PIQA / HellaSwag / ARC-E (App. F.3) on the selected (adapted) checkpoint of `method`."""
        sets = self.zeroshot_sets()
        if not sets:
            return True
        data = {t: {k: v for k, v in prov.items() if k != "path"} for t, (_, prov) in sets.items()}
        deps = {"setup": self.keys["setup"], "method": method, "data": data}
        inputs = self.kernel_files(method) + [f"adapter/{method}"]
        path = self.dir / ".oal" / f"zeroshot_{method}.json"

        def fn():
            model = load_adapter(self.model_for(method), self.dir / "adapter" / method)
            res = evaluate_tasks(model, self.tokenizer, sets, progress=self.progress,
                                 description=f"zeroshot:{method}")
            atomic_write_json(path, {"tasks": res, "data": {t: prov for t, (_, prov) in sets.items()}})

        return self.stage(f"zeroshot:{method}", deps, [str(path.relative_to(self.dir))], fn, inputs=inputs, run=run)

    def stages(self, arms: list[str] | None = None) -> None:
        """Every stage after setup, in order; `arms`: see `run_seed`."""
        self.zeroshot_sets()  # fail on a bad data folder now, not after training
        self.analyze()
        self.calibrate()
        self.select()
        self.fidelity()
        self.regime()
        self.budget()
        for m in self.cfg.methods:
            active = arms is None or m in arms
            self.perplexity(m, adapted=False, run=active)
            if self.adapt(m, run=active):
                self.perplexity(m, adapted=True, run=active)
                self.zeroshot(m, run=active)
        self.compare(run=arms is None)

    # ------------------------------------------------------------------------------------------------ metrics

    def metrics(self) -> dict:
        """metrics.json: `results` of the stages that verify, the SHA256 of the files they read, time per stage."""
        used = []  # stages whose numbers are reported: their input files' SHA256 go into metrics.json

        def valid(stage):
            ok = stage in self.keys and self.log.done(stage, self.keys[stage])
            if ok:
                used.append(stage)
            return ok

        out = self.results(valid)
        out["sha256"] = {f: h for s in used for f, h in self.log.stages[s].get("inputs", {}).items()}
        out["sha256"]["config.json"] = self.log.stages["setup"]["sha256"]["config.json"]
        out["elapsed_s"] = {k: v for k, v in self.log.elapsed().items() if k != "report"}
        return out

    def results(self, valid) -> dict:
        """The numbers of metrics.json, each read from a stage's output when `valid(stage)`."""
        out = {"model": str(self.cfg.model), "converted_layers": self.layers, "seed": self.cfg.seed,
               "methods": self.cfg.methods, "fidelity": {}, "perplexity": {}, "perplexity_no_adapt": {},
               "adapt": {}}
        if valid("fidelity"):
            out["fidelity"] = load_json(self.dir / FIDELITY_FILE)
        for m in self.cfg.methods:
            for key, prefix in (("perplexity", "perplexity"), ("perplexity_no_adapt", "perplexity_no_adapt")):
                if valid(f"{prefix}:{m}"):
                    out[key][m] = load_json(self.dir / ".oal" / f"{prefix}_{m}.json")["ppl"]
            if valid(f"adapt:{m}"):
                res = load_json(self.dir / "adapter" / m / "adapt.json")
                out["adapt"][m] = {k: res[k] for k in ("best_step", "best_val_nll", "steps", "n_lora_params",
                                                        "n_kernel_params", "kernel_change", "processes",
                                                        "global_batch") if k in res}
        for m in self.cfg.methods:
            if valid(f"zeroshot:{m}"):
                res = load_json(self.dir / ".oal" / f"zeroshot_{m}.json")
                merge_metrics(out, m, res["tasks"], res["data"], {})
        if self.zeroshot_skipped:
            out["zeroshot_skipped"] = dict(self.zeroshot_skipped)
        selection = self._selection_metrics(valid, out)
        if selection is not None:
            out["selection"] = selection
        return out

    # ------------------------------------------------------------------------------------------------ reports

    @staticmethod
    def report(run_dir: Path, console: Console) -> None:
        write_report(run_dir, console=console)

    @staticmethod
    def aggregate(per_seed: dict[int, dict]) -> dict:
        return aggregate_seeds(per_seed)

    @staticmethod
    def summary(metrics: dict) -> Table:
        return summary_table(metrics)


def run_class(cfg: RunConfig) -> type[Run]:
    """The protocol of `cfg.model`: `EncoderRun` for a local BERT-family encoder folder, `Run` otherwise."""
    if is_encoder_model(cfg.model):
        from .encoder_pipeline import EncoderRun

        if cfg.select:
            raise InputError("layer selection (auto:K) is for causal LMs; give encoder layers explicitly", "--layers",
                             "layers")

        return EncoderRun
    return Run


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
             stop_after: str | None = None, force: bool = False, arms: list[str] | None = None,
             allow_changes: tuple[str, ...] = ()) -> dict:
    """All stages for one seed; returns metrics.json's content.

    `arms`: run the adapt/perplexity stages of these methods only (the others are reported when their recorded
    outputs verify); `force`/`allow_changes`: see `Run`. metrics.json and report.md are always rewritten from the
    stage outputs, so they describe exactly the files on disk.
    """
    r = run_class(cfg)(cfg, out_dir, console=console, progress=progress, stop_after=stop_after, force=force,
                       allow_changes=allow_changes)
    try:
        r.setup()
        r.stages(arms)
    except _Stop:
        return {}

    def finish():  # the main process writes; every process returns the same metrics
        metrics = r.metrics()
        atomic_write_json(r.dir / "metrics.json", metrics)
        with Timer() as t:
            r.report(r.dir, r.console)
        r.log.mark("report", config_hash(metrics), t.seconds, outputs=["report.md"])
        metrics["elapsed_s"]["report"] = round(t.seconds, 3)
        atomic_write_json(r.dir / "metrics.json", metrics)
        return metrics

    return r.ranks.on_main(finish)


def adapt_arm(out_dir: str | Path, method: str, *, steps: int | None = None, device: str | None = None,
              dtype: str | None = None, console: Console | None = None, progress: bool = True,
              batch_size: int | None = None, grad_accum: int | None = None,
              lora_dropout: float | None = None) -> dict:
    """`oal adapt`: (re)adapt one arm of an existing single-seed run, optionally with other adaptation settings
    (`steps`, `batch_size`, `grad_accum`, `lora_dropout`; recorded in config.json as that arm's `adapt_overrides`).
    Its adapt and perplexity stages rerun when their keys changed, and metrics.json and report.md are rewritten, so
    they describe the adapter now on disk. Returns the new metrics (on every process of a launch)."""
    out_dir = check_out_dir(out_dir)
    group = ranks(process_device(device or "auto"))
    settings = {k: v for k, v in (("steps", steps), ("batch_size", batch_size), ("grad_accum", grad_accum),
                                  ("lora_dropout", lora_dropout)) if v is not None}
    d = group.on_main(lambda: _arm_config(out_dir, method, dtype, settings))
    if device is not None:
        d["device"] = device  # a runtime choice, not part of the run's configuration
    cfg = RunConfig.from_dict(d)
    return run_seed(cfg, out_dir, console=console, progress=progress, arms=[method],
                    allow_changes=("config.adapt_overrides", "config.methods"))


def _arm_config(out_dir: Path, method: str, dtype: str | None, settings: dict) -> dict:
    """The run configuration of `oal adapt`: the recorded one, with `method`'s arm and its adapt `settings`."""
    cfg_path = out_dir / "config.json"
    if not cfg_path.is_file():
        raise InputError(f"{out_dir} has no config.json; run `oal run --out {out_dir}` first", "--out", "out_dir")
    config = load_json(cfg_path)
    if not isinstance(config, dict) or not isinstance(config.get("config"), dict):
        raise ValueError(f"{cfg_path}: damaged, expected a run configuration")
    parent = out_dir.parent / "config.json"
    if "seeds" in config or (out_dir.name.startswith("seed-") and parent.is_file() and "seeds" in load_json(parent)):
        raise InputError(f"{out_dir} is (part of) a multi-seed run, whose aggregate would then mix settings; rerun "
                         "all seeds with `oal run --seeds ... --steps N` instead", "--out", "out_dir")
    if config.get("protocol") == "encoder":
        raise InputError(f"{out_dir} is an encoder run; adaptation is implemented for causal LMs only", "--out",
                         "out_dir")
    d = dict(config["config"])
    if method not in d["methods"]:
        if method != REFERENCE:
            raise InputError(f"{out_dir} has no calibrated kernels for {method!r}; run `oal run --out {out_dir} "
                             f"--methods ...,{method}` first", "--method", "method")
        d["methods"] = [*d["methods"], method]
    if dtype is not None and dtype != d.get("dtype", "float32"):
        raise InputError(f"the run was made with dtype {d.get('dtype', 'float32')}, not {dtype}", "--dtype", "dtype")
    if settings:
        overrides = dict(d.get("adapt_overrides") or {})
        overrides[method] = {**overrides.get(method, {}), **settings}
        d["adapt_overrides"] = overrides
    RunConfig.from_dict(d)  # a bad setting (e.g. lora_dropout 1.5) fails here, on the main process, for every one
    return d


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
    for m, tasks in first.get("zeroshot", {}).items():
        for t, row in tasks.items():
            per = [per_seed[s].get("zeroshot", {}).get(m, {}).get(t) for s in seeds]
            if all(per):
                mean_std = {k: _mean_std([p[k] for p in per]) for k in row if k != "n"}
                out.setdefault("zeroshot", {}).setdefault(m, {})[t] = {k: v[0] for k, v in mean_std.items()} | {
                    "n": row["n"]}
                out.setdefault("zeroshot_std", {}).setdefault(m, {})[t] = {k: v[1] for k, v in mean_std.items()}
    for key in ("zeroshot_data", "zeroshot_skipped"):
        if key in first:
            out[key] = first[key]
    out["adapt"] = first.get("adapt", {})  # curves and selection of the first seed (see per_seed for the rest)
    out["elapsed_s"] = {}
    for s in seeds:
        for stage, sec in per_seed[s]["elapsed_s"].items():
            out["elapsed_s"][stage] = out["elapsed_s"].get(stage, 0.0) + sec
    return out


def run(cfg: RunConfig, out_dir: str | Path, seeds: list[int] | None = None, *, console: Console | None = None,
        progress: bool = True, force: bool = False) -> dict:
    """`oal run`: one seed writes DIR directly; several seeds write DIR/seed-<s>/ and aggregate into DIR.

    DIR keeps one configuration and one layout (single or multi-seed): anything else is refused unless `force`.
    A local BERT-family encoder folder runs the encoder protocol (`oal.encoder_pipeline.EncoderRun`).
    """
    out_dir = check_out_dir(out_dir)
    group = ranks(process_device(cfg.device))
    console = (console or Console()) if group.is_main else Console(quiet=True)  # the main process reports
    seeds = seeds or [cfg.seed]
    protocol = run_class(cfg)
    group.on_main(lambda: multi_seed_layout(out_dir, seeds, force=force))
    if len(seeds) == 1:
        metrics = run_seed(cfg.with_seed(seeds[0]), out_dir, console=console, progress=progress, force=force)
    else:
        group.on_main(lambda: clean_tmp(out_dir))
        per_seed = {}
        for s in seeds:
            console.rule(f"[bold]seed {s}")
            per_seed[s] = run_seed(cfg.with_seed(s), out_dir / f"seed-{s}", console=console, progress=progress,
                                   force=force)
        metrics = group.on_main(lambda: _write_aggregate(protocol, out_dir, seeds, per_seed, console))
    console.print(protocol.summary(metrics))
    return metrics


def _write_aggregate(protocol: type[Run], out_dir: Path, seeds: list[int], per_seed: dict[int, dict],
                     console: Console) -> dict:
    """The multi-seed aggregate of `protocol`: metrics.json, config.json and report.md of DIR (main process)."""
    metrics = protocol.aggregate(per_seed)
    metrics["sha256"] = {f"seed-{s}/metrics.json": sha256_file(out_dir / f"seed-{s}" / "metrics.json")
                         for s in seeds}
    config = load_json(out_dir / f"seed-{seeds[0]}" / "config.json")
    atomic_write_json(out_dir / "config.json", {**config, "seeds": list(seeds)})
    atomic_write_json(out_dir / "metrics.json", metrics)
    protocol.report(out_dir, console)
    return metrics


def summary_table(metrics: dict) -> Table:
    """methods x (fidelity, PPL, zero-shot) for the terminal."""
    multi = "perplexity_std" in metrics
    tasks = [t for t in DISPLAY_NAMES if any(t in z for z in metrics.get("zeroshot", {}).values())]
    table = Table(title=f"oal run: {metrics.get('model')} (layers {metrics.get('converted_layers')})",
                  caption="PIQA / HellaSwag / ARC-E: zero-shot acc_norm %" if tasks else None)
    for col in ("method", "RelMSE", "RelMSE post-o", "PPL no adapt", "PPL (LoRA)", *(DISPLAY_NAMES[t] for t in tasks)):
        table.add_column(col, justify="right")
    for m in metrics.get("methods", []):
        f = metrics.get("fidelity", {}).get(m, {})
        ppl = metrics.get("perplexity", {}).get(m)
        cell = "-" if ppl is None else f"{ppl:.3f}"
        if multi and ppl is not None:
            cell += f" ± {metrics['perplexity_std'][m]:.3f}"
        pre = metrics.get("perplexity_no_adapt", {}).get(m)
        z = metrics.get("zeroshot", {}).get(m, {})
        table.add_row(m, f"{f['relmse']:.4f}" if "relmse" in f else "-",
                      f"{f['relmse_post_o']:.4f}" if "relmse_post_o" in f else "-",
                      "-" if pre is None else f"{pre:.3f}", cell,
                      *(f"{z[t]['acc_norm']:.2f}" if t in z else "-" for t in tasks))
    return table


def run_selection(cfg: RunConfig, out_dir: str | Path, *, console: Console | None = None, progress: bool = True,
                  force: bool = False) -> dict:
    """`oal select-layers`: the stages of `oal run --layers auto:K` up to the layer selection (selection.json); `oal
    run` with the same options continues from there."""
    if not cfg.select:
        raise InputError("expected a layer selection such as auto:2", "--k", "select")
    r = Run(cfg, out_dir, console=console, progress=progress, force=force)
    r.setup()
    r.analyze()
    r.calibrate()
    r.select()
    return load_json(r.dir / SELECTION_FILE)
