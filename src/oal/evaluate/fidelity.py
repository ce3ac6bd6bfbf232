"""Frozen-attention fidelity (paper Table 2 protocol, App. C, Eq. 21-22).

On held-out sequences, every evaluated layer's frozen post-RoPE q/k/v are fed to each method and its output is
compared with the exact softmax output of the same layer. For one sequence b, Y_b collects all evaluated layers
and heads; with n_b scalar elements:

    MSE    = 1/B sum_b ||Y_b - Yhat_b||_F^2 / n_b                                    (Eq. 21)
    RelMSE = 1/B sum_b ||Y_b - Yhat_b||_F^2 / ||Y_b||_F^2                          (Eq. 22)

Pre-o_proj: per-head outputs [Hq, N, dv]. Post-o_proj: heads concatenated in their original order and passed
through the frozen output projection *without its bias* (x -> o_proj(x) - o_proj(0)); the bias cancels in the
error and is left out of the normaliser too (Qwen2/Llama/Mistral/Qwen3 have no o_proj bias anyway).

Encoders (BERT family): the captured layers are non-causal, so each method runs with every real key visible
(`models.encoder.noncausal_attention`); W_o is `attention.output.dense`; padded query positions are left out of
both the error and n_b (a sequence's n_b counts its real tokens only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from oal.device import module_device, to_device
from oal.launch import progress_bar

__all__ = ["fidelity", "sequence_errors", "summarize"]


def sequence_errors(exact: torch.Tensor, approx: torch.Tensor, mask: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, int | torch.Tensor]:
    """Per-sequence (squared error [B], energy [B], n elements per sequence) for tensors [B, ...].

    `mask` (broadcastable to `exact`, 1 = counted) keeps only real positions; n is then a tensor [B].
    """
    if exact.shape != approx.shape:
        raise ValueError(f"approx: expected shape {tuple(exact.shape)}, got {tuple(approx.shape)}")
    diff, ex = approx.double() - exact.double(), exact.double()
    if mask is None:
        return diff.flatten(1).square().sum(1), ex.flatten(1).square().sum(1), diff.flatten(1).shape[1]
    w = mask.to(torch.float64).expand_as(diff)
    return (diff * w).flatten(1).square().sum(1), (ex * w).flatten(1).square().sum(1), w.flatten(1).sum(1)


def summarize(err: torch.Tensor, energy: torch.Tensor, n: int | torch.Tensor) -> dict[str, float]:
    """MSE (Eq. 21) and RelMSE (Eq. 22) from per-sequence sums; RelMSE normalises each sequence, then averages."""
    return {"mse": float((err / n).mean()), "relmse": float((err / energy).mean())}


def _post_o(o_proj, y: torch.Tensor) -> torch.Tensor:
    """[B, Hq, N, dv] -> [B, N, hidden]: concatenate heads in order, apply o_proj without bias."""
    b, h, n, dv = y.shape
    x = y.transpose(1, 2).reshape(b, n, h * dv).to(o_proj.weight.dtype)
    return o_proj(x) - o_proj(torch.zeros_like(x[:, :1]))


@torch.no_grad()
def fidelity(model, blocks: torch.Tensor, methods: Mapping[str, Mapping[int, torch.nn.Module]],
             layers: Sequence[int] | None = None, *, batch_size: int = 1, progress: bool = False,
             attention_mask: torch.Tensor | None = None, subsets: Mapping[str, Sequence[int]] | None = None) -> dict:
    """Table 2 metrics for each named method set on held-out `blocks` [B, N] (disjoint from calibration).

    `methods` maps a name (e.g. "oal", "global") to {layer: AttentionMethod}. `layers` defaults to the layers
    every method set covers. Returns {name: {"mse", "relmse", "mse_post_o", "relmse_post_o", "per_layer": {...}}}
    as in metrics.json["fidelity"]; "per_layer" holds the same four numbers for each layer on its own, and
    "subsets" (with `subsets` {label: layers}) the four numbers over each named subset of `layers`, summed over its
    layers as Eq. 22 sums over the evaluated ones (the paper's Table 2 layers of a preset).
    `attention_mask` [B, N] (encoders' padded passages) leaves padded positions out.

    Devices: the blocks, the mask and the methods (moved in place) go to the model's device here, once; the sums
    stay there until the four numbers come back at the end.
    """
    from oal.models.capture import capture, output_projection
    from oal.models.encoder import noncausal_attention

    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2:
        raise ValueError(f"blocks: expected a LongTensor [n_blocks, N], got {getattr(blocks, 'shape', blocks)}")
    if not methods:
        raise ValueError("methods: expected at least one named set of layer methods")
    if attention_mask is not None and attention_mask.shape != blocks.shape:
        raise ValueError(f"attention_mask: expected shape {tuple(blocks.shape)}, got {tuple(attention_mask.shape)}")
    common = set.intersection(*(set(m) for m in methods.values()))
    layers = sorted(common) if layers is None else sorted(layers)
    if not layers or not set(layers) <= common:
        raise ValueError(f"layers: every method set must cover the evaluated layers {layers}; common: {sorted(common)}")
    subsets = {label: sorted(int(i) for i in over) for label, over in (subsets or {}).items()}
    for label, over in subsets.items():
        if not over or not set(over) <= set(layers):
            raise ValueError(f"subsets: {label!r} must be some of the evaluated layers {layers}, got {over}")
    device = module_device(model)
    blocks, attention_mask, methods = to_device((blocks, attention_mask, methods), device)
    keys = ("pre", "post")
    # acc[name][layer][key] = list of (err [b], energy [b], n [b])
    acc = {name: {i: {k: [] for k in keys} for i in layers} for name in methods}

    def on_layer(c):
        o_proj = output_projection(model, c.layer)
        exact_post = _post_o(o_proj, c.out)
        valid = None if c.attention_mask is None else c.attention_mask.bool()
        weights = {"pre": None, "post": None} if valid is None else {"pre": valid[:, None, :, None],
                                                                      "post": valid[:, :, None]}
        for name, per_layer in methods.items():
            m = per_layer[c.layer]
            dtype = next(iter(m.parameters()), torch.empty(0, dtype=torch.float32)).dtype
            q, k, v = c.q.to(dtype), c.k.to(dtype), c.v.to(dtype)
            y = m(q, k, v, causal=True) if c.causal else noncausal_attention(m, q, k, v, valid)
            for key, (ex, ap) in {"pre": (c.out, y), "post": (exact_post, _post_o(o_proj, y))}.items():
                err, energy, n = sequence_errors(ex, ap, weights[key])
                n = torch.as_tensor(n, dtype=torch.float64, device=err.device).expand_as(err)
                acc[name][c.layer][key].append((err, energy, n))


    with progress_bar(progress) as bar:
        task = bar.add_task("fidelity", total=blocks.shape[0])
        for start in range(0, blocks.shape[0], batch_size):
            mask = None if attention_mask is None else attention_mask[start : start + batch_size]
            capture(model, blocks[start : start + batch_size], layers, on_layer, mask, stop_after_last=True)
            bar.advance(task, min(batch_size, blocks.shape[0] - start))

    def totals(name, key, over):  # per-sequence (err, energy, n) summed over the layers `over`
        return [sum(torch.cat([entry[j] for entry in acc[name][i][key]]) for i in over) for j in range(3)]

    def four(name, over):  # MSE and RelMSE before and after W_o over the layers `over` (Eq. 21-22)
        return {metric + suffix: value for key, suffix in (("pre", ""), ("post", "_post_o"))
                for metric, value in summarize(*totals(name, key, over)).items()}

    out = {}
    for name in methods:
        out[name] = {**four(name, layers), "per_layer": {str(i): four(name, [i]) for i in layers}}
        if subsets:
            out[name]["subsets"] = {label: {"layers": over, **four(name, over)} for label, over in subsets.items()}
    return out
