"""`oal analyze`: contribution scores, stable-gap groups and the App. A diagnostics for a model's layers."""

from __future__ import annotations

from pathlib import Path

import torch
import typer
from rich.console import Console

from .app import app


def parse_layers(spec: str, n_layers: int) -> list[int]:
    """"all", "3-20" (inclusive) or "1,4,7" (mixable: "1,3-5") -> sorted layer list."""
    if spec.strip().lower() == "all":
        return list(range(n_layers))
    out: set[int] = set()
    try:
        for part in spec.split(","):
            part = part.strip()
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
    except ValueError:
        raise typer.BadParameter(f"expected 'all', 'A-B' or 'A,B,C', got {spec!r}", param_hint="--layers") from None
    if not out or min(out) < 0 or max(out) >= n_layers:
        raise typer.BadParameter(f"layers must lie in [0, {n_layers}), got {spec!r}", param_hint="--layers")
    return sorted(out)


def _role_tokens(corpus, tokenizer, blockset, data_dir):
    """Token stream of the split a BlockSet points at (its own corpus if it names one)."""
    from ..data import encode, load_corpus

    c = corpus if blockset.corpus is None else load_corpus(blockset.corpus, data_dir=data_dir)
    return c, encode(tokenizer, c.splits[blockset.split])


@app.command("analyze")
def analyze_cmd(
    out: Path = typer.Option(..., "--out", help="Output directory (groups.json, analysis.json, figures/)."),
    model: str = typer.Option("default", help="'default' (embedded model), a local HF folder or a pinned hub id."),
    data: str = typer.Option("builtin", help="Corpus: 'builtin', 'wikitext-2-raw-v1', ... or a local path."),
    data_dir: str = typer.Option(None, help="Local WikiText folder (with manifest) for WikiText corpora."),
    layers: str = typer.Option(None, help="'all', '3-20' or '1,4,7'. Default: the preset's conversion layers."),
    preset: str = typer.Option(None, help="Grouping/data preset (default: detected from the model)."),
    tail_fraction: float = typer.Option(None, help="alpha, candidate tail fraction (default: preset)."),
    min_support: float = typer.Option(None, help="gamma, minimum bootstrap support (default: preset)."),
    min_ratio: float = typer.Option(None, help="tau, minimum gap ratio (default: preset)."),
    min_groups: int = typer.Option(None, help="G_min, minimum groups per head (default: preset)."),
    n_bootstrap: int = typer.Option(None, help="B, bootstrap replicates (default: preset)."),
    seed: int = typer.Option(0, help="Seed of the bootstrap and the Gaussian controls."),
    head: str = typer.Option(None, help="Representative head 'LAYER:HEAD' for single-head figures."),
    heldout: int = typer.Option(40, help="Held-out prompts (validation split) for the stability check; 0 skips."),
    long_len: int = typer.Option(None, help="Tokens of the sequence for the length-stability table (Table 4)."),
    batch_size: int = typer.Option(8, help="Prompts per forward pass."),
    device: str = typer.Option("cpu", help="torch device."),
    figures: bool = typer.Option(True, help="Write figures."),
) -> None:
    """Find each head's high-contribution dimensions and group them (paper Sec. 3, 4.2, App. A, B)."""
    from ..analysis import analyze
    from ..data import default_plan, load_corpus, token_blocks
    from ..models.registry import PRESETS, default_layers, load_model, preset_for

    console = Console()
    try:
        mdl, tok, provenance = load_model(model, device=device)
    except (ValueError, RuntimeError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None
    preset = preset or preset_for(mdl)
    if preset not in PRESETS:
        raise typer.BadParameter(f"expected one of {sorted(PRESETS)}, got {preset!r}", param_hint="--preset")
    spec = PRESETS[preset]
    n_layers = mdl.config.num_hidden_layers
    layer_list = parse_layers(layers, n_layers) if layers else default_layers(mdl)
    rep = None
    if head:
        try:
            rep = tuple(int(x) for x in head.split(":"))
            assert len(rep) == 2
        except (ValueError, AssertionError):
            raise typer.BadParameter(f"expected 'LAYER:HEAD', got {head!r}", param_hint="--head") from None
    try:
        corpus = load_corpus(data, data_dir=data_dir)
    except (ValueError, RuntimeError, OSError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--data") from None

    plan = default_plan(spec["plan"])
    grp = plan.grouping
    gcorpus, stream = _role_tokens(corpus, tok, grp, data_dir)
    idx = grp.resolve(len(stream) // grp.block_len)
    prompts = torch.tensor([stream[i * grp.block_len : (i + 1) * grp.block_len] for i in idx], dtype=torch.long)
    held = None
    if heldout > 0:
        held = token_blocks(tok, gcorpus.splits["validation"], grp.block_len)[:heldout]
        if held.shape[0] == 0:
            console.print("[yellow]validation split too short for held-out prompts; stability check skipped")
            held = None
    fid = plan.fidelity
    _, fstream = _role_tokens(corpus, tok, fid, data_dir)
    n_long = long_len or min(fid.block_len, getattr(mdl.config, "max_position_embeddings", fid.block_len))
    start = fid.indices[0] * fid.block_len
    long_seq = torch.tensor(fstream[start : start + n_long], dtype=torch.long)
    if long_seq.numel() < n_long:
        raise typer.BadParameter(f"the fidelity split has only {long_seq.numel()} tokens from block "
                                 f"{fid.indices[0]}", param_hint="--long-len")

    kw = dict(
        tail_fraction=spec["alpha"] if tail_fraction is None else tail_fraction,
        min_support=spec["gamma"] if min_support is None else min_support,
        min_ratio=spec["tau"] if min_ratio is None else min_ratio,
        min_groups=spec["min_groups"] if min_groups is None else min_groups,
        n_bootstrap=spec["n_bootstrap"] if n_bootstrap is None else n_bootstrap,
    )
    meta = dict(model=model, provenance=provenance, preset=preset,
                data=dict(corpus=gcorpus.name, sha256=gcorpus.sha256, grouping=grp.__dict__,
                          heldout=dict(split="validation", block_len=grp.block_len,
                                       n=0 if held is None else held.shape[0]),
                          long_sequence=dict(split=fid.split, start_token=start, n_tokens=n_long)))
    console.print(f"[bold]oal analyze[/]: {provenance.get('architecture')} '{model}', layers {layer_list}, "
                  f"{prompts.shape[0]} prompts x {prompts.shape[1]} tokens, preset {preset} {kw}")
    try:
        summary = analyze(mdl, tok, prompts, layer_list, out, heldout=held, long_sequence=long_seq, seed=seed,
                          representative=rep, batch_size=batch_size, figures=figures, console=console, meta=meta,
                          **kw)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    conc = summary["concentration"]["mean"]
    line = (f"top-5 share {100 * conc['real_top5']:.1f}% vs Gaussian {100 * conc['gaussian_top5']:.1f}% "
            f"(at real coords {100 * conc['gaussian_at_real_top5']:.1f}%)")
    if "stability_inputs" in summary:
        s = summary["stability_inputs"]
        line += f"; held-out Spearman {s['mean_spearman']:.3f}, top-5 overlap {s['mean_top5_overlap']:.2f}/5"
    console.print(line)
    console.print(f"wrote {Path(out) / 'groups.json'}, {Path(out) / 'analysis.json'} and {Path(out) / 'figures'}")
