"""Calibration by output matching (Eq. 20): fast paths vs references, batched vs per-head sequential loop."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from oal.calibration.data import CalibConfig, LayerData
from oal.calibration.fit import (
    _clip_and_mask,
    calibrate_layer,
    calibrate_layer_sequential,
    calibrate_oal_layer,
    oal_inits,
    sampled_dense_output,
)
from oal.calibration.loss import _oal_dense_kernel
from oal.calibration.model import capture_layer_data, capture_layers_data
from oal.methods import build_method
from oal.ops.kernel import perturbed_factor

HQ, HKV, D = 4, 2, 8


def _data(n_seq, n_tok=37, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    q = 1.5 * torch.randn(n_seq, HQ, n_tok, D, generator=gen, dtype=dtype)
    k = torch.randn(n_seq, HKV, n_tok, D, generator=gen, dtype=dtype)
    v = torch.randn(n_seq, HKV, n_tok, D, generator=gen, dtype=dtype)
    out = build_method("softmax", HQ, HKV, D)(q, k, v)
    return LayerData(q, k, v, out)


def _oal(groups, seed=0):
    m = build_method("oal", HQ, HKV, D, groups=groups, n_groups=int(groups.max()) + 1).double()
    with torch.no_grad():
        m.factor.copy_(perturbed_factor(m.factor, 0.3, torch.Generator().manual_seed(seed)))
    return m


def _groups(seed=0, n_groups=3):
    return torch.randint(0, n_groups, (HQ, D), generator=torch.Generator().manual_seed(seed))


def test_vectorised_dense_kernel_matches_reference_outputs_and_grads():
    m = _oal(_groups())
    data = _data(2, n_tok=13)
    q, k = data.q[:, :, :5].clone().requires_grad_(), data.k.clone().requires_grad_()
    fast = _oal_dense_kernel(m, q, k)
    ref = m.dense_kernel(q, k)
    torch.testing.assert_close(fast, ref, rtol=1e-10, atol=1e-12)
    w = torch.randn_like(ref)
    g_fast = torch.autograd.grad((fast * w).sum(), (q, k, m.factor))
    g_ref = torch.autograd.grad((ref * w).sum(), (q, k, m.factor))
    for a, b in zip(g_fast, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_stacked_initialisations_share_scores_exactly():
    """Three stacked copies (initialisations) of the heads: shared s_bar, per-copy L, equal to per-copy reference."""
    from oal.calibration.fit import _fold
    from oal.calibration.loss import _val_mse

    groups = _groups()
    copies = [_oal(groups, seed=s) for s in range(3)]
    folded = _fold(copies)
    data = _data(2, n_tok=15)
    q, k = data.q[:, :, 3:9], data.k
    got = _oal_dense_kernel(folded, q, k, n_copies=3)
    want = torch.cat([c.dense_kernel(q, k) for c in copies], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # validation: dense path (short sequences) equals the linear-time forward of each copy
    val = _val_mse(folded, data, n_copies=3, query_chunk=4)
    ref = torch.cat([(c(data.q, data.k, data.v) - data.out).square().mean(dim=(0, 2, 3)) for c in copies])
    torch.testing.assert_close(val, ref, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("method", ["oal", "softmax"])
def test_sampled_output_equals_rows_of_reference(method):
    m = _oal(_groups()) if method == "oal" else build_method("softmax", HQ, HKV, D)
    data = _data(1, n_tok=29)
    pos = torch.tensor([0, 3, 17, 28])
    got = sampled_dense_output(m, data.q, data.k, data.v, pos)
    want = m.reference(data.q, data.k, data.v, causal=True)[:, :, pos]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_batched_equals_sequential_and_improves_on_taylor():
    groups = _groups()
    cfg = CalibConfig.preset("tiny", dtype="float64", max_steps=20, val_every=5, patience=10)
    train, val = _data(3), _data(1, seed=1)
    g_b, o_b = calibrate_oal_layer(train, val, groups, cfg, layer=2)
    g_s, o_s = calibrate_oal_layer(train, val, groups, cfg, layer=2, sequential=True)
    for batched, seq in ((g_b, g_s), (o_b, o_s)):
        assert [h.init for h in batched.heads] == [h.init for h in seq.heads]
        assert [h.best_step for h in batched.heads] == [h.best_step for h in seq.heads]
        assert [h.steps for h in batched.heads] == [h.steps for h in seq.heads]
        torch.testing.assert_close(torch.tensor([h.val_mse for h in batched.heads]),
                                   torch.tensor([h.val_mse for h in seq.heads]), rtol=1e-9, atol=0)
        torch.testing.assert_close(batched.params["factor"], seq.params["factor"], rtol=1e-7, atol=1e-9)
    assert o_b.layer == 2 and len(o_b.heads) == HQ
    for h in o_b.heads:
        taylor_start = h.curves["taylor"][0][1]
        assert h.val_mse < taylor_start  # calibration beats the Taylor start on held-out validation
        assert h.val_mse == min(h.val_mse_by_init.values())
        assert h.val_mse == pytest.approx(h.val_mse_by_init[h.init])


def test_selected_params_reproduce_recorded_val_mse():
    groups = _groups(1)
    cfg = CalibConfig.preset("tiny", dtype="float64", max_steps=20, val_every=5)
    train, val = _data(2), _data(1, seed=3)
    _, res = calibrate_oal_layer(train, val, groups, cfg)
    m = res.apply(build_method("oal", HQ, HKV, D, groups=groups, n_groups=3).double())
    per_head = (m(val.q, val.k, val.v) - val.out).square().mean(dim=(0, 2, 3))
    torch.testing.assert_close(per_head, torch.tensor([h.val_mse for h in res.heads], dtype=torch.float64))


def test_global_embedded_init_reproduces_global_kernel():
    groups = _groups()
    glob = build_method("global", HQ, HKV, D).double()
    with torch.no_grad():
        glob.factor.copy_(perturbed_factor(glob.factor, 0.5, torch.Generator().manual_seed(4)))
    init = oal_inits(glob.factor, 3, CalibConfig())["global_embedded"]["factor"]
    oal = build_method("oal", HQ, HKV, D, groups=groups, factor=init).double()
    data = _data(1, n_tok=11)
    torch.testing.assert_close(oal(data.q, data.k, data.v), glob(data.q, data.k, data.v), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["taylorshift", "spectraformer"])
def test_generic_methods_single_init(name):
    m = build_method(name, HQ, HKV, D).double()
    assert m.trainable
    cfg = CalibConfig.preset("tiny", dtype="float64", max_steps=10, val_every=5)
    train, val = _data(2), _data(1, seed=1)
    res = calibrate_layer(m, train, val, cfg)
    seq = calibrate_layer_sequential(m, train, val, cfg)
    assert [h.val_mse for h in res.heads] == pytest.approx([h.val_mse for h in seq.heads], rel=1e-9)
    assert set(res.params) == {n for n, p in m.named_parameters() if p.requires_grad}
    if not res.per_head:
        assert len(res.heads) == 1 and res.heads[0].head == -1


def test_bad_input():
    with pytest.raises(ValueError, match="max_steps"):
        CalibConfig(max_steps=0)
    with pytest.raises(ValueError, match="preset"):
        CalibConfig.preset("nope")
    m = _oal(_groups())
    train = _data(1)
    with pytest.raises(ValueError, match="query heads"):
        calibrate_layer(build_method("oal", 2, 2, D), train, train, CalibConfig.preset("tiny"))
    with pytest.raises(ValueError, match="inits"):
        calibrate_layer(m, train, train, CalibConfig.preset("tiny"), {"x": {"factor": torch.zeros(1, 2, 2)}})
    with pytest.raises(ValueError, match="groups"):
        calibrate_oal_layer(train, train, torch.zeros(HQ, D + 1, dtype=torch.long))


def test_capture_of_several_layers_in_one_pass_is_each_layers_own():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                      num_attention_heads=HQ, num_key_value_heads=HKV, max_position_embeddings=64)
    model = Qwen2ForCausalLM(cfg).eval()
    ids = torch.randint(0, 61, (3, 24), generator=torch.Generator().manual_seed(0))
    data = capture_layer_data(model, ids, 1, batch_size=2)
    assert data.q.shape == (3, HQ, 24, D) and data.k.shape == (3, HKV, 24, D) and data.out.shape == (3, HQ, 24, D)
    both = capture_layers_data(model, ids, [2, 1])
    assert sorted(both) == [1, 2]
    for name in ("q", "k", "v", "out"):
        torch.testing.assert_close(getattr(both[1], name), getattr(data, name), rtol=0, atol=0)
    assert not torch.equal(both[2].q, both[1].q)


def _planted(seed, n_seq, n_tok=64):
    """Heads whose true kernel weights a 3-dim outlier group differently from the bulk (Eq. 7 with a heterogeneous
    L): OAL with those groups can represent it, a single quadratic in the total score cannot."""
    groups = torch.zeros(HQ, D, dtype=torch.long)
    groups[:, :3] = 1
    lower = torch.zeros(HQ, 3, 3)
    lower[:, 0, 0], lower[:, 1, 0], lower[:, 1, 1], lower[:, 2, 0], lower[:, 2, 2] = 1.0, 0.5, 0.3, 2.0, 1.0
    true = build_method("oal", HQ, HKV, D, groups=groups, factor=lower)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(n_seq, h, n_tok, D, generator=gen) for h in (HQ, HKV, HKV))
    with torch.no_grad():
        return LayerData(q, k, v, true.reference(q, k, v)), groups


def test_oal_beats_global_on_planted_heterogeneous_heads():
    (train, groups), (val, _), (held, _) = _planted(0, 4), _planted(1, 2), _planted(2, 2)
    cfg = CalibConfig(max_steps=60, val_every=20, patience=60)
    g_res, o_res = calibrate_oal_layer(train, val, groups, cfg)
    glob = g_res.apply(build_method("global", HQ, HKV, D))
    oal = o_res.apply(build_method("oal", HQ, HKV, D, groups=groups, n_groups=2))
    with torch.no_grad():
        err = {name: (m(held.q, held.k, held.v) - held.out).square().mean(dim=(0, 2, 3))
               for name, m in (("global", glob), ("oal", oal))}
    assert (err["oal"] < 0.2 * err["global"]).all()  # every head, on held-out sequences
    assert all(o.val_mse < 0.2 * g.val_mse for o, g in zip(o_res.heads, g_res.heads, strict=True))


def test_loss_is_the_eq20_sum_over_sampled_queries(monkeypatch):
    """The first update's gradient (before clipping) is that of 1/2 sum_i ||y_i(L) - y_i^softmax||^2 over the
    sampled queries of the sampled sequence, per head (Eq. 20), recomputed here through the dense reference."""
    import oal.calibration.fit as calibrate

    train, val = _data(3, n_tok=40, seed=5), _data(1, n_tok=40, seed=6)
    groups = _groups(2)
    seen = []
    original = calibrate._clip_and_mask

    def record(params, stopped, clip_norm, per_head):
        seen.append(params["factor"].grad.detach().clone())
        return original(params, stopped, clip_norm, per_head)

    monkeypatch.setattr(calibrate, "_clip_and_mask", record)
    cfg = CalibConfig(max_steps=1, val_every=1, queries=7, seed=11, dtype="float64")
    start = _oal(groups)
    calibrate_layer(start, train, val, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)  # the loop's draws: one sequence, then the query positions
    s = int(torch.randint(train.q.shape[0], (1,), generator=gen))
    pos = torch.randperm(train.q.shape[2], generator=gen)[:7].sort().values
    ref = build_method("oal", HQ, HKV, D, groups=groups, n_groups=3).double()
    with torch.no_grad():
        ref.factor.copy_(start.factor)  # fp64 values (the constructor would round them to fp32)
    y = ref.reference(train.q[s : s + 1], train.k[s : s + 1], train.v[s : s + 1])[:, :, pos]  # Eq. 7, dense
    loss = 0.5 * (y - train.out[s : s + 1, :, pos]).square().sum()
    (grad,) = torch.autograd.grad(loss, ref.factor)
    torch.testing.assert_close(seen[0], grad, rtol=1e-8, atol=1e-10)


def _grads(values):
    """Parameters whose gradients are `values` (one per unit of the leading axis), spread over two tensors."""
    v = torch.tensor(values, dtype=torch.float64)
    params = {"a": torch.zeros(v.shape[0], 1, 1, dtype=torch.float64, requires_grad=True),
              "b": torch.zeros(v.shape[0], 1, dtype=torch.float64, requires_grad=True)}
    params["a"].grad, params["b"].grad = v[:, :1, None].clone(), v[:, 1:].clone()
    return params


def test_clip_and_mask_clips_each_head_to_the_max_norm_and_zeroes_stopped_heads():
    """App. B (coefficient calibration): gradient norm clipped at 10, per head as if each were optimised alone: a
    head under the norm is left as it is (never scaled up), one over it rescaled to norm 10, a stopped head gets
    zero gradient; NaN gradients count as 0."""
    params = _grads([[0.3, float("nan")], [30.0, 40.0], [3.0, 4.0]])  # head norms 0.3, 50, 5
    _clip_and_mask(params, torch.tensor([False, False, True]), 10.0, per_head=True)
    got = torch.cat([params["a"].grad.flatten(1), params["b"].grad], 1)
    want = torch.tensor([[0.3, 0.0], [30.0 * 10 / 50, 40.0 * 10 / 50], [0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_clip_and_mask_clips_the_global_norm_of_one_unit():
    """Without per-head units the joint norm is clipped the same way; a stopped run gets zero gradient."""
    small, large = _grads([[0.3, 0.4]]), _grads([[30.0, 40.0]])
    for params in (small, large):
        _clip_and_mask(params, torch.tensor([False]), 10.0, per_head=False)
    torch.testing.assert_close(torch.cat([small["a"].grad.flatten(), small["b"].grad.flatten()]),
                               torch.tensor([0.3, 0.4], dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.cat([large["a"].grad.flatten(), large["b"].grad.flatten()]),
                               torch.tensor([6.0, 8.0], dtype=torch.float64), rtol=1e-6, atol=0)
    stopped = _grads([[30.0, 40.0]])
    _clip_and_mask(stopped, torch.tensor([True]), 10.0, per_head=False)
    assert not stopped["a"].grad.any() and not stopped["b"].grad.any()


def test_calibration_summary_is_strict_json():
    import json

    train, val = _data(2, seed=3, dtype=torch.float32), _data(1, seed=4, dtype=torch.float32)
    res = calibrate_layer(build_method("global", HQ, HKV, D), train, val, CalibConfig(max_steps=4, val_every=2))
    text = json.dumps(res.summary(), allow_nan=False)  # raises on a bare NaN
    assert '"curves"' in text and "null" in text  # step 0 has no training loss yet: null, not NaN


@pytest.mark.parametrize("name", ["q", "k", "v", "out"])
def test_non_finite_captures_are_refused_by_name(name):
    """Eq. 20 matches the softmax output on frozen q, k, v: a NaN or inf in a capture (an fp16 overflow) would zero
    those heads' gradients and mark their validation MSE inf, leaving them at an initialisation without a word.
    LayerData refuses it, naming the tensor; padded positions of the softmax output (never scored) may be anything."""
    data = _data(2, n_tok=9)
    bad = {n: getattr(data, n).clone() for n in ("q", "k", "v", "out")}
    bad[name][1, 0, 4, 2] = float("nan") if name in ("q", "v") else float("inf")
    with pytest.raises(ValueError, match=f"^{name}: .*non-finite"):
        LayerData(**bad)
    out = data.out.clone()
    out[0, :, 8] = float("nan")  # a padded query's row
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[0, 8] = False
    LayerData(data.q, data.k, data.v, out, mask=mask)


def test_validation_data_of_another_gqa_shape_is_refused():
    """The GQA map (query head h reads KV head h // (Hq / Hkv)) and the value size come from the training data; a
    validation set with other KV heads or value size was scored under the wrong map, without a word."""
    train, val = _data(2), _data(2, seed=1)
    other = LayerData(val.q, val.k.repeat(1, 2, 1, 1), val.v.repeat(1, 2, 1, 1), val.out)
    with pytest.raises(ValueError, match="val: expected k of 2 heads"):
        calibrate_layer(build_method("global", HQ, HKV, D), train, other, CalibConfig.preset("tiny"))


def test_on_step_reports_every_optimiser_step_of_a_fit():
    """A layer's fits take minutes on a real model, and the layer bar stood still meanwhile: `on_step` feeds a bar
    inside the layer (calibrate_layers)."""
    from oal.calibration.fit import on_step

    train, val = _data(2), _data(2, seed=1)
    cfg = CalibConfig.preset("tiny")
    seen = []
    with on_step(lambda name, step, total: seen.append((name, step, total))):
        calibrate_layer(build_method("global", HQ, HKV, D), train, val, cfg)
    assert seen and {(n, t) for n, _, t in seen} == {("global", cfg.max_steps)}
    assert seen[0][1] == 1
    assert all(1 <= s <= cfg.max_steps for _, s, _ in seen)
    count = len(seen)
    calibrate_layer(build_method("global", HQ, HKV, D), train, val, cfg)  # outside: nothing reported
    assert len(seen) == count
