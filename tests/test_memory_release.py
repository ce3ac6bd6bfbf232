"""Memory that `oal run` holds between and inside its stages.

The regime stage's fp64 query chunks stayed resident through glibc's arenas (SmolLM2-135M's regime stage on its 8
fidelity blocks: 7.7 GB RSS for ~10 MB of statistics, 1.6 GB with a trim per captured layer, and every later stage
started from there), and it kept the logits of every 8th query row whole (112 MB per 4096-token block and layer at
Qwen2.5-0.5B's shape: ~36 GB at the paper's sizes). These tests check the calls that give memory back, the cap on
the kept logits, and that neither changes a result below the cap; nothing is timed or measured in bytes."""

from __future__ import annotations

import sys

import pytest
import torch

import oal.analysis.regime as regime
import oal.device as device
from oal.methods import build_method
from oal.ops.kernel import perturbed_factor, taylor_factor


def _kernels(model, layers):
    gen = torch.Generator().manual_seed(1)
    cfg = model.config
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.hidden_size // hq
    out = {}
    for i in layers:
        groups = torch.randint(0, 3, (hq, d), generator=gen)
        factor = perturbed_factor(taylor_factor(hq, 3), 0.5, generator=gen)
        out[i] = build_method("oal", hq, hkv, d, groups=groups, factor=factor)
    return {"oal": out}


def _untrimmed(model, blocks, layers, kernels, **kw):
    """The accumulator over a plain capture: what attention_regime computed before it trimmed."""
    from oal.models.capture import capture

    acc = regime.RegimeAccumulator(kernels=kernels, **kw)
    for b in range(blocks.shape[0]):
        capture(model, blocks[b : b + 1], list(layers), acc, stop_after_last=True)
    res = acc.summary()
    res["settings"].update(blocks=list(blocks.shape))
    return res


def test_the_regime_trims_after_every_captured_layer_and_computes_the_same(monkeypatch):
    from _tiny import tiny_model

    model = tiny_model("qwen2", 50)
    blocks = torch.randint(0, 50, (3, 24), generator=torch.Generator().manual_seed(0))
    layers = [0, 2]
    kernels = _kernels(model, layers)
    want = _untrimmed(model, blocks, layers, kernels, min_keys=4, max_logits=regime.REGIME_LOGITS)
    calls = []
    monkeypatch.setattr(regime, "release_memory", lambda **kw: calls.append(kw) or device.release_memory(**kw))
    got = regime.attention_regime(model, blocks, layers, kernels=kernels, min_keys=4)
    assert got == want  # the same numbers, bit for bit (JSON-ready floats)
    assert len(calls) == blocks.shape[0] * len(layers)  # once per captured layer of every block
    uncapped = _untrimmed(model, blocks, layers, kernels, min_keys=4)
    assert got["layers"] == uncapped["layers"]  # short blocks keep every logit: nothing changes below the cap


def test_the_kept_logits_are_capped_per_sequence_and_head(monkeypatch):
    """Each block keeps at most `max_logits` logits per head for the quantiles (evenly spaced), where the whole
    sample of every 8th query row grew as N^2 per block and layer."""
    from _tiny import tiny_model

    model = tiny_model("qwen2", 50)
    blocks = torch.randint(0, 50, (2, 96), generator=torch.Generator().manual_seed(0))
    kept = []
    real = regime.RegimeAccumulator.summary

    def summary(self):
        kept.extend(t.shape[1] for st in self.layers.values() for t in st["logits"])
        return real(self)

    monkeypatch.setattr(regime.RegimeAccumulator, "summary", summary)
    regime.attention_regime(model, blocks, [1], min_keys=4, max_logits=50)
    assert kept == [50, 50]  # every 8th of 96 rows x their keys would be ~600 per head
    kept.clear()
    regime.attention_regime(model, blocks, [1], min_keys=4, max_logits=None)
    assert min(kept) > 50


def test_every_stage_releases_memory_when_it_ends(tmp_path, monkeypatch):
    import oal.pipeline.base as base
    from oal.pipeline.config import RunConfig
    from oal.pipeline.decoder import Run

    run = Run(RunConfig.from_preset("default", methods="softmax"), tmp_path / "run", progress=False)
    run.setup()
    events = []
    monkeypatch.setattr(base, "release_memory", lambda **kw: events.append("release"))
    run.stage("probe", {"x": 1}, [], lambda: events.append("fn"))
    assert events == ["fn", "release"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_release_memory_trims_on_glibc():
    assert device.release_memory() in (True, False)  # musl: no malloc_trim, nothing to do
    if device._libc():
        assert device.release_memory(collect=False) is True
