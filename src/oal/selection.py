"""Which layers to convert: rank calibrated candidate layers by a cheap criterion and keep the K best.

The paper (and LoLCATs, Liger) fixes a middle range and keeps the first and last layers on softmax. Once every
candidate layer is calibrated, two cheap criteria are available without any training:

- ``fidelity``: the layer's frozen-attention RelMSE after W_o on held-out blocks (Eq. 22, App. C), already
  computed per layer by the fidelity stage;
- ``probe``: a one-layer swap probe, the validation perplexity of the model with only that layer converted
  (calibrated kernel, no adaptation).

Lower is better for both. `conversion_curve` gives the perplexity before adaptation as more layers of an order
are converted, which the report draws for the criterion's order and for the paper's range.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from torch import nn

from .evaluate.perplexity import block_nll
from .models.convert import convert

__all__ = ["CRITERIA", "conversion_curve", "parse_auto", "rank_layers", "swap_probe"]

CRITERIA = ("fidelity", "probe")


def parse_auto(spec: str | None) -> int | None:
    """K of a layer spec 'auto:K', None for any other spec (an explicit list or range)."""
    if spec is None or not str(spec).strip().lower().startswith("auto"):
        return None
    _, _, k = str(spec).partition(":")
    try:
        value = int(k)
    except ValueError:
        raise ValueError(f"layers: expected 'auto:K' with an integer K >= 1, got {spec!r}") from None
    if value < 1:
        raise ValueError(f"layers: expected 'auto:K' with K >= 1, got {spec!r}")
    return value


def rank_layers(scores: Mapping[int, float]) -> list[int]:
    """Layers ordered best first (lowest score); ties keep the lower layer index first."""
    bad = {i: s for i, s in scores.items() if not math.isfinite(s)}
    if bad:
        raise ValueError(f"scores: non-finite values for layers {sorted(bad)}")
    return sorted(scores, key=lambda i: (scores[i], i))


def _ppl(model: nn.Module, blocks, batch_size: int) -> float:
    total, count = block_nll(model, blocks, batch_size=batch_size)
    return math.exp(total / count)


def swap_probe(make_model: Callable[[], nn.Module], methods: Mapping[int, nn.Module], blocks, *,
               batch_size: int = 1, progress: bool = False) -> dict[int, float]:
    """Validation perplexity with only layer i converted to `methods[i]`, for every i (no training)."""
    from rich.progress import Progress

    out = {}
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("swap probe", total=len(methods))
        for i in sorted(methods):
            out[i] = _ppl(convert(make_model(), [i], {i: methods[i]}), blocks, batch_size)
            bar.advance(task)
    return out


def conversion_curve(make_model: Callable[[], nn.Module], order: Sequence[int], methods: Mapping[int, nn.Module],
                     blocks, *, max_layers: int | None = None, batch_size: int = 1,
                     progress: bool = False) -> list[dict]:
    """[{"k", "layers", "ppl"}]: perplexity before adaptation with the first k layers of `order` converted."""
    from rich.progress import Progress

    order = list(order)[: max_layers or len(order)]
    missing = [i for i in order if i not in methods]
    if missing:
        raise ValueError(f"order: layers {missing} have no calibrated method")
    out = []
    with Progress(transient=True, disable=not progress) as bar:
        task = bar.add_task("conversion curve", total=len(order))
        for k in range(1, len(order) + 1):
            chosen = sorted(order[:k])
            model = convert(make_model(), chosen, {i: methods[i] for i in chosen})
            out.append({"k": k, "layers": chosen, "ppl": _ppl(model, blocks, batch_size)})
            bar.advance(task)
    return out
