"""Calibration straight from a model: capture one layer's frozen attention tensors, or calibrate global then OAL on
several layers in one pass over the blocks (the library entry point; `oal run` goes through `calibration.resume`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from oal.calibration.data import CalibConfig, LayerCalibration, LayerData
from oal.calibration.fit import calibrate_oal_layer
from oal.device import module_device
from oal.launch import log_console

__all__ = ["calibrate_model", "capture_layer_data"]


def capture_layer_data(model, input_ids: torch.Tensor, layer: int, batch_size: int = 4) -> LayerData:
    """Frozen q/k/v/softmax-out of `layer` for the blocks `input_ids` [S, N] (via `oal.models.capture`), on the
    model's device (the blocks go there first)."""
    from oal.models.capture import capture

    input_ids = input_ids.to(module_device(model))
    got = []
    with torch.no_grad():
        for start in range(0, input_ids.shape[0], batch_size):
            capture(model, input_ids[start : start + batch_size], [layer], got.append, stop_after_last=True)
    return LayerData.from_captured(got)


def calibrate_model(model, train_ids: torch.Tensor, val_ids: torch.Tensor, groups: Mapping[int, torch.Tensor],
                    cfg: CalibConfig | None = None, *, eps: float = 1e-6, progress: bool = False,
                    on_layer: Callable[[int, LayerCalibration, LayerCalibration], None] | None = None,
                    ) -> dict[int, tuple[LayerCalibration, LayerCalibration]]:
    """Calibrate global then OAL on every layer in `groups` (layer -> [Hq, d]); returns layer -> (global, oal).

    `on_layer(layer, global, oal)` is called after each layer (e.g. to checkpoint).
    """
    import tempfile

    from rich.progress import Progress

    from oal.models.capture_store import capture_to_disk

    cfg = cfg or CalibConfig()
    out = {}
    device = module_device(model)
    with (Progress(disable=not progress, console=log_console()) as bar,
          tempfile.TemporaryDirectory(prefix="oal-capture-") as tmp):
        # one forward per block for all layers (not one per layer), each layer's data streamed to its own files
        store = capture_to_disk(model, {"train": train_ids, "val": val_ids}, sorted(groups), tmp, key="calibrate")
        task = bar.add_task("calibrating", total=len(groups))
        for layer in sorted(groups):
            train, val = (LayerData(**store.load(r, layer, device)) for r in ("train", "val"))
            out[layer] = calibrate_oal_layer(train, val, groups[layer], cfg, layer=layer, eps=eps)
            if on_layer is not None:
                on_layer(layer, *out[layer])
            bar.advance(task)
    return out
