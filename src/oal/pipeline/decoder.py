"""The stages of `oal run`, resumable from the run directory (design.md "run directory and metrics").

    setup -> analyze -> calibrate -> [scores -> curve:<by> -> select] -> fidelity -> regime -> budget -> adapt:<method>
          -> perplexity:<method> -> zeroshot:<method> -> [compare:<layers>] -> report

The bracketed stages run with `--layers auto:K` only (`pipeline.selection`): every layer is calibrated into candidates/,
`scores` scores every candidate by both criteria, `curve:<by>` draws the criterion's curve, `select` keeps the K best
and writes their kernels where a fixed range would have them, and `compare` adapts the paper's range and the
criterion's top layers at the paper's K for the report. Another K or criterion (`SELECTION_KEYS`) reuses the
calibration and the scores: the stages that read the chosen layers' kernels rerun, as their inputs' SHA256 changed.
`regime` measures softmax's attention regime and where the calibrated kernels sit beyond their vertex; `budget`
draws Fig. 2(b)'s group-budget curve beside App. B's choice.

The stage mechanism (keys, skipping, records, metrics from verified stages only) is `pipeline.base.StagedRun`'s;
the encoder protocol (`pipeline.encoder.EncoderRun`) subclasses this one.
"""

from __future__ import annotations

import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

from oal.adaptation.adapter import load_adapter, save_adapter
from oal.adaptation.config import adapt_identity
from oal.adaptation.train import adapt
from oal.analysis import analysis_inputs, analyze, load_groups
from oal.analysis.regime import REGIME_FILE, attention_regime
from oal.calibration.data import CalibConfig
from oal.calibration.kernels import adaptation_start, kernel_dir, load_kernels, model_fingerprint, save_kernels
from oal.calibration.resume import LayerCheckpoints, OnePassCapture, calibrate_layers, write_calibration
from oal.data import SplitPlan, bind_pretraining, default_plan, load_corpus, plan_blocks
from oal.data.zeroshot import skip_lines
from oal.device import checkpoint_layers, enable_layer_checkpointing, resolve_dtype
from oal.diagnostics.budget import BUDGET_FILE, RUN_BUDGETS, run_budget
from oal.evaluate.fidelity import fidelity
from oal.evaluate.perplexity import block_nll
from oal.evaluate.zeroshot import SCORING_VERSION, evaluate_tasks, load_tasks, merge_metrics
from oal.methods.base import get_method, newer_versions
from oal.models.convert import convert
from oal.models.registry import default_layers, load_model, representative_head, table_layers
from oal.pipeline.aggregate import aggregate_seeds, summary_table
from oal.pipeline.base import FIDELITY_FILE, REFERENCE, StagedRun
from oal.pipeline.records import selection_record
from oal.pipeline.report import write_report
from oal.pipeline.selection import choose_layers, comparison_sets, criterion_curve, score_layers
from oal.rundir.files import atomic_write_json, load_json, remove
from oal.rundir.hashes import config_hash, tensor_hash
from oal.rundir.metrics import drop_evaluations

__all__ = ["NEEDS_GROUPS", "Run", "SELECTION_FILE"]

SELECTION_FILE = "selection.json"
SCORES_FILE = ".oal/layer_scores.json"  # --layers auto:K: the candidates' scores (`selection.score_layers`)
NEEDS_GROUPS = ("oal", "oal-swa")  # methods that need stable-gap groups


