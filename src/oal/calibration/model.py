"""Capture a model's frozen attention tensors for calibration: q/k/v and the softmax output of chosen layers, as
`LayerData` (`oal run` calibrates through `calibration.resume`, which streams the same capture to disk)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from oal.calibration.data import LayerData

__all__ = ["capture_layer_data", "capture_layers_data"]


def capture_layers_data(model, input_ids: torch.Tensor, layers: Sequence[int], batch_size: int = 4
                        ) -> dict[int, LayerData]:
    """{layer: frozen q/k/v/softmax-out} of `layers` for the blocks `input_ids` [S, N] (one forward per batch for
    every layer: `oal.models.capture.capture_batches`)."""
    from oal.models.capture import capture_batches

    got: dict[int, list] = {int(i): [] for i in layers}
    capture_batches(model, input_ids, list(got), lambda c: got[c.layer].append(c), batch_size)
    return {i: LayerData.from_captured(items) for i, items in got.items()}


def capture_layer_data(model, input_ids: torch.Tensor, layer: int, batch_size: int = 4) -> LayerData:
    """`capture_layers_data` of one layer."""
    return capture_layers_data(model, input_ids, [layer], batch_size)[int(layer)]
