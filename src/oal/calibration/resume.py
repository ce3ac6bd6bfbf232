"""Layer-by-layer calibration with per-layer checkpoints: the one resume mechanism behind `oal run`'s calibrate
stage and `oal calibrate`.

Each finished layer is saved to `DIR/.oal/calibrate/layer-<i>/<method>/` in the kernel format of
`calibration.kernels` (so it carries the SHA256 of its tensors) together with the key of the calibration it
belongs to. A rerun with the same key reuses the layers that verify and recomputes the others (a damaged
checkpoint is reported, never trusted). The math is `calibration.fit.calibrate_methods`; this module only orders,
checkpoints and writes.

Layers are independent, so under a launch of several processes (`oal.launch`) they are shared out: process r
calibrates the r-th, (r+N)-th, ... of the layers still to do, and the main process gathers each round of N finished
layers (their kernels as CPU state dicts), checkpoints them and writes the result: the same kernels, bit for bit, as
one process computes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from oal.calibration.data import NOT_CALIBRATED, CalibConfig
from oal.calibration.fit import calibrate_methods, on_step
from oal.calibration.kernels import (
    kernel_dir,
    load_kernels,
    method_from_record,
    method_record,
    model_fingerprint,
    save_kernels,
)
from oal.launch import log_console, progress_bar
from oal.rundir.files import atomic_write_json, load_json, remove
from oal.rundir.hashes import config_hash
from oal.rundir.user_cache import work_dir

__all__ = ["CHECKPOINT_DIR", "LayerCheckpoints", "OnePassCapture", "calibrate_layers", "write_calibration"]

log = logging.getLogger("oal")
CHECKPOINT_DIR = Path(".oal") / "calibrate"
# the command-line option of each setting the processes of a launch must agree on (`calibrate_directory`)
AGREE_OPTIONS = {"max_steps": "--max-steps", "val_every": "--val-every", "patience": "--patience", "seed": "--seed",
                 "methods": "--methods", "layers": "--layers", "window": "--window", "sinks": "--sinks",
                 "model": "--model", "base_dtype": "--dtype", "data": "--data", "groups": "--out"}


class LayerCheckpoints:
    """Finished layers of one calibration (identified by `key`) under `run_dir/.oal/calibrate/`."""

    def __init__(self, run_dir: str | Path, key: str):
        self.root = Path(run_dir) / CHECKPOINT_DIR
        self.key = key

    def _dir(self, layer: int, method: str) -> Path:
        return self.root / f"layer-{layer}" / method

    def load(self, layer: int, methods: Sequence[str]) -> dict[str, tuple[object, dict]] | None:
        """{method: (AttentionMethod, calibration summary)} of a finished layer, or None (absent, stale, damaged)."""
        out = {}
        for m in methods:
            d = self._dir(layer, m)
            if not (d / "kernels.json").is_file():
                return None
            try:
                loaded, meta = load_kernels(d)
            except ValueError as exc:
                log.warning("calibration checkpoint of layer %d (%s) is damaged (%s); recalibrating it", layer, m, exc)
                return None
            extra = meta.get("extra") or {}
            if extra.get("key") != self.key or layer not in loaded:
                return None  # another calibration's checkpoint: recompute rather than mix
            out[m] = (loaded[layer], extra["report"])
        return out

    def save(self, layer: int, done: Mapping[str, tuple[object, dict]]) -> None:
        for m, (method, report) in done.items():
            save_kernels({layer: method}, self._dir(layer, m), extra={"key": self.key, "report": report})

    @property
    def capture_record(self) -> Path:
        """Where `OnePassCapture` keeps what it captured until `clear()` (see its `record`)."""
        return self.root / "capture.json"

    def clear(self) -> None:
        remove(self.root)


def calibrate_layers(methods: Sequence[str], layers: Sequence[int], capture: Callable[[int], tuple], *,
                     groups: Mapping[int, torch.Tensor], cfg: CalibConfig, seed: int,
                     checkpoints: LayerCheckpoints | None = None, progress: bool = True,
                     console: Console | None = None, ranks=None, options: Mapping | None = None,
                     ) -> tuple[dict[str, dict[int, object]], dict[str, dict]]:
    """Calibrate `methods` on every layer of `layers`, resuming from `checkpoints`.

    `capture(layer)` returns the frozen (train, val) `LayerData` of a layer; it is called only for layers that are
    not checkpointed. `options`: the methods' settings (`calibrate_methods`; part of the checkpoints' `key`).
    Returns ({method: {layer: AttentionMethod}}, {method: {str(layer): summary}}).

    Under a launch of several processes (`ranks`, default: this process's `oal.launch.ranks()`), every process
    calls it with the same arguments: the main process reads the checkpoints and says which layers are still to do,
    each process calibrates its share of them (a capture with a `prepare(layers, scratch=...)` method is told which
    layers that is), and the main process gathers, checkpoints and returns the result; the others return ({}, {}).
    """
    from oal.launch import ranks as this_ranks

    group = ranks or this_ranks()
    console = console or log_console()
    results: dict[int, dict] = {}  # layer -> {method: (AttentionMethod, summary)}, on the main process
    if group.is_main and checkpoints is not None:
        for layer in layers:
            done = checkpoints.load(layer, methods)
            if done is not None:
                log.info("layer %d: calibrated earlier (checkpoint verified), reusing", layer)
                results[layer] = done
    todo = group.broadcast([layer for layer in layers if layer not in results])
    if group.size > 1 and hasattr(capture, "prepare"):
        capture.prepare(todo[group.index::group.size], scratch=not group.is_main)
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with progress_bar(progress and group.is_main, console, columns) as bar:
        task = bar.add_task(f"calibrate {', '.join(methods)}", total=len(layers), completed=len(results))
        steps = bar.add_task("", total=None, visible=False)  # inside a layer: its fits' optimiser steps

        def on_fit_step(name: str, step: int, total: int) -> None:
            bar.update(steps, description=f"  {name}: optimiser steps (early stopping may end sooner)",
                       completed=step, total=total, visible=True)

        for start in range(0, len(todo), group.size):  # one round: one layer per process
            mine = todo[start + group.index] if start + group.index < len(todo) else None
            fitted = None
            if mine is not None:
                bar.update(task, description=f"calibrate layer {mine}: {', '.join(methods)}")
                train, val = capture(mine)
                with on_step(on_fit_step):
                    fitted = {m: (method, res.summary() if res is not None else NOT_CALIBRATED)
                              for m, (method, res) in calibrate_methods(methods, train, val, layer=mine,
                                                                        groups=groups.get(mine), cfg=cfg, seed=seed,
                                                                        options=options).items()}
                bar.update(steps, visible=False)
                del train, val
            for layer, done in _gather_round(group, mine, fitted):
                results[layer] = done
                if checkpoints is not None:
                    checkpoints.save(layer, done)
                bar.advance(task)
    if not group.is_main:
        return {}, {}
    per_method: dict[str, dict[int, object]] = {m: {} for m in methods}
    report: dict[str, dict] = {m: {} for m in methods}
    for layer in layers:
        for m, (method, summary) in results[layer].items():
            per_method[m][layer] = method
            report[m][str(layer)] = summary
    return per_method, report


def _gather_round(group, layer: int | None, fitted: dict | None) -> list[tuple[int, dict]]:
    """The layers that the processes finished in one round, on the main process ([] on the others): their methods
    travel as CPU state dicts (`oal.calibration.kernels.method_record`) and are rebuilt there."""
    if group.size == 1:
        return [(layer, fitted)] if layer is not None else []
    sent = None if layer is None else (layer, {m: (method_record(method), summary)
                                               for m, (method, summary) in fitted.items()})
    got = group.gather(sent)
    if not group.is_main:
        return []
    return [(i, {m: (method_from_record(i, *record, where=f"layer {i} from another process").eval(), summary)
                 for m, (record, summary) in done.items()}) for i, done in (g for g in got if g is not None)]


class OnePassCapture:
    """`capture(layer)` for `calibrate_layers`: on first use, one forward per calibration block captures every layer
    of `layers` into a `CaptureStore` under `root` (reused after a kill when `key` matches; see
    `oal.models.capture_store` for the memory bound); each call then reads one layer's (train, val) back."""

    ROLES = ("calib_train", "calib_val")

    def __init__(self, model, blocks: Mapping[str, torch.Tensor | Mapping[str, torch.Tensor]], layers: Sequence[int],
                 root: str | Path, key: str,
                 *, progress: bool = True, record: str | Path | None = None):
        """`record`: a file that keeps `stats()` of the capture (with `key`) until the calibration is done (the
        layer checkpoints' `LayerCheckpoints.capture_record`), so that a calibration killed after its last layer
        and resumed from the checkpoints alone, which captures nothing, records the capture an uninterrupted one
        records."""
        self.model, self.blocks, self.layers = model, blocks, sorted(int(i) for i in layers)
        # the layers are part of the store's key: a calibration killed after its capture and resumed with more
        # layers reused the store and failed on every rerun ("capture: no data for ... layer 2")
        self.root, self.key, self.progress = Path(root), config_hash({"key": key, "layers": self.layers}), progress
        self.record = Path(record) if record is not None else None
        self.store = None
        self.seconds = 0.0
        self.scratch = contextlib.ExitStack()  # another process's private folder (`prepare`), held until `remove`

    def prepare(self, layers: Sequence[int], *, scratch: bool = False) -> None:
        """Capture only `layers` (this process's share under a launch of several processes), under a key of their
        own; `scratch`: into a temporary folder outside the run directory (only the main process writes there)."""
        self.layers = sorted(int(i) for i in layers)
        self.key = config_hash({"key": self.key, "layers": self.layers})
        if scratch:  # another process of a launch writes nothing into the run directory
            self.root = self.scratch.enter_context(work_dir(scratch_parent(), "capture")) / "capture"
            self.record = None

    def __call__(self, layer: int):
        from oal.analysis.contributions import check_finite_attention
        from oal.calibration.data import LayerData
        from oal.models.capture_store import block_ids, capture_to_disk

        if self.store is None:
            t0 = time.perf_counter()
            with progress_bar(self.progress) as bar:
                total = sum(block_ids(r, self.blocks[r])[0].shape[0] for r in self.ROLES)
                task = bar.add_task("capture", total=total)
                self.store = capture_to_disk(self.model, {r: self.blocks[r] for r in self.ROLES}, self.layers,
                                             self.root, key=self.key, on_batch=lambda _role, n: bar.advance(task, n))
            self.seconds = time.perf_counter() - t0
            if self.record is not None:
                atomic_write_json(self.record, {"key": self.key, "stats": self.stats()})
        device = next(self.model.parameters()).device
        out = []
        for role in self.ROLES:
            tensors = self.store.load(role, layer, device)
            # here, once per layer: LayerData's own check names no layer
            where = f"the calibration {'training' if role == 'calib_train' else 'validation'} blocks"
            check_finite_attention(layer, {f: tensors[f] for f in ("q", "k", "v", "out")}, where,
                                   real=tensors.get("mask"))
            out.append(LayerData(**tensors, causal=self.store.causal))
        return tuple(out)

    def stats(self) -> dict | None:
        """What calibration.json records of the capture: when every layer came from a checkpoint, the record the
        capture of this `key` left (None without one)."""
        if self.store is None:
            return self._recorded()
        return {"seconds": round(self.seconds, 3), "layers": len(self.layers), "bytes": self.store.nbytes(),
                "blocks": {r: len(self.store.files(r, self.layers[0])) for r in self.ROLES}}

    def _recorded(self) -> dict | None:
        if self.record is None or not self.record.is_file():
            return None
        try:
            saved = load_json(self.record)
        except ValueError:
            return None
        ok = isinstance(saved, dict) and saved.get("key") == self.key and isinstance(saved.get("stats"), dict)
        return saved["stats"] if ok else None

    def gathered_stats(self, ranks) -> dict | None:
        """`stats()` of one process, or of every process of a launch ({"processes": [...]}, None for a process that
        captured nothing); a collective: every process calls it."""
        stats = ranks.gather(self.stats())
        if ranks.size == 1:
            return stats[0]
        return {"processes": stats} if any(stats) else None

    def remove(self) -> None:
        if self.store is not None:
            self.store.remove()
        remove(self.root)
        self.scratch.close()


def scratch_parent() -> Path:
    """Where other processes' scratch captures go: a folder of this user's in the temp folder, holding only
    `oal.rundir.user_cache.work_dir` folders (locked while their process runs; a killed launch's are removed by the
    next one: torchrun ends the other processes of a failed launch with SIGTERM, which runs no cleanup)."""
    return Path(tempfile.gettempdir()) / f"oal-scratch-{os.getuid()}"


def write_calibration(out_dir: str | Path, per_method: Mapping[str, Mapping[int, object]], report: Mapping,
                      cfg: CalibConfig, *, model, base_model: str, provenance: Mapping,
                      extra: Mapping | None = None, capture: Mapping | None = None) -> None:
    """Each method's kernels (`calibration.kernels.save_kernels`, bound to the base `model`: its architecture
    fingerprint and, by `provenance`, the SHA256 of its tensors and files) and calibration.json."""
    out_dir = Path(out_dir)
    fingerprint = model_fingerprint(model)
    for m, methods in per_method.items():
        save_kernels(dict(methods), kernel_dir(out_dir, m), base_model=base_model, provenance=provenance,
                     fingerprint=fingerprint, extra={"method": m, **(extra or {})})
    layers = sorted({i for methods in per_method.values() for i in methods})
    record = {"config": cfg.to_dict(), "model": base_model, "layers": layers, "methods": dict(report)}
    if capture is not None:
        record["capture"] = dict(capture)
    atomic_write_json(out_dir / "calibration.json", record)


def calibrate_directory(out_dir: str | Path, model, blocks: Mapping[str, torch.Tensor], layers: Sequence[int],
                        methods: Sequence[str], *, groups: Mapping[int, torch.Tensor], cfg: CalibConfig, seed: int,
                        base_model: str, provenance: Mapping, extra: Mapping | None = None, progress: bool = True,
                        console: Console | None = None, options: Mapping | None = None) -> dict[str, dict]:
    """`oal calibrate`: calibrate `methods` on `layers` of `model` from the plan's calibration blocks into `out_dir`
    (kernels + calibration.json), resuming from per-layer checkpoints of the same inputs. Returns the report (on
    every process of a launch, whose processes share the layers out; the main process writes). `options`: the
    methods' settings ({"window": W, "sinks": S}; see `calibrate_methods`). The caller holds `out_dir`'s lock
    (`rundir.lock.own_dir`: `oal calibrate`, `oal.linearize`): a second calibration there would delete this one's
    capture files."""
    from oal.launch import ranks
    from oal.rundir.hashes import tensor_hash

    inputs = {"model": {k: provenance.get(k) for k in ("sha256", "state_dict_sha256")},
              "blocks": {r: tensor_hash(blocks[r]) for r in ("calib_train", "calib_val")},
              "groups": {i: tensor_hash(groups[i]) for i in layers if i in groups}}
    key = config_hash({"cfg": cfg.to_dict(), "methods": list(methods), "seed": seed, **inputs,
                       **({"options": dict(options)} if options else {})})

    group = ranks(next(model.parameters()).device)
    # each process would calibrate its share of the layers with its own settings and data, the main one writing
    # them all as one calibration: refused, naming the first that differs, on every process before any work
    group.agree({**cfg.to_dict(), "seed": seed, "methods": list(methods), "layers": list(layers), **dict(options or {}),
                 "base_dtype": str(next(model.parameters()).dtype), "model": inputs["model"], "data": inputs["blocks"],
                 "groups": inputs["groups"]}, AGREE_OPTIONS)
    checkpoints = LayerCheckpoints(out_dir, key)
    capture = OnePassCapture(model, blocks, layers, Path(out_dir) / ".oal" / "capture", key, progress=progress,
                             record=checkpoints.capture_record)
    per_method, report = calibrate_layers(methods, layers, capture, groups=groups, cfg=cfg, seed=seed,
                                          checkpoints=checkpoints, progress=progress, console=console, ranks=group,
                                          options=options)
    stats = capture.gathered_stats(group)
    capture.remove()
    group.on_main(lambda: write_calibration(out_dir, per_method, report, cfg, model=model, base_model=base_model,
                                            provenance=provenance, extra=extra, capture=stats))
    return group.broadcast(report)
