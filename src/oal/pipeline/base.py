"""One seed's run directory and the stage mechanism every protocol of `oal run` shares.

Each stage has a key: the hash of the configuration it reads and of the SHA256 of the files it reads (the outputs
of earlier stages). A stage whose key matches the marker in `DIR/.oal/stages.json` and whose outputs still have the
SHA256 recorded there is skipped, so a killed run continues where it stopped (calibration resumes per layer and
adaptation mid-way from their checkpoints); a damaged output is reported and its stage recomputed, and every stage
that read it follows, since its input hashes changed. Evaluation always rebuilds the model from the files on disk
(kernels + adapter), so a resumed run and an uninterrupted one measure exactly the same model.

A run directory belongs to one configuration (config.json): another configuration is refused with the differing
keys named, unless `force=True` deletes the old results first. metrics.json and report.md are rebuilt (`publish`)
from the stage records that verify and the evaluation records of `oal evaluate` that verify (`rundir.metrics`),
never edited; metrics.json records the SHA256 of the files its numbers were computed from.

Under `torchrun` / `accelerate launch` every process runs the stages: calibration and adaptation run on all of
them (`oal.launch`), every other stage on the main process while the others wait, and only the main process
reads the stage log and writes the run directory.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from oal.calibration.kernels import KERNELS_FILE, META_FILE, kernel_dir, load_kernels
from oal.data.sources import load_corpus
from oal.device import release_memory
from oal.errors import InputError, ModelUnavailableError, SelectionSizeError, message_of
from oal.evaluate.passkey import DECODING_VERSION
from oal.evaluate.zeroshot import SCORING_VERSION
from oal.launch import log_console, process_device, ranks
from oal.ops import check_errors
from oal.pipeline.config import RunConfig
from oal.rundir.claim import claim_run_dir
from oal.rundir.files import atomic_write_json, check_out_dir
from oal.rundir.hashes import config_hash, versions
from oal.rundir.metrics import METRICS_FILE, apply_entries, verified_evaluations
from oal.rundir.stages import StageLog, Timer

__all__ = ["CANDIDATES", "FIDELITY_FILE", "REFERENCE", "StagedRun", "tidy_zeroshot"]

FIDELITY_FILE = ".oal/fidelity.json"
REFERENCE = "softmax"  # the method without an approximation (the reference arm)
CANDIDATES = "candidates"  # --layers auto:K: every candidate layer's calibrated kernels and calibration.json

log = logging.getLogger("oal")
# the versions of the code an `oal evaluate` record must have been measured by to be published (rundir.metrics)
EVALUATION_VERSIONS = {"zeroshot:": {"zeroshot_scoring": SCORING_VERSION},
                       "passkey:": {"passkey_decoding": DECODING_VERSION}}


# the command-line option of a setting that the processes of a launch hold differently (`StagedRun.setup`)
LAUNCH_OPTIONS = {"seed": "--seed", "methods": "--methods", "layers": "--layers", "converted_layers": "--layers",
                  "select.k": "--layers", "select.by": "--select-by", "dtype": "--dtype", "preset": "--preset",
                  "window": "--window", "sinks": "--sinks", "model": "--model", "data": "--data", "blocks": "--data",
                  "zeroshot_tasks": "--tasks", "zeroshot_limit": "--limit", "adapt.steps": "--steps",
                  "adapt.val_every": "--val-every", "adapt.batch_size": "--batch-size",
                  "adapt.grad_accum": "--grad-accum", "adapt.lora_dropout": "--lora-dropout"}


class Stop(Exception):
    """Raised by `stop_after` (tests): simulate a kill right after a stage finished."""


def _jsonable_provenance(obj):
    """Provenance dicts may hold Paths or tensors; keep JSON-able values, stringify the rest."""
    if isinstance(obj, dict):
        return {str(k): _jsonable_provenance(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable_provenance(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def operator_record(dtype: str, device) -> dict:
    """How the CPU operator runs in this process, recorded in the setup stage's record of `.oal/stages.json`: its
    chunking settings and where they came from (a tuning entry of the user's cache, forced, or the fixed defaults;
    they change timings and rounding only), and the fused kernel's library and SHA256. Empty on a GPU, where neither
    runs."""
    if device.type != "cpu":
        return {}
    import dataclasses

    import torch

    from oal.ops import chunked, cpu_kernel, tuning

    dt = getattr(torch, dtype)
    return {"threads": torch.get_num_threads(), "chunked": {**dataclasses.asdict(chunked.current_settings(dt)),
                                                           "source": tuning.source(dt)},
            "cpu_kernel": cpu_kernel.record()}


class StagedRun:
    """One seed's run directory: setup (model, data, split plan, config.json), the stage mechanism, and metrics.json
    from the stages whose records verify. A protocol subclass supplies the loading hooks (`_load_model`,
    `_plan_blocks`, `_blocks_record`, `_default_layers`) and its stages."""

    def __init__(self, cfg: RunConfig, out_dir: str | Path, *, console: Console | None = None,
                 progress: bool = True, stop_after: str | None = None, force: bool = False,
                 allow_changes: tuple[str, ...] = (), recorded: dict | None = None):
        """Nothing is written before `setup()` has loaded and checked the model, the data and the directory.

        force: delete the results of another configuration found in `out_dir` and start clean;
        allow_changes: configuration keys (dotted prefixes) that may differ from the recorded ones (the commands
        that change part of a run, e.g. `oal adapt`);
        recorded: the configuration config.json records until `record_config()` is called (`oal adapt` records an
        arm's new settings only once the adapter trained with them is on disk); default: `cfg`'s.
        """
        self.cfg = cfg
        self.dir = check_out_dir(out_dir)
        # --device auto -> CUDA when present (under a launch: this process's GPU)
        self.device = process_device(self.cfg.device)
        self.ranks = ranks(self.device)
        # the other processes of a launch compute but say nothing (the main process reports)
        self.console = (console or log_console()) if self.ranks.is_main else Console(quiet=True)
        self.progress = progress and self.ranks.is_main
        self.stop_after = stop_after
        self.force = force
        self.allow_changes = tuple(allow_changes)
        self.recorded = recorded
        self.log: StageLog | None = None
        self.keys: dict[str, str] = {}
        self.ran: list[str] = []
        self.skipped: list[str] = []
        self._base = None
        self._zeroshot = None
        self.zeroshot_skipped: dict[str, str] = {}
        self.other_corpora: dict = {}  # name -> Corpus of the corpora the split plan reads besides --data

    def setup(self, check: Callable[[StagedRun], None] | None = None) -> None:
        """Model, tokenizer, corpus, split plan and token blocks; checks that DIR holds no other configuration, then
        writes config.json (cheap, always runs). Every bad input fails here, before anything is written; so does
        `check(self)` (`oal run --passkey`'s lengths against the model), run once the model is loaded."""
        with Timer() as t:
            try:
                self.model, self.tokenizer, self.provenance = self._load_model()
            except ModelUnavailableError as exc:  # offline without the files: the fix is the --model given
                raise InputError(str(exc), "--model") from None
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
                raise SelectionSizeError(self.cfg.select["k"], len(self.layers))
            self.calib_root = self.dir / CANDIDATES if self.cfg.select else self.dir
            try:
                self.corpus = load_corpus(self.cfg.data, data_dir=self.cfg.data_dir)
                self.plan, self.blocks = self._plan_blocks()
            except (ValueError, OSError) as exc:
                raise InputError(message_of(exc, self.cfg.data), "--data", "data") from exc
            self._check_windows()
            if check is not None:  # before config.json: a refused --passkey length left a run of its settings
                check(self)
        config = {
            **({"protocol": self.protocol} if self.protocol else {}),
            "config": self.recorded or self.cfg.to_dict(),
            "converted_layers": self.layers if not self.cfg.select else {**self.cfg.select, "candidates": self.layers},
            "split_plan": self.plan.to_dict(),
            "blocks": self._blocks_record(),
            "model": _jsonable_provenance(self.provenance),
            "data": {"name": self.corpus.name, "sha256": self.corpus.sha256,
                     "meta": _jsonable_provenance(self.corpus.meta),
                     **({"other_corpora": {name: {"sha256": c.sha256, "meta": _jsonable_provenance(c.meta)}
                                           for name, c in self.other_corpora.items()}} if self.other_corpora else {})},
            "versions": versions(),
        }
        # content, not paths: the same model files and text elsewhere give the same key
        self.keys["setup"] = config_hash({**({"protocol": self.protocol} if self.protocol else {}),
                                          "converted_layers": self.layers, "split_plan": config["split_plan"],
                                          "blocks": config["blocks"], "dtype": self.cfg.dtype,
                                          "model": {k: self.provenance.get(k) for k in ("sha256", "state_dict_sha256")},
                                          "data": self.corpus.sha256})

        # processes started with other settings would each compute their own share of the stages that run on every
        # process (calibration's layers with its own seed and blocks; adaptation checks only its own settings):
        # refused on every process, naming the first setting that differs, before anything is written
        if self.ranks.size > 1:
            self.ranks.agree(self._launch_settings(config["blocks"]), LAUNCH_OPTIONS)

        def claim():  # the main process only: it alone reads the stage log and writes
            claim_run_dir(self.dir, config, force=self.force, allow=self.allow_changes)
            self.log = StageLog(self.dir)
            atomic_write_json(self.dir / "config.json", config)
            # how the operator runs in this process: in the stage log, not config.json, which a rerun with another
            # thread count must not change
            self.log.mark("setup", self.keys["setup"], t.seconds, outputs=["config.json"],
                          operator=operator_record(self.cfg.dtype, self.device))

        self._config = config
        self.ranks.on_main(claim)

    def _launch_settings(self, blocks: dict) -> dict:
        """What every process of a launch must hold alike: the configuration (its dicts one level down, so the
        setting is named) with the model, corpus and `blocks` (their record) by content, not path (another machine
        may mount them elsewhere); `device` is this process's own."""
        values = {}
        for k, v in self.cfg.to_dict().items():
            if k in ("model", "data", "data_dir", "zeroshot_dir", "zeroshot_files", "device"):
                continue
            values.update({f"{k}.{sub}": x for sub, x in v.items()} if isinstance(v, dict) else {k: v})
        return {**values, "converted_layers": self.layers, "blocks": blocks, "data": self.corpus.sha256,
                "model": {k: self.provenance.get(k) for k in ("sha256", "state_dict_sha256")}}

    def _check_windows(self) -> None:
        """Refuse a sliding window that covers every block of the run: its methods would be plain softmax there."""
        from oal.methods.base import get_method

        windowed = [m for m in self.cfg.methods if get_method(m).positional]
        if not windowed:
            return
        longest = max(b.shape[-1] for b in self.blocks.values())
        if self.cfg.window >= longest:
            raise InputError(f"{self.cfg.window} covers every block of this run (the longest has {longest} tokens), "
                             f"so {', '.join(windowed)} would be plain softmax; choose a window below {longest}",
                             "--window", "window")
        if self.cfg.window + self.cfg.sinks >= longest:  # every window method keeps the same S sinks
            raise InputError(f"{self.cfg.sinks} sinks beside a window of {self.cfg.window} cover every block of this "
                             f"run (the longest has {longest} tokens), so {', '.join(windowed)} would be plain "
                             f"softmax; choose window + sinks below {longest}", "--sinks", "sinks")

    def record_config(self) -> None:
        """config.json records `cfg` from now on (see `recorded`); the setup record follows (its key is unchanged:
        the settings recorded late are part of the keys of the stages that use them)."""
        if self.recorded is None:
            return
        self.recorded = None
        self._config = {**self._config, "config": self.cfg.to_dict()}

        def write():
            elapsed = self.log.stages["setup"]["elapsed_s"]
            atomic_write_json(self.dir / "config.json", self._config)
            self.log.mark("setup", self.keys["setup"], elapsed, outputs=["config.json"])

        self.ranks.on_main(write)

    def base_model(self):
        """A fresh copy of the pristine base model (stages modify models in place)."""
        return copy.deepcopy(self.model)

    @property
    def kernel_methods(self) -> list[str]:
        return [m for m in self.cfg.methods if m != REFERENCE]

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
            check_errors()  # on CUDA the operator's value checks report late: none may outlive the stage it came from
        release_memory()  # what the stage freed goes back to the OS: the next one starts from what is still held
        self.ranks.on_main(lambda: self.log.mark(name, key, t.seconds, outputs=outputs, inputs=read))
        self.ran.append(name)
        if self.stop_after == name:
            raise Stop(name)
        return True

    def kernel_files(self, method: str, root: Path | None = None) -> list[str]:
        """`method`'s kernel files (under `root`: the run directory by default, or candidates/), relative to the run
        directory (none for the softmax reference)."""
        if method == REFERENCE:
            return []
        d = kernel_dir(root or self.dir, method).relative_to(self.dir)
        return [str(d / KERNELS_FILE), str(d / META_FILE)]

    def kernel_dir(self, method: str) -> Path:
        return kernel_dir(self.dir, method)

    def load_methods(self, method: str) -> dict:
        methods, _ = load_kernels(self.kernel_dir(method))
        return methods

    def evaluation(self, name: str, path: str, compute, extra: dict | None = None) -> bool:
        """A stage over every kernel method's files: `compute(methods)` -> the JSON written to `path` (relative).
        `extra`: more of what the result depends on, in the stage's key."""
        methods = self.kernel_methods
        if not methods:
            return True
        deps = {"setup": self.keys["setup"], "methods": methods, **(extra or {})}
        return self.stage(name, deps, [path], lambda: atomic_write_json(self.dir / path, compute(methods)),
                          inputs=[f for m in methods for f in self.kernel_files(m)])

    def verified(self, stage: str) -> bool:
        """`stage` finished for this configuration (its key) and its outputs verify (what `oal run` reports)."""
        return stage in self.keys and self.log.done(stage, self.keys[stage])

    def metrics(self, valid: Callable[[str], bool] | None = None) -> dict:
        """metrics.json: `results` of the stages for which `valid(stage)` (default: `verified`), overlaid with the
        measurements of `oal evaluate` whose records verify; the SHA256 of the files they read; time per stage."""
        valid = valid or self.verified
        used = []  # stages whose numbers are reported: their input files' SHA256 go into metrics.json

        def reported(stage):
            ok = valid(stage)
            if ok:
                used.append(stage)
            return ok

        out = self.results(reported)
        entries, _, inputs = verified_evaluations(self.dir, EVALUATION_VERSIONS)
        apply_entries(out, entries)
        out["sha256"] = {f: h for s in used for f, h in self.log.stages[s].get("inputs", {}).items()}
        out["sha256"].update(inputs)
        out["sha256"]["config.json"] = self.log.stages["setup"]["sha256"]["config.json"]
        out["elapsed_s"] = {k: v for k, v in self.log.elapsed().items() if k != "report"}
        return tidy_zeroshot(out)

    def publish(self, valid: Callable[[str], bool] | None = None) -> dict:
        """Rewrite metrics.json and report.md from the records (`metrics(valid)`), and record both (main process).
        A metrics.json changed since it was written is reported: none of its numbers is kept."""
        path = self.dir / METRICS_FILE
        if path.is_file() and METRICS_FILE in self.log.damaged("report"):
            log.warning("%s was changed since oal wrote it; rebuilt from the verified stage records (the edited "
                        "numbers are not kept)", path)
        metrics = self.metrics(valid)
        skipped = {"zeroshot_skipped": self.zeroshot_skipped} if self.zeroshot_skipped else {}
        # the report reads metrics.json: until it is written, the record says "not done" (no outputs), so a report
        # that fails leaves a stage to redo, not a metrics.json that looks edited
        self.log.mark("report", "pending", 0.0, **skipped)
        atomic_write_json(path, metrics)
        with Timer() as t:
            self.report(self.dir, self.console)
        metrics["elapsed_s"]["report"] = round(t.seconds, 3)
        atomic_write_json(path, metrics)
        self.log.mark("report", config_hash(metrics), t.seconds, outputs=["report.md", METRICS_FILE], **skipped)
        return metrics


def tidy_zeroshot(metrics: dict) -> dict:
    """A task skipped once (offline) and measured since is not listed as skipped."""
    measured = {t for tasks in (metrics.get("zeroshot") or {}).values() for t in tasks}
    skipped = {t: why for t, why in (metrics.pop("zeroshot_skipped", None) or {}).items() if t not in measured}
    if skipped:
        metrics["zeroshot_skipped"] = skipped
    return metrics
