"""Frozen-attention fidelity (Eq. 21-22, App. C): metric definitions and aggregation over layers and sequences."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from oal.evaluate.fidelity import fidelity, sequence_errors, summarize
from oal.methods import build_method
from oal.models.capture import attention_module, capture

HQ, HKV, D = 4, 2, 8


def _model():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=43, hidden_size=HQ * D, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=HQ, num_key_value_heads=HKV, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).eval()


def test_metric_definitions_by_hand():
    exact = torch.tensor([[1.0, 2.0], [3.0, 0.0]]).view(2, 2)
    approx = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    err, energy, n = sequence_errors(exact, approx)
    assert err.tolist() == [1.0, 9.0] and energy.tolist() == [5.0, 9.0] and n == 2
    res = summarize(err, energy, n)
    assert res["mse"] == pytest.approx((1 / 2 + 9 / 2) / 2)  # Eq. 21
    assert res["relmse"] == pytest.approx((1 / 5 + 9 / 9) / 2)  # Eq. 22: per sequence, then averaged
    with pytest.raises(ValueError, match="approx"):
        sequence_errors(exact, approx[:1])


def test_fidelity_matches_manual_aggregation():
    model = _model()
    blocks = torch.randint(0, 43, (3, 17), generator=torch.Generator().manual_seed(1))
    layers = [0, 2]
    methods = {"global": {i: build_method("global", HQ, HKV, D) for i in layers},
               "softmax": {i: build_method("softmax", HQ, HKV, D) for i in layers}}
    res = fidelity(model, blocks, methods, batch_size=2)
    assert res["softmax"]["mse"] == pytest.approx(0, abs=1e-12)
    assert res["softmax"]["relmse_post_o"] == pytest.approx(0, abs=1e-10)
    # manual: every layer and head of one sequence in one tensor; post-o = heads concatenated @ W_o^T
    got = []
    with torch.no_grad():
        capture(model, blocks, layers, got.append)
    pre_err, pre_en, post_err, post_en = 0, 0, 0, 0
    for c in got:
        with torch.no_grad():
            y = methods["global"][c.layer](c.q, c.k, c.v)
        w = attention_module(model, c.layer).o_proj.weight.detach()

        def to_post(t, w=w):
            return t.transpose(1, 2).reshape(t.shape[0], t.shape[2], -1) @ w.T

        pre_err = pre_err + (y - c.out).double().square().sum((1, 2, 3))
        pre_en = pre_en + c.out.double().square().sum((1, 2, 3))
        post_err = post_err + (to_post(y) - to_post(c.out)).double().square().sum((1, 2))
        post_en = post_en + to_post(c.out).double().square().sum((1, 2))
    n_pre = 2 * HQ * 17 * D
    g = res["global"]
    assert g["mse"] == pytest.approx(float((pre_err / n_pre).mean()), rel=1e-6)
    assert g["relmse"] == pytest.approx(float((pre_err / pre_en).mean()), rel=1e-6)
    assert g["relmse_post_o"] == pytest.approx(float((post_err / post_en).mean()), rel=1e-5)
    assert g["mse_post_o"] == pytest.approx(float((post_err / (2 * 17 * HQ * D)).mean()), rel=1e-5)
    assert set(g["per_layer"]) == {"0", "2"} and g["relmse"] > 0


def test_a_subset_of_layers_aggregates_as_eq_22_over_its_layers():
    """Sec. 5.1 measures Table 2 on Layers 4, 12 and 20 of the 18 converted: a named subset of the evaluated layers
    sums error and energy over its layers per sequence (Eq. 22), not the mean of the per-layer RelMSEs."""
    model = _model()
    blocks = torch.randint(0, 43, (3, 17), generator=torch.Generator().manual_seed(1))
    methods = {"global": {i: build_method("taylorshift", HQ, HKV, D, layer_idx=i) for i in (0, 1, 2)}}
    res = fidelity(model, blocks, methods, subsets={"pair": [2, 0], "one": [1]})["global"]
    only = fidelity(model, blocks, {"global": {i: methods["global"][i] for i in (0, 2)}})["global"]
    pair = res["subsets"]["pair"]
    assert pair["layers"] == [0, 2]
    for k in ("mse", "relmse", "mse_post_o", "relmse_post_o"):
        assert pair[k] == pytest.approx(only[k], rel=1e-12)
        assert res["subsets"]["one"][k] == pytest.approx(res["per_layer"]["1"][k], rel=1e-12)
    mean = (res["per_layer"]["0"]["relmse"] + res["per_layer"]["2"]["relmse"]) / 2
    assert pair["relmse"] != pytest.approx(mean, rel=1e-6, abs=0)
    with pytest.raises(ValueError, match="subsets: 'far' must be some of the evaluated layers"):
        fidelity(model, blocks, methods, [0, 1], subsets={"far": [2]})


def test_bad_input():
    model = _model()
    with pytest.raises(ValueError, match="layers"):
        fidelity(model, torch.zeros(1, 4, dtype=torch.long), {"a": {0: build_method("global", HQ, HKV, D)},
                                                              "b": {1: build_method("global", HQ, HKV, D)}})
    with pytest.raises(ValueError, match="blocks"):
        fidelity(model, torch.zeros(4, dtype=torch.long), {"a": {0: build_method("global", HQ, HKV, D)}})
