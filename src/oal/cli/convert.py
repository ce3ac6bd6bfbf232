"""`oal calibrate`, `oal convert`, `oal evaluate` (fidelity) and `oal generate`: from groups to a converted model.

All four read and write one run directory (design.md): `oal analyze --out DIR` writes DIR/groups.json;
`oal calibrate --out DIR` writes DIR/kernels.safetensors + kernels.json (OAL), DIR/kernels/<method>/ for the other
calibrated methods and DIR/calibration.json; `oal evaluate --out DIR` merges fidelity numbers into
DIR/metrics.json; `oal convert` / `oal generate` load the kernels onto the base model.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from ..io import kernel_dir
from ..runio import atomic_save_safetensors, atomic_write_json
from ._common import BaseModelOpt, DataDirOpt, DataOpt, DeviceOpt, ModelOpt, load_model_or_fail, parse_layers
from .app import app

_CKPT = Path(".oal") / "calibrate"



def _blocks(tokenizer, mdl, data: str, data_dir: str | None, preset: str | None):
    from ..data import default_plan, load_corpus, plan_blocks
    from ..models.registry import preset_for

    preset = preset or preset_for(mdl)
    try:
        plan = default_plan(preset)
        corpus = load_corpus(data, data_dir=data_dir)
        return plan_blocks(corpus, tokenizer, plan, data_dir=data_dir), plan, preset
    except (ValueError, RuntimeError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--data") from None


def _base_model_name(out: Path, model: str | None) -> str:
    """--model if given, else the base model recorded in DIR/kernels.json, else the embedded default."""
    if model:
        return model
    meta = out / "kernels.json"
    if meta.is_file():
        name = json.loads(meta.read_text()).get("base_model", {}).get("name_or_path")
        if name:
            return name
    return "default"


# ----------------------------------------------------------------------------------------------- calibrate


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
    device: DeviceOpt = "cpu",
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
    mdl, tok, prov = load_model_or_fail(model, device)
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
    blocks, plan, preset = _blocks(tok, mdl, data, data_dir, preset)
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


# ----------------------------------------------------------------------------------------------- convert


def _converted(out: Path, model: str | None, method: str, device: str):
    from ..io import load

    name = _base_model_name(kernel_dir(out, method), model)
    mdl, tok, prov = load_model_or_fail(name, device)
    try:
        return load(kernel_dir(out, method), mdl), tok, name
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--out") from None


@app.command("convert")
def convert_cmd(
    out: Path = typer.Option(..., "--out", help="Run directory with calibrated kernels (`oal calibrate`)."),
    model: BaseModelOpt = None,
    method: str = typer.Option("oal", help="Which calibrated kernels to load (oal, global, ...)."),
    export: Path = typer.Option(None, help="Also write a standalone folder: base model + tokenizer + kernels."),
    device: DeviceOpt = "cpu",
) -> None:
    """Load the kernels onto the base model, check a forward pass, print the converted layers."""
    import shutil

    import torch

    from ..io import KERNELS_FILE, META_FILE
    from ..models.convert import converted_methods

    mdl, tok, name = _converted(out, model, method, device)
    ids = torch.randint(0, mdl.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = mdl(ids.to(device)).logits
    if not bool(torch.isfinite(logits).all()):
        raise typer.BadParameter("the converted model produced non-finite logits", param_hint="--out")
    table = Table(title=f"{name}: converted layers ({method})")
    for col in ("layer", "method", "groups per head", "kernel params"):
        table.add_column(col, justify="right")
    for i, m in converted_methods(mdl).items():
        groups = getattr(m, "groups", None)
        g = "-" if groups is None else ",".join(str(int(x.max()) + 1) for x in groups)
        table.add_row(str(i), m.name, g, str(sum(p.numel() for p in m.parameters())))
    Console().print(table)
    if export is not None:
        from ..models.registry import load_model

        base, base_tok, _ = load_model(name)
        export.mkdir(parents=True, exist_ok=True)
        base.save_pretrained(export)
        base_tok.save_pretrained(export)
        for f in (KERNELS_FILE, META_FILE):
            shutil.copy2(kernel_dir(out, method) / f, export / f)
        Console().print(f"exported to {export}: `oal.load('{export}', '{export}')` rebuilds the converted model")


# ----------------------------------------------------------------------------------------------- evaluate


@app.command("evaluate")
def evaluate_cmd(
    out: Path = typer.Option(..., "--out", help="Run directory with calibrated kernels."),
    model: BaseModelOpt = None,
    data: str = typer.Option("builtin", help="Corpus of the held-out fidelity blocks."),
    data_dir: DataDirOpt = None,
    methods: str = typer.Option("oal,global", help="Comma-separated calibrated methods in DIR."),
    preset: str = typer.Option(None, help="Split-plan preset (default: detected from the model)."),
    blocks_limit: int = typer.Option(None, "--blocks", help="Use only the first N fidelity blocks."),
    device: DeviceOpt = "cpu",
) -> None:
    """Frozen-attention fidelity (Table 2, App. C) on the plan's held-out blocks -> DIR/metrics.json["fidelity"]."""
    from ..evaluate.fidelity import fidelity
    from ..io import load_kernels, model_fingerprint

    wanted = [m.strip() for m in methods.split(",") if m.strip()]
    name = _base_model_name(kernel_dir(out, wanted[0]) if wanted else out, model)
    mdl, tok, _ = load_model_or_fail(name, device)
    sets = {}
    for m in wanted:
        try:
            sets[m], _ = load_kernels(kernel_dir(out, m), fingerprint=model_fingerprint(mdl))
        except ValueError as exc:
            raise typer.BadParameter(f"{m}: {exc}", param_hint="--methods") from None
    blocks, _, _ = _blocks(tok, mdl, data, data_dir, preset)
    held_out = blocks["fidelity"][:blocks_limit] if blocks_limit else blocks["fidelity"]
    res = fidelity(mdl, held_out.to(device), sets, progress=True)
    metrics_path = out / "metrics.json"
    metrics = json.loads(metrics_path.read_text()) if metrics_path.is_file() else {}
    metrics.setdefault("fidelity", {}).update(res)  # merge: other stages add their own keys
    metrics.setdefault("model", name)
    metrics.setdefault("converted_layers", sorted(next(iter(sets.values()))) if sets else [])
    atomic_write_json(metrics_path, metrics)
    table = Table(title=f"frozen-attention fidelity, {held_out.shape[0]} held-out blocks x {held_out.shape[1]}")
    for col in ("method", "MSE", "RelMSE", "MSE post-o", "RelMSE post-o"):
        table.add_column(col, justify="right")
    for m, r in res.items():
        table.add_row(m, *(f"{r[k]:.4g}" for k in ("mse", "relmse", "mse_post_o", "relmse_post_o")))
    Console().print(table)


# ----------------------------------------------------------------------------------------------- generate


@app.command("generate")
def generate_cmd(
    prompt: str = typer.Argument(..., help="Prompt text."),
    out: Path = typer.Option(..., "--out", help="Run directory with calibrated kernels."),
    model: BaseModelOpt = None,
    method: str = typer.Option("oal", help="Which calibrated kernels to use."),
    max_new_tokens: int = typer.Option(64, help="Tokens to generate."),
    device: DeviceOpt = "cpu",
) -> None:
    """Greedy generation with the converted model (recurrent O(1) state in converted layers)."""
    import torch

    if max_new_tokens < 1:
        raise typer.BadParameter("expected >= 1", param_hint="--max-new-tokens")
    mdl, tok, _ = _converted(out, model, method, device)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    if enc["input_ids"].shape[1] == 0:
        raise typer.BadParameter("the prompt encodes to no tokens", param_hint="PROMPT")
    with torch.no_grad():
        seq = mdl.generate(**{k: v.to(device) for k, v in enc.items()}, max_new_tokens=max_new_tokens,
                           do_sample=False, use_cache=True, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    typer.echo(prompt + tok.decode(seq[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
