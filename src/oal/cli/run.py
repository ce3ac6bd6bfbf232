"""`oal run` (the whole protocol, resumable) and `oal adapt` (one adaptation arm in an existing run directory)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from ._common import DeviceOpt, parse_layers
from .app import app


def _set_threads(threads: int | None) -> None:
    """Thread count is a runtime choice, not part of the run's configuration. Reductions may round differently
    with another count, so resume a killed run with the same --threads for bit-identical results."""
    if threads is None or threads == 0:
        return
    if threads < 0:
        raise typer.BadParameter(f"expected >= 0, got {threads}", param_hint="--threads")
    import torch

    torch.set_num_threads(threads)


@app.command()
def run(
    out: Path = typer.Option(..., "--out", help="Run directory (created; an existing one is resumed)."),
    model: str = typer.Option(None, help="Model name or local path (default: the preset's; 'default' = embedded)."),
    data: str = typer.Option(None, help="Corpus: 'builtin', a WikiText config or a local text path."),
    data_dir: str = typer.Option(None, help="Local WikiText folder (manifest-checked) for the paper presets."),
    methods: str = typer.Option("oal,global,softmax", help="Comma-separated methods, or 'all'."),
    preset: str = typer.Option("default", help="default | qwen2.5-0.5b | llama-3.2-1b (the paper's protocol)."),
    seeds: str = typer.Option("42", help="Comma-separated seeds; several give mean ± sample std."),
    layers: str = typer.Option(None, help="Converted layers, e.g. 1-4 (default: the model family's range)."),
    steps: int = typer.Option(None, help="Override the number of adaptation updates."),
    val_every: int = typer.Option(None, help="Override the validation interval (updates)."),
    device: DeviceOpt = "cpu",
    threads: int = typer.Option(1, help="CPU threads for torch; 0 keeps torch's default. One thread is the "
                                "predictable choice on a small or shared CPU (oversubscribed threads stall)."),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """Analyze -> group -> calibrate -> convert -> adapt -> evaluate -> report, writing the run directory."""
    from ..config import RunConfig, parse_methods, parse_seeds
    from ..pipeline import run as run_pipeline

    _set_threads(threads)

    try:
        seed_list = parse_seeds(seeds)
        adapt = {k: v for k, v in (("steps", steps), ("val_every", val_every)) if v is not None}
        cfg = RunConfig.from_preset(preset, model=model, data=data, data_dir=data_dir, methods=parse_methods(methods),
                                    layers=parse_layers(layers) if layers else None, seed=seed_list[0], device=device,
                                    adapt=adapt)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    run_pipeline(cfg, out, seed_list, console=Console(), progress=progress)


@app.command("adapt")
def adapt_cmd(
    out: Path = typer.Option(..., "--out", help="An existing run directory (after `oal run` or `oal calibrate`)."),
    method: str = typer.Option("oal", help="The arm to adapt: a method name or softmax."),
    steps: int = typer.Option(None, help="Override the number of adaptation updates."),
    threads: int = typer.Option(1, help="CPU threads for torch; 0 keeps torch's default. One thread is the "
                                "predictable choice on a small or shared CPU (oversubscribed threads stall)."),
    progress: bool = typer.Option(True, help="Show progress bars."),
) -> None:
    """Joint LoRA + kernel adaptation (App. F.2) of one arm, then its test perplexity; resumable."""
    _set_threads(threads)
    from ..config import RunConfig
    from ..pipeline import REFERENCE, Run
    from ..runio import load_json

    cfg_path = out / "config.json"
    if not cfg_path.is_file():
        raise typer.BadParameter(f"{out} has no config.json; run `oal run --out {out}` first", param_hint="--out")
    try:
        d = load_json(cfg_path)["config"]
        if steps is not None:
            d["adapt"] = {**d.get("adapt", {}), "steps": steps}
        if method not in d["methods"]:
            d["methods"] = [*d["methods"], method]
        cfg = RunConfig.from_dict(d)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    console = Console()
    r = Run(cfg, out, console=console, progress=progress)
    try:
        r.setup()
        if method != REFERENCE:
            rec = r.log.stages.get("calibrate")
            if rec is None:
                raise typer.BadParameter(f"{out} has no calibrated kernels; run `oal run --out {out}` first",
                                         param_hint="--out")
            r.keys["calibrate"] = rec["key"]
        if method != REFERENCE and not (r.kernel_dir(method) / "kernels.safetensors").is_file():
            raise typer.BadParameter(f"{out} has no calibrated kernels for {method!r}; run "
                                     f"`oal run --out {out} --methods ...,{method}` first", param_hint="--method")
        if r.adapt(method):
            r.perplexity(method, adapted=True)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from exc
    ppl = r.metrics()["perplexity"].get(method)
    console.print(f"{method}: test PPL after adaptation = {ppl:.4f}" if ppl is not None else f"{method}: no PPL")
