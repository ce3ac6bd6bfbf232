"""Frozen-attention fidelity (paper Table 2 protocol, App. C, Eq. 21-22).

On held-out sequences, every evaluated layer's frozen post-RoPE q/k/v are fed to each method and its output is
compared with the exact softmax output of the same layer. For one sequence b, Y_b collects all evaluated layers
and heads; with n_b scalar elements:

    MSE    = 1/B sum_b ||Y_b - Yhat_b||_F^2 / n_b                                    (Eq. 21)
    RelMSE = 1/B sum_b ||Y_b - Yhat_b||_F^2 / ||Y_b||_F^2                          (Eq. 22)

Pre-o_proj: per-head outputs [Hq, N, dv]. Post-o_proj: heads concatenated in their original order and passed
through the frozen output projection *without its bias* (x -> o_proj(x) - o_proj(0)); the bias cancels in the
error and is left out of the normaliser too (Qwen2/Llama/Mistral/Qwen3 have no o_proj bias anyway).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["fidelity", "sequence_errors", "summarize"]


def sequence_errors(exact: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Per-sequence (squared error [B], energy [B], n elements per sequence) for tensors [B, ...]."""
    if exact.shape != approx.shape:
        raise ValueError(f"approx: expected shape {tuple(exact.shape)}, got {tuple(approx.shape)}")
    diff = (approx.double() - exact.double()).flatten(1)
    return diff.square().sum(1), exact.double().flatten(1).square().sum(1), diff.shape[1]


def summarize(err: torch.Tensor, energy: torch.Tensor, n: int) -> dict[str, float]:
    """MSE (Eq. 21) and RelMSE (Eq. 22) from per-sequence sums; RelMSE normalises each sequence, then averages."""
    return {"mse": float((err / n).mean()), "relmse": float((err / energy).mean())}


def _post_o(attn_module, y: torch.Tensor) -> torch.Tensor:
    """[B, Hq, N, dv] -> [B, N, hidden]: concatenate heads in order, apply o_proj without bias."""
    b, h, n, dv = y.shape
    x = y.transpose(1, 2).reshape(b, n, h * dv).to(attn_module.o_proj.weight.dtype)
    return attn_module.o_proj(x) - attn_module.o_proj(torch.zeros_like(x[:, :1]))


@torch.no_grad()
def fidelity(model, blocks: torch.Tensor, methods: Mapping[str, Mapping[int, torch.nn.Module]],
             layers: Sequence[int] | None = None, *, batch_size: int = 1, progress: bool = False) -> dict:
    """Table 2 metrics for each named method set on held-out `blocks` [B, N] (disjoint from calibration).

    `methods` maps a name (e.g. "oal", "global") to {layer: AttentionMethod}. `layers` defaults to the layers
    every method set covers. Returns {name: {"mse", "relmse", "mse_post_o", "relmse_post_o", "per_layer": {...}}}
    as in metrics.json["fidelity"]; "per_layer" holds the same four numbers for each layer on its own.
    """
    from ..models.capture import attention_module, capture

    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2:
        raise ValueError(f"blocks: expected a LongTensor [n_blocks, N], got {getattr(blocks, 'shape', blocks)}")
    if not methods:
        raise ValueError("methods: expected at least one named set of layer methods")
    common = set.intersection(*(set(m) for m in methods.values()))
    layers = sorted(common) if layers is None else sorted(layers)
    if not layers or not set(layers) <= common:
        raise ValueError(f"layers: every method set must cover the evaluated layers {layers}; common: {sorted(common)}")
    keys = ("pre", "post")
    # acc[name][layer][key] = list of (err [b], energy [b]); n per layer and key
    acc = {name: {i: {k: [] for k in keys} for i in layers} for name in methods}
    sizes: dict[tuple[int, str], int] = {}

    def on_layer(c):
        attn = attention_module(model, c.layer)
        exact_post = _post_o(attn, c.out)
        for name, per_layer in methods.items():
            m = per_layer[c.layer]
            dtype = next(iter(m.parameters()), torch.empty(0, dtype=torch.float32)).dtype
            y = m(c.q.to(dtype), c.k.to(dtype), c.v.to(dtype), causal=True)
            for key, (ex, ap) in {"pre": (c.out, y), "post": (exact_post, _post_o(attn, y))}.items():
                err, energy, n = sequence_errors(ex, ap)
                acc[name][c.layer][key].append((err, energy))
                sizes[(c.layer, key)] = n

    from rich.progress import Progress

    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("fidelity", total=blocks.shape[0])
        for start in range(0, blocks.shape[0], batch_size):
            capture(model, blocks[start : start + batch_size], layers, on_layer, stop_after_last=True)
            bar.advance(task, min(batch_size, blocks.shape[0] - start))

    out = {}
    for name in methods:
        res: dict = {}
        for key, suffix in (("pre", ""), ("post", "_post_o")):
            err = sum(torch.cat([e for e, _ in acc[name][i][key]]) for i in layers)
            energy = sum(torch.cat([s for _, s in acc[name][i][key]]) for i in layers)
            n = sum(sizes[(i, key)] for i in layers)
            for metric, value in summarize(err, energy, n).items():
                res[metric + suffix] = value
        res["per_layer"] = {}
        for i in layers:
            row = {}
            for key, suffix in (("pre", ""), ("post", "_post_o")):
                err = torch.cat([e for e, _ in acc[name][i][key]])
                energy = torch.cat([s for _, s in acc[name][i][key]])
                for metric, value in summarize(err, energy, sizes[(i, key)]).items():
                    row[metric + suffix] = value
            res["per_layer"][str(i)] = row
        out[name] = res
    return out


def run_fidelity(run_dir, methods: Sequence[str], held_out, *, adapter: bool | None = None, model: str | None = None,
                 device: str = "cpu", progress: bool = False) -> dict[str, dict]:
    """Fidelity of a run directory's converted models, method by method (`oal.export.load_converted`).

    Without an adapter: the calibrated kernels against the base model's softmax attention (Table 2), under
    "fidelity". With the run's adapter for a method (`adapter` as in load_converted): the trained kernels against
    the softmax attention of the same LoRA-merged weights, under "fidelity_adapted". `held_out(tokenizer, model)`
    returns the blocks [B, N] (called once, with the first method's model). Returns {key: {method: metrics}},
    plus "model" (the base model) and "converted_layers" (of the first method), as metrics.json records them.
    """
    from ..export import load_converted, softmax_twin
    from ..models.convert import converted_methods

    out: dict = {"fidelity": {}, "fidelity_adapted": {}}
    blocks = None
    for name in methods:
        converted, tokenizer, info = load_converted(run_dir, name, adapter, model=model, device=device)
        if blocks is None:
            blocks = held_out(tokenizer, converted).to(device)
            out["model"], out["converted_layers"] = info["base_model"], sorted(converted_methods(converted))
        teacher = softmax_twin(converted, info["base_model"], device=device)
        key = "fidelity_adapted" if info["adapter"] else "fidelity"
        out[key].update(fidelity(teacher, blocks, {name: converted_methods(converted)}, progress=progress))
    return out