class Run(StagedRun):
    """One seed's run directory and the lazily loaded model, corpus and token blocks (the decoder protocol).

    Another protocol (`pipeline.encoder.EncoderRun`) subclasses it and overrides the hooks: `_load_model`,
    `_plan_blocks`, `_blocks_record`, `_analysis_inputs`, `_fidelity_data`, `stages`, `results`, `report`,
    `aggregate`, `summary`; setup, the stage mechanism, calibration and provenance stay here.
    """

    protocol: str | None = None  # recorded in config.json when set (the decoder protocol records none)


    # ------------------------------------------------------------------------------------------------ loading

    def _load_model(self):
        # the base model in cfg.dtype, kernels/LoRA/calibration in fp32
        return load_model(self.cfg.model, dtype=resolve_dtype(self.cfg.dtype), device=self.device)

    def _plan_blocks(self) -> tuple:
        """(split plan, {role: token blocks [S, N]}) from the corpus."""
        plan = bind_pretraining(SplitPlan.from_dict(self.cfg.plan) if self.cfg.plan else default_plan(self.cfg.preset),
                                self.provenance, self.corpus)
        # the other corpora the plan reads (the paper's: WikiText-2 beside WikiText-103), kept for config.json
        named = {bs.corpus for bs in plan.roles().values() if bs.corpus not in (None, self.corpus.name)}
        self.other_corpora = {name: load_corpus(name, data_dir=self.cfg.data_dir) for name in sorted(named)}
        corpora = {None: self.corpus, self.corpus.name: self.corpus, **self.other_corpora}
        return plan, plan_blocks(corpora, self.tokenizer, plan, data_dir=self.cfg.data_dir)

    def _blocks_record(self) -> dict:
        """What config.json records of the blocks (shapes and content hashes; part of the setup key)."""
        return {r: {"shape": list(b.shape), "sha256_16": tensor_hash(b)} for r, b in self.blocks.items()}

    def _default_layers(self) -> list[int]:
        return list(default_layers(self.model))



    # ------------------------------------------------------------------------------------------------ stages

    def analyze(self) -> bool:
        if not any(m in NEEDS_GROUPS for m in self.cfg.methods):
            return True
        deps = {"setup": self.keys["setup"], "grouping": self.cfg.grouping, "seed": self.cfg.seed}
        rep = self._representative(deps)

        def fn():
            analyze(self.model, self.tokenizer, self.blocks["grouping"], self.layers, self.dir,
                    **self._analysis_inputs(), seed=self.cfg.seed, console=self.console, representative=rep,
                    progress=self.progress, **self.cfg.grouping)

        return self.stage("analyze", deps, ["groups.json", "analysis.json"], fn)  # the report reads both

    def _analysis_inputs(self) -> dict:
        """Held-out prompts and one long sequence: the App. A.3 stability checks (Fig. 6, Table 4)."""
        extra = analysis_inputs(self.corpus, self.tokenizer, self.plan, data_dir=self.cfg.data_dir)
        return {"heldout": extra["heldout"], "long_sequence": extra["long_sequence"]}

    def _calib_config(self):
        return CalibConfig(**{**self.cfg.calib, "seed": self.cfg.seed})

    def calibrate(self) -> bool:
        methods = self.kernel_methods
        if not methods:
            return True
        deps = {"setup": self.keys["setup"], "calib": self.cfg.calib, "methods": methods, "seed": self.cfg.seed,
                **self.cfg.method_options()}
        if versions := newer_versions(methods):  # kernels of an older construction are recalibrated
            deps["versions"] = versions
        root = self.calib_root.relative_to(self.dir)
        outputs = [str(root / "calibration.json")] + [f for m in methods for f in self.kernel_files(m, self.calib_root)]
        inputs = ["groups.json"] if any(m in NEEDS_GROUPS for m in methods) else []
        return self.stage("calibrate", deps, outputs, lambda: self._calibrate(methods), inputs=inputs, parallel=True)

    def _calibrate(self, methods: list[str]) -> None:
        """On every process of a launch: each calibrates its share of the layers, the main process writes."""
        cfg = self._calib_config()
        groups = load_groups(self.dir) if any(m in NEEDS_GROUPS for m in methods) else {}
        # per-layer checkpoints, bound to this stage's key: a kill mid-stage resumes at the next layer; the layers
        # still to do are captured in one forward per block (DIR/.oal/capture, removed when done; the other
        # processes of a launch capture their layers into a temporary folder outside the run directory)
        checkpoints = LayerCheckpoints(self.dir, self.keys["calibrate"])
        capture = OnePassCapture(self.model, self.blocks, self.layers, self.dir / ".oal" / "capture",
                                 config_hash({"setup": self.keys["setup"], "layers": self.layers}),
                                 progress=self.progress, record=checkpoints.capture_record)
        per_method, report = calibrate_layers(
            methods, self.layers, capture, groups=groups, cfg=cfg, seed=self.cfg.seed, checkpoints=checkpoints,
            progress=self.progress, console=self.console, ranks=self.ranks, options=self.cfg.method_options())
        stats = capture.gathered_stats(self.ranks)
        capture.remove()
        if self.ranks.is_main:
            write_calibration(self.calib_root, per_method, report, cfg, model=self.model,
                              base_model=str(self.cfg.model), provenance=self.provenance,
                              extra={"seed": self.cfg.seed}, capture=stats)
            checkpoints.clear()

    def select(self) -> bool:
        """`--layers auto:K`: rank the calibrated candidates (`pipeline.selection`), write the K best layers' kernels
        where a run keeps its kernels, and convert only those from here on. The scores and each criterion's curve
        are stages of their own, which depend on neither K nor (the scores) the criterion: another --k or --by
        reuses them."""
        if not self.cfg.select:
            return True
        method = "oal" if "oal" in self.kernel_methods else self.kernel_methods[0]
        # the key of runs made before the scores were a stage of their own: a finished selection stays finished
        deps = {"setup": self.keys["setup"], "select": self.cfg.select, "method": method,
                "batch": self.cfg.eval_batch_size}
        path = self.dir / SELECTION_FILE
        outputs = [SELECTION_FILE] + [f for m in self.kernel_methods for f in self.kernel_files(m)]
        inputs = [f for m in self.kernel_methods for f in self.kernel_files(m, self.calib_root)]
        if not self.stage("select", deps, outputs, None, inputs=inputs, run=False):
            scored, curve = self._layer_scores(method)

            def fn():
                sel = choose_layers(load_json(self.dir / scored), load_json(self.dir / curve), **self.cfg.select)
                for m in self.kernel_methods:
                    ms = load_kernels(kernel_dir(self.calib_root, m))[0]
                    save_kernels({i: ms[i] for i in sel["chosen"]}, self.kernel_dir(m), base_model=str(self.cfg.model),
                                 provenance=self.provenance, fingerprint=model_fingerprint(self.model),
                                 extra={"method": m, "seed": self.cfg.seed, "selected_from": sel["candidates"]})
                atomic_write_json(path, {**sel, "method": method})

            self.stage("select", deps, outputs, fn, inputs=inputs)
        self.layers = selection_record(path)["chosen"]
        return True

    def _layer_scores(self, method: str) -> tuple[str, str]:
        """The stages `scores` (both criteria for every candidate, the paper's curve) and `curve:<by>` (the
        criterion's curve); their files, relative to the run directory."""
        deps = {"setup": self.keys["setup"], "method": method, "batch": self.cfg.eval_batch_size}
        kernels = self.kernel_files(method, self.calib_root)
        scored, by = SCORES_FILE, self.cfg.select["by"]
        curve = f".oal/curve_{by}.json"

        def candidates():
            return load_kernels(kernel_dir(self.calib_root, method))[0]

        self.stage("scores", deps, [scored], lambda: atomic_write_json(self.dir / scored, score_layers(
            self.model, candidates(), fidelity_blocks=self.blocks["calib_val"], val_blocks=self.blocks["val"],
            paper_layers=self._default_layers(), batch_size=self.cfg.eval_batch_size, progress=self.progress)),
            inputs=kernels)
        self.stage(f"curve:{by}", {**deps, "by": by}, [curve], lambda: atomic_write_json(
            self.dir / curve, criterion_curve(self.model, candidates(), load_json(self.dir / scored), by,
                                              val_blocks=self.blocks["val"], batch_size=self.cfg.eval_batch_size,
                                              progress=self.progress)), inputs=[*kernels, scored])
        return scored, curve

    def compare(self, run: bool = True) -> bool:
        """`--layers auto:K`: the selection's top paper-K layers against the paper's range, each adapted with the
        selection's method and measured on the test blocks (a layer set equal to the converted one reuses its arm)."""
        if not self.cfg.select:
            return True
        sel = selection_record(self.dir / SELECTION_FILE)
        method, complete = sel["method"], True
        for tag, layers in comparison_sets(sel).items():
            if layers == self.layers:
                continue
            path = self.dir / ".oal" / f"compare_{tag}.json"
            # not rerun here (`oal adapt` of another arm): the processes that adapted it, as `_trained_processes`
            # (a record from before they were named there: the arm's, which the same launch adapted)
            processes = self.ranks.size if run else self._recorded_processes(path, self._trained_processes(method))
            # not the selection's key: another K or criterion that compares the same layers reuses the result
            deps = {"setup": self.keys["setup"], "method": method, "layers": layers,
                    "adapt": adapt_identity(self.cfg.adapt_config(method), processes),
                    "batch": self.cfg.eval_batch_size}

            def fn(layers=layers, tag=tag, path=path):
                candidates, _ = load_kernels(kernel_dir(self.calib_root, method))
                model = convert(self.base_model(), layers, {i: candidates[i] for i in layers})
                before = block_nll(model, self.blocks["test"], batch_size=self.cfg.eval_batch_size)
                starts = {i: adaptation_start(candidates[i]) for i in layers}  # as the arm's own (App. F.1)
                if any(starts[i] is not candidates[i] for i in layers):  # a baseline: at its initial values
                    model = convert(self.base_model(), layers, starts)
                ckpt = self.dir / ".oal" / "checkpoints" / f"compare-{tag}"
                peft_model, _ = adapt(model, self.blocks["adapt_train"], self.blocks["val"],
                                      self.cfg.adapt_config(method), ckpt_dir=ckpt, progress=self.progress,
                                      description=f"adapt {method} {tag}")
                after = block_nll(peft_model, self.blocks["test"], batch_size=self.cfg.eval_batch_size)
                if self.ranks.is_main:  # every process trained the same tensors (DDP, as in `adapt`); one writes
                    atomic_write_json(path, {"layers": layers, "ppl_no_adapt": math.exp(before[0] / before[1]),
                                             "ppl": math.exp(after[0] / after[1]), "processes": self.ranks.size})
                    remove(ckpt)

            complete &= self.stage(f"compare:{tag}", deps, [str(path.relative_to(self.dir))], fn,
                                   inputs=self.kernel_files(method, self.calib_root), run=run, parallel=True)
        return complete

    def _selection_metrics(self, valid, results: dict) -> dict | None:
        """selection.json with the comparison at the paper's K; a layer set equal to the converted one takes its
        arm's perplexities from `results` (this run's metrics, already read from the stage outputs)."""
        if not (self.cfg.select and valid("select")):
            return None
        sel = selection_record(self.dir / SELECTION_FILE)
        m, comparison = sel["method"], {}
        for tag, layers in comparison_sets(sel).items():
            if layers == self.layers and m in results["perplexity"] and m in results["perplexity_no_adapt"]:
                comparison[tag] = {"layers": layers, "ppl_no_adapt": results["perplexity_no_adapt"][m],
                                   "ppl": results["perplexity"][m]}
            elif layers != self.layers and valid(f"compare:{tag}"):
                comparison[tag] = load_json(self.dir / ".oal" / f"compare_{tag}.json")
        return {**sel, "comparison": comparison}

    def fidelity(self) -> bool:
        # the paper's Table 2 layers of the preset (Qwen2.5-0.5B: 4, 12, 20) get their own aggregate
        paper = table_layers(self.cfg.preset, self.layers)
        subsets = {"paper_layers": paper} if paper else {}

        def compute(methods):
            ids, kwargs = self._fidelity_data()
            return fidelity(self.model, ids, {m: self.load_methods(m) for m in methods}, self.layers,
                            progress=self.progress, subsets=subsets, **kwargs)

        return self.evaluation("fidelity", FIDELITY_FILE, compute, {"subsets": subsets} if subsets else None)

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

    def _representative(self, deps: dict) -> tuple[int, int]:
        """The paper's representative head of the preset (Qwen2.5-0.5B: layer 4, head 0), else the first converted
        layer's head 0; in `deps` where it is not the latter (so that the other presets' keys stay as they were)."""
        rep = representative_head(self.cfg.preset, self.layers)
        if rep != (self.layers[0], 0):
            deps["head"] = list(rep)
        return rep

    def budget(self) -> bool:
        """Fig. 2(b)'s group-budget curve for the representative head, beside App. B's choice."""
        if "oal" not in self.cfg.methods:
            return True
        deps = {"setup": self.keys["setup"], "calib": self.cfg.calib, "seed": self.cfg.seed,
                "budgets": list(RUN_BUDGETS)}
        layer, head = self._representative(deps)
        return self.stage("budget", deps, [BUDGET_FILE], lambda: run_budget(
            self.model, self.blocks, self.dir / "groups.json", layer, head, self._calib_config(), self.dir),
            inputs=["groups.json"])

    def model_for(self, method: str, *, for_adaptation: bool = False):
        """Base model with `method`'s calibrated kernels in the converted layers (softmax: the base model).
        `for_adaptation`: where LoRA starts (App. F.1-F.2): a baseline's trainable parameters at their initial
        values, OAL's and the learned global's calibrated."""
        model = self.base_model()
        if method != REFERENCE:
            methods = self.load_methods(method)
            if for_adaptation:
                methods = {i: adaptation_start(m) for i, m in methods.items()}
            convert(model, self.layers, methods)
        return model

    def adapt(self, method: str, run: bool = True) -> bool:
        # the number of processes sets the global batch (batch_size x processes x grad_accum), so it is part of the
        # key: this launch's for an arm that runs now, the recorded one for an arm that is only checked
        processes = self.ranks.size if run else self._trained_processes(method)
        deps = {"setup": self.keys["setup"], "adapt": adapt_identity(self.cfg.adapt_config(method), processes),
                "method": method}
        if method != REFERENCE and not get_method(method).adapts_from_calibration:
            deps["start"] = "initial"  # a baseline adapted from its calibrated kernels (before 2026-12-06) reruns
        out = self.dir / "adapter" / method
        ckpt = self.dir / ".oal" / "checkpoints" / method

        def fn():
            # the base copy is frozen; kernel parameters keep their own requires_grad (trainable ones train
            # jointly with LoRA, App. F.2; fixed random features stay fixed)
            model = self.model_for(method, for_adaptation=True)
            if checkpoint_layers(self.device, self.blocks["adapt_train"].shape[1]):
                enable_layer_checkpointing(model)  # N=4096 on a CPU: recompute layers rather than store them
            peft_model, result = adapt(model, self.blocks["adapt_train"], self.blocks["val"],
                                       self.cfg.adapt_config(method), ckpt_dir=ckpt, progress=self.progress,
                                       description=f"adapt {method}")
            if self.ranks.is_main:  # every process holds the same tensors; one writes them
                save_adapter(peft_model, out, result)
                remove(ckpt)

        return self.stage(f"adapt:{method}", deps, [f"adapter/{method}"], fn, inputs=self.kernel_files(method),
                          run=run, parallel=True)

    def _trained_processes(self, method: str) -> int:
        """How many processes trained `method`'s adapter on disk (its adapt.json; 1 when unknown)."""
        return self._recorded_processes(self.dir / "adapter" / method / "adapt.json")

    @staticmethod
    def _recorded_processes(path, unknown: int = 1) -> int:
        """The "processes" a record says trained it (`unknown` when it does not say)."""
        try:
            return int(load_json(path).get("processes", unknown))
        except (ValueError, TypeError, AttributeError):
            return unknown

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
            for line in skip_lines(self.zeroshot_skipped):
                self.console.print(line, style="yellow", markup=False)
        return self._zeroshot

    def zeroshot(self, method: str, run: bool = True) -> bool:
        """PIQA / HellaSwag / ARC-E (App. F.3) on the selected (adapted) checkpoint of `method`."""
        sets = self.zeroshot_sets()
        if not sets:
            return True
        data = {t: {k: v for k, v in prov.items() if k != "path"} for t, (_, prov) in sets.items()}
        deps = {"setup": self.keys["setup"], "method": method, "data": data, "scoring": SCORING_VERSION}
        inputs = self.kernel_files(method) + [f"adapter/{method}"]
        path = self.dir / ".oal" / f"zeroshot_{method}.json"

        def fn():
            model = load_adapter(self.model_for(method), self.dir / "adapter" / method)
            res = evaluate_tasks(model, self.tokenizer, sets, progress=self.progress,
                                 description=f"zeroshot:{method}")
            atomic_write_json(path, {"tasks": res, "data": {t: prov for t, (_, prov) in sets.items()}})
            drop_evaluations(self.dir, f"zeroshot:{method}:")  # `oal evaluate`'s older scores must not win over these

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
                if active:
                    self.record_config()  # `oal adapt`: the arm's settings, now that its adapter has them
                self.perplexity(m, adapted=True, run=active)
                self.zeroshot(m, run=active)
        self.compare(run=arms is None)

    # ------------------------------------------------------------------------------------------------ metrics

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


