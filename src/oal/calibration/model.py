"""Capture a model's frozen attention tensors for calibration: q/k/v and the softmax output of chosen layers, as
`LayerData` (`oal run` calibrates through `calibration.resume`, which streams the same capture to disk)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from oal.calibration.data import LayerData
from oal.device import module_device

__all__ = ["capture_batches", "capture_layer_data", "capture_layers_data"]


def capture_batches(model, input_ids: torch.Tensor, layers: Sequence[int], on_layer, batch_size: int = 4) -> None:
    """`on_layer(captured)` for each of `layers` and each batch of the blocks `input_ids` [S, N] (one forward per
    batch for every layer, via `oal.models.capture`), on the model's device (the blocks go there first)."""
    from oal.models.capture import capture

    input_ids = input_ids.to(module_device(model))
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], batch_size):
            capture(model, input_ids[start : start + batch_size], list(layers), on_layer, stop_after_last=True)


def capture_layers_data(model, input_ids: torch.Tensor, layers: Sequence[int], batch_size: int = 4
                        ) -> dict[int, LayerData]:
    """{layer: frozen q/k/v/softmax-out} of `layers` for the blocks `input_ids` [S, N] (`capture_batches`)."""
    got: dict[int, list] = {int(i): [] for i in layers}
    capture_batches(model, input_ids, list(got), lambda c: got[c.layer].append(c), batch_size)
    return {i: LayerData.from_captured(items) for i, items in got.items()}


def capture_layer_data(model, input_ids: torch.Tensor, layer: int, batch_size: int = 4) -> LayerData:
    """`capture_layers_data` of one layer."""
    return capture_layers_data(model, input_ids, [layer], batch_size)[int(layer)]
