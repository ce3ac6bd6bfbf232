"""Table 2 for every method: calibrate each trainable method on frozen attention (Eq. 20, App. B protocol via
`oal.calibration.fit`), then measure frozen-attention fidelity on held-out blocks (Eq. 21-22 via
`oal.evaluate.fidelity`). Also the capture helpers the other diagnostics share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from oal.analysis.contributions import check_finite_attention
from oal.diagnostics.retained_error import SequenceQKV
from oal.models.capture import capture_batches

__all__ = [
    "TABLE2_METHODS",
    "calibrate_methods",
    "capture_chi",
    "capture_layers",
    "capture_sequences",
    "table2",
]

# Paper Table 2 rows, plus the learned global quadratic (G = 1) and OAL, and the sliding windows (issue 29).
TABLE2_METHODS = ("performer", "spectraformer", "dijiang", "taylorshift", "global", "oal", "swa", "global-swa",
                  "oal-swa")


def _checked(c, where: str) -> None:
    """Each layer's capture of each batch, before anything reads it: a layer whose attention overflows (float16)
    failed later as "q: non-finite values ...", naming no layer (as the analysis and calibration check theirs)."""
    check_finite_attention(c.layer, {"q": c.q, "k": c.k, "v": c.v, "out": c.out}, where, real=c.attention_mask)


def capture_sequences(model, blocks: torch.Tensor, layers: Sequence[int], *, batch_size: int = 4,
                      where: str = "the held-out fidelity blocks") -> dict:
    """{layer: [SequenceQKV per block]} for Table 1 (float64 copies, one sequence each). `where`: the blocks, as a
    non-finite layer's error names them."""
    out: dict[int, list[SequenceQKV]] = {int(i): [] for i in layers}

    def on_layer(c):
        _checked(c, where)
        for b in range(c.q.shape[0]):
            out[c.layer].append(SequenceQKV(*(t[b : b + 1].double() for t in (c.q, c.k, c.v))))

    capture_batches(model, blocks, layers, on_layer, batch_size)
    return out


def capture_chi(model, blocks: torch.Tensor, layers: Sequence[int], *, batch_size: int = 8) -> dict:
    """{layer: chi per prompt [Hq, P, d]} (Eq. 2) of grouping prompts [P, L], for the App. B groupings."""
    from oal.analysis import head_contributions

    got: dict[int, list] = {int(i): [] for i in layers}

    def on_layer(c):
        _checked(c, "the grouping prompts")
        got[c.layer].append(head_contributions(c.q, c.k).double())

    capture_batches(model, blocks, layers, on_layer, batch_size)
    return {i: torch.cat(v).transpose(0, 1) for i, v in got.items()}


def capture_layers(model, blocks: torch.Tensor, layers: Sequence[int], where: str, *, batch_size: int = 4) -> dict:
    """{layer: LayerData} of `blocks` [S, N] (`oal.calibration.model.capture_layers_data`), each layer's capture
    checked for non-finite values first; `where`: the blocks, as that error names them."""
    from oal.calibration.data import LayerData

    got: dict[int, list] = {int(i): [] for i in layers}

    def on_layer(c):
        _checked(c, where)
        got[c.layer].append(c)

    capture_batches(model, blocks, list(got), on_layer, batch_size)
    return {i: LayerData.from_captured(items) for i, items in got.items()}


def calibrate_methods(
    names: Sequence[str],
    train: Mapping[int, object],
    val: Mapping[int, object],
    groups: Mapping[int, torch.Tensor] | None = None,
    cfg=None,
    *,
    seed: int = 0,
    on_done: Callable[[str, int, dict], None] | None = None,
    options: Mapping | None = None,
) -> tuple[dict[str, dict[int, torch.nn.Module]], dict]:
    """Build and calibrate every method of `names` for every layer of `train` ({layer: LayerData}).

    Each layer goes through `oal.calibration.fit.calibrate_methods` (the global first, seeding one of OAL's starts;
    trainable baselines from their own parameters; Performer used as drawn with seed `seed`); `oal` needs
    `groups`; `options`: a run's method settings ({"window": W, "sinks": S}). Returns ({name: {layer: method}},
    {name: {layer: calibration summary}}).
    """
    from oal.calibration.fit import calibrate_methods as calibrate_layer_methods

    methods: dict[str, dict[int, torch.nn.Module]] = {n: {} for n in names}
    summaries: dict[str, dict] = {n: {} for n in names}
    for layer, tr in train.items():
        g = None if groups is None else groups.get(layer)
        done = calibrate_layer_methods(names, tr, val[layer], layer=layer, groups=g, cfg=cfg, seed=seed,
                                       options=options)
        for name, (method, res) in done.items():
            methods[name][layer] = method
            summaries[name][layer] = res.summary() if res is not None else {
                "layer": layer, "method": name, "calibrated": False}
            if on_done:
                on_done(name, layer, summaries[name][layer])
    return methods, summaries


def table2(model, fidelity_blocks: torch.Tensor, methods: Mapping[str, Mapping[int, torch.nn.Module]], *,
           batch_size: int = 1, progress: bool = False) -> dict:
    """metrics.json["fidelity"] for every method set: {name: {mse, relmse, mse_post_o, relmse_post_o, ...}}."""
    from oal.evaluate.fidelity import fidelity

    return fidelity(model, fidelity_blocks, methods, batch_size=batch_size, progress=progress)
