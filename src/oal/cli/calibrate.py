"""`oal calibrate`: fit kernel coefficients per head by output matching into a run directory."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..io import kernel_dir
from ..runio import atomic_save_safetensors, atomic_write_json
from ._common import (
    DataDirOpt,
    DataOpt,
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    blocks_or_fail,
    load_model_or_fail,
    parse_layers,
)
from .app import app

_CKPT = Path(".oal") / "calibrate"


def _layer_checkpoint(out: Path, layer: int, key: str):
    from safetensors.torch import load_file

    path = out / _CKPT / f"layer-{layer}.safetensors"
    meta = path.with_suffix(".json")
    if not (path.is_file() and meta.is_file()):
        return None
    info = json.loads(meta.read_text())
    if info.get("key") != key:
        return None
    return load_file(str(path)), info["report"]


def _save_layer_checkpoint(out: Path, layer: int, key: str, tensors: dict, report: dict) -> None:
    path = atomic_save_safetensors(out / _CKPT / f"layer-{layer}.safetensors", tensors)
    atomic_write_json(path.with_suffix(".json"), {"key": key, "report": report})


@app.command("calibrate")
def calibrate_cmd(
    out: Path = typer.Option(..., "--out", help="Run directory holding groups.json (from `oal analyze`)."),
    model: ModelOpt = "default",
    data: DataOpt = "builtin",
    data_dir: DataDirOpt = None,
    layers: str = typer.Option(None, help="'3-20' or '1,4,7' (default: every layer in groups.json)."),
    methods: str = typer.Option("oal,global", help="Comma-separated trainable methods to calibrate."),
    preset: str = typer.Option(None, help="Split-plan preset (default: detected from the model)."),
    paper: bool = typer.Option(False, help="App. B budgets: 1000 updates, validation every 100, patience 400."),
    max_steps: int = typer.Option(None, help="Updates per initialisation (override)."),
    val_every: int = typer.Option(None, help="Validation interval in updates (override)."),
    patience: int = typer.Option(None, help="Early-stopping patience in updates (override)."),
    seed: int = typer.Option(0, help="Seed of the sampled sequences/positions and perturbed initialisations."),
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "float32",
) -> None:
    """Fit kernel coefficients by output matching on frozen attention (paper Eq. 20, App. B)."""
    import torch

    from ..analysis import load_groups
    from ..calibrate import NOT_CALIBRATED, CalibConfig, calibrate_methods, capture_layer_data
    from ..io import save_kernels
    from ..methods import build_method, method_names
    from ..models.convert import _head_shape

    console = Console()
    wanted = [m.strip() for m in methods.split(",") if m.strip()]
    unknown = [m for m in wanted if m not in method_names()]
    if not wanted or unknown:
        raise typer.BadParameter(f"unknown {unknown}; expected some of {method_names()}", param_hint="--methods")
    try:
        groups = load_groups(out) if "oal" in wanted else {}
    except ValueError as exc:
        raise typer.BadParameter(f"{exc} (run `oal analyze --out {out}` first)", param_hint="--out") from None
    mdl, tok, prov = load_model_or_fail(model, device, dtype)
    n_layers = mdl.config.num_hidden_layers
    from ..models.convert import default_layers

    layer_list = parse_layers(layers, n_layers) if layers else (sorted(groups) if groups else default_layers(mdl))
    missing = [i for i in layer_list if "oal" in wanted and i not in groups]
    if missing:
        raise typer.BadParameter(f"groups.json has no groups for layers {missing}", param_hint="--layers")
    overrides = {k: v for k, v in (("max_steps", max_steps), ("val_every", val_every), ("patience", patience))
                 if v is not None}
    try:
        cfg = CalibConfig.preset("paper" if paper else "default", seed=seed, **overrides)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    blocks, plan, preset = blocks_or_fail(tok, mdl, data, data_dir, preset)
    hq, hkv, d = _head_shape(mdl)
    key_src = {"cfg": cfg.to_dict(), "model": prov.get("sha256"), "plan": plan.to_dict(), "methods": wanted,
               "groups": {i: groups[i].tolist() for i in layer_list if i in groups}, "data": data}
    key = hashlib.sha256(json.dumps(key_src, sort_keys=True, default=str).encode()).hexdigest()
    per_method: dict[str, dict[int, object]] = {m: {} for m in wanted}
    report: dict[str, dict] = {m: {} for m in wanted}
    for layer in layer_list:
        ck = _layer_checkpoint(out, layer, key)
        if ck is None:
            console.print(f"[bold]layer {layer}[/]: capturing {len(blocks['calib_train'])} + "
                          f"{len(blocks['calib_val'])} blocks, calibrating {', '.join(wanted)}")
            train = capture_layer_data(mdl, blocks["calib_train"].to(device), layer)
            val = capture_layer_data(mdl, blocks["calib_val"].to(device), layer)
            done = calibrate_methods(wanted, train, val, layer=layer, groups=groups.get(layer), cfg=cfg, seed=seed)
            tensors, layer_report = {}, {}
            for m, (method, res) in done.items():
                layer_report[m] = res.summary() if res is not None else NOT_CALIBRATED
                if res is not None:
                    tensors.update({f"{m}.{k}": v.detach().cpu() for k, v in method.named_parameters()})
            _save_layer_checkpoint(out, layer, key, tensors, layer_report)
            del train, val
        else:
            console.print(f"layer {layer}: calibrated earlier (checkpoint), reusing")
        tensors, layer_report = _layer_checkpoint(out, layer, key)
        for m in wanted:
            kwargs = {"groups": groups[layer], "n_groups": int(groups[layer].max()) + 1} if m == "oal" else {}
            method = build_method(m, hq, hkv, d, layer_idx=layer, seed=seed, **kwargs)
            with torch.no_grad():
                params = dict(method.named_parameters())
                for name, value in tensors.items():
                    if name.startswith(f"{m}."):
                        params[name[len(m) + 1 :]].copy_(value)
            per_method[m][layer] = method
            report[m][str(layer)] = layer_report[m]
    for m in wanted:
        save_kernels(per_method[m], kernel_dir(out, m), base_model=model, revision=prov.get("revision"),
                     model_hashes=prov.get("sha256"), extra={"method": m, "seed": seed, "preset": preset})
    atomic_write_json(out / "calibration.json", {"config": cfg.to_dict(), "model": model, "layers": layer_list,
                                           "methods": report})
    table = Table(title="calibration: validation MSE (mean over heads)")
    for col in ("layer", *wanted):
        table.add_column(col, justify="right")
    for layer in layer_list:
        cells = []
        for m in wanted:
            heads = report[m][str(layer)]["heads"]
            cells.append(f"{sum(h['val_mse'] for h in heads) / len(heads):.4g}" if heads else "-")
        table.add_row(str(layer), *cells)
    console.print(table)
    console.print(f"wrote {out / 'kernels.safetensors'} and {out / 'calibration.json'}")
