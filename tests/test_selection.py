"""Layer selection: ranking, the one-layer swap probe, and a planted easy and hard layer."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _tiny import tiny_model

from oal.calibration.data import CalibConfig
from oal.calibration.fit import calibrate_methods
from oal.calibration.model import capture_layer_data
from oal.evaluate.fidelity import fidelity
from oal.evaluate.perplexity import perplexity
from oal.models.convert import convert
from oal.pipeline.selection import conversion_curve, parse_auto, rank_layers, swap_probe


def test_parse_auto():
    assert parse_auto("auto:3") == 3 and parse_auto("1-4") is None and parse_auto(None) is None
    for bad in ("auto", "auto:0", "auto:x"):
        with pytest.raises(ValueError, match="auto:K"):
            parse_auto(bad)


def test_rank_layers():
    assert rank_layers({3: 0.5, 1: 0.2, 2: 0.2}) == [1, 2, 3]
    with pytest.raises(ValueError, match="non-finite"):
        rank_layers({0: float("nan")})


@pytest.fixture(scope="module")
def planted():
    """Tiny Qwen2 where layer 0 attends uniformly (q = 0: any kernel is exact) and layer 2 sharply (q x 30)."""
    model = tiny_model("qwen2", vocab_size=97)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_proj.weight.zero_()
        model.model.layers[0].self_attn.q_proj.bias.zero_()
        model.model.layers[2].self_attn.q_proj.weight.mul_(30.0)
    gen = torch.Generator().manual_seed(0)
    blocks = {r: torch.randint(0, 97, (n, 32), generator=gen) for r, n in (("train", 4), ("val", 2), ("test", 3))}
    cfg = CalibConfig.preset("tiny")
    methods = {}
    for layer in range(3):
        train = capture_layer_data(model, blocks["train"], layer)
        val = capture_layer_data(model, blocks["val"], layer)
        methods[layer] = calibrate_methods(["global"], train, val, layer=layer, cfg=cfg)["global"][0]
    return model, methods, blocks


def test_planted_easy_layer_first_and_hard_layer_last(planted):
    model, methods, blocks = planted
    res = fidelity(model, blocks["test"], {"global": methods})["global"]["per_layer"]
    order = rank_layers({int(i): r["relmse_post_o"] for i, r in res.items()})
    assert order[0] == 0 and order[-1] == 2, res


def test_swap_probe_and_curve_match_manual_conversion(planted):
    model, methods, blocks = planted
    probe = swap_probe(lambda: copy.deepcopy(model), methods, blocks["test"])
    base = perplexity(model, blocks["test"])
    assert math.isclose(probe[0], base, rel_tol=1e-5)  # uniform attention is exact under any kernel
    by_hand = perplexity(convert(copy.deepcopy(model), [2], {2: methods[2]}), blocks["test"])
    assert probe[2] == pytest.approx(by_hand, rel=1e-12)
    curve = conversion_curve(lambda: copy.deepcopy(model), [2, 0, 1], methods, blocks["test"], max_layers=2)
    assert [c["layers"] for c in curve] == [[2], [0, 2]]
    assert curve[0]["ppl"] == pytest.approx(probe[2], rel=1e-12)
    with pytest.raises(ValueError, match="no calibrated"):
        conversion_curve(lambda: copy.deepcopy(model), [5], methods, blocks["test"])
