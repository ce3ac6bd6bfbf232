"""Calibrating the sliding windows (issue 29): Eq. 20 with the hybrid's own output at sampled positions, oal-swa
seeded by its G = 1 control global-swa as OAL is by the learned global, the run's --window / --sinks reaching every
method; the run configuration and the report's honest comparison lines."""

import pytest
import torch

from oal.calibration.data import CalibConfig, LayerData
from oal.calibration.fit import _fold, calibrate_methods, sampled_dense_output
from oal.errors import InputError
from oal.methods import build_method
from oal.ops.kernel import perturbed_factor
from oal.pipeline.config import RunConfig, parse_methods
from oal.pipeline.report_sections import window_comparison

F64 = torch.float64
HQ, HKV, N, D = 4, 2, 40, 16
NAMES = ("swa", "oal-swa", "global-swa")


def _qkv(s=1, seed=0, n=N):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, h, n, D, generator=gen, dtype=F64) for h in (HQ, HKV, HKV)]


def _method(name, seed=0, window=9):
    """Factors perturbed by `seed`; the same groups whatever the seed (initialisations share a layer's groups)."""
    gen = torch.Generator().manual_seed(seed)
    kw = {"window": window, **({"sinks": 2} if name == "swa" else {})}
    if name == "oal-swa":
        kw.update(groups=torch.randint(0, 3, (HQ, D), generator=torch.Generator().manual_seed(99)), n_groups=3)
    m = build_method(name, HQ, HKV, D, **kw).double()
    if m.trainable:
        with torch.no_grad():
            m.factor.copy_(perturbed_factor(m.factor, 0.3, gen))
    return m


@pytest.mark.parametrize("name", NAMES)
def test_sampled_output_is_the_methods_output_at_those_positions(name):
    """Eq. 20's prediction at sampled queries is the method's own causal output there: each query's window sits at
    its own position, not at the end of the prefix it is cut to."""
    m = _method(name)
    q, k, v = _qkv()
    pos = torch.tensor([0, 3, 8, 9, 21, 22, 30])  # inside, at and past the window; max < N - 1
    torch.testing.assert_close(sampled_dense_output(m, q, k, v, pos), m(q, k, v)[:, :, pos], rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", ["oal-swa", "global-swa"])
def test_sampled_output_of_stacked_initialisations(name):
    """Calibration folds I initialisations into one method of I*Hq heads; each copy's rows are its own output."""
    copies = [_method(name, seed=s) for s in range(3)]
    q, k, v = _qkv()
    pos = torch.tensor([2, 11, 25, 33])
    got = sampled_dense_output(_fold(copies), q, k, v, pos, n_copies=3)
    want = torch.cat([m(q, k, v)[:, :, pos] for m in copies], dim=1)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("n", [40, 300])  # the dense validation (short sequences) and the forward's (long ones)
def test_validation_mse_of_stacked_initialisations(n):
    from oal.calibration.loss import _val_mse

    copies = [_method("oal-swa", seed=s) for s in range(3)]
    q, k, v = _qkv(2, seed=4, n=n)
    data = LayerData(q, k, v, build_method("softmax", HQ, HKV, D)(q, k, v))
    got = _val_mse(_fold(copies), data, n_copies=3, query_chunk=7)
    want = torch.cat([(m(q, k, v) - data.out).square().mean(dim=(0, 2, 3)) for m in copies])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=0)


def _layer_data(s, seed):
    q, k, v = (t.float() for t in _qkv(s, seed))
    return LayerData(q, k, v, build_method("softmax", HQ, HKV, D)(q, k, v))


def test_calibrate_methods_settings_groups_and_seeding():
    train, val = _layer_data(3, 1), _layer_data(2, 2)
    groups = torch.randint(0, 3, (HQ, D), generator=torch.Generator().manual_seed(5))
    cfg = CalibConfig(max_steps=30, val_every=10, patience=30, seed=0)
    done = calibrate_methods(["swa", "oal-swa", "global-swa"], train, val, layer=0, groups=groups, cfg=cfg,
                             options={"window": 9, "sinks": 2})  # no "oal": the hybrid still gets its groups
    swa, res = done["swa"]
    assert (swa.window, swa.sinks, res) == (9, 2, None)  # nothing to calibrate
    hybrid, h_res = done["oal-swa"]
    control, g_res = done["global-swa"]
    assert hybrid.window == control.window == 9 and torch.equal(hybrid.groups, groups)
    assert set(g_res.heads[0].val_mse_by_init) == {"taylor", "quadratic", "taylor_perturbed"}
    assert set(h_res.heads[0].val_mse_by_init) == {"global_embedded", "taylor", "global_perturbed"}
    for h in range(HQ):
        # the embedded G = 1 factor is the same kernel, so oal-swa's seeded start begins at global-swa's result
        start = h_res.heads[h].curves["global_embedded"][0][1]
        assert start == pytest.approx(g_res.heads[h].val_mse, rel=1e-5)
    # the recorded validation MSE is the hybrid's own output (window + kernel) against softmax
    with torch.no_grad():
        mse = (hybrid(val.q, val.k, val.v) - val.out).square().mean(dim=(0, 2, 3))
    torch.testing.assert_close(mse, torch.tensor([h.val_mse for h in h_res.heads]), rtol=1e-5, atol=0)
    taylor0 = torch.tensor([h.curves["taylor"][0][1] for h in h_res.heads])
    assert float(mse.mean()) < float(taylor0.mean())  # calibration moved it off the Taylor start, downhill


def test_calibrate_methods_bad_inputs():
    train = _layer_data(2, 1)
    with pytest.raises(ValueError, match="^groups: layer 0 needs groups for 'oal-swa'"):
        calibrate_methods(["oal-swa"], train, train, layer=0, cfg=CalibConfig(max_steps=2, val_every=1))
    encoder = LayerData(train.q, train.k, train.v, train.out, causal=False)
    with pytest.raises(ValueError, match="^methods: 'swa' is a causal sliding window"):
        calibrate_methods(["swa"], encoder, encoder, layer=0)


def test_run_config_records_window_and_sinks():
    cfg = RunConfig(methods=["oal", "swa", "oal-swa", "softmax"], window=32, sinks=1)
    assert cfg.to_dict()["window"] == 32 and cfg.to_dict()["sinks"] == 1
    assert cfg.method_options() == {"window": 32, "sinks": 1}
    assert RunConfig.from_dict(cfg.to_dict()).method_options() == {"window": 32, "sinks": 1}
    default = RunConfig()
    assert (default.window, default.sinks) == (64, 4) and default.method_options() == {}  # no window method
    assert parse_methods("all")[-3:] == ["swa", "oal-swa", "global-swa"]
    for kw, option in (({"window": 0}, "--window"), ({"sinks": -1}, "--sinks"), ({"window": 2.5}, "--window")):
        with pytest.raises(InputError, match=f"^{option[2:]}: expected an integer") as exc:
            RunConfig(methods=["swa"], **kw)
        assert exc.value.param == option


def test_window_comparison_says_who_wins_either_way():
    assert window_comparison({"oal": 10.0, "global": 11.0}) == []
    lines = window_comparison({"softmax": 5.0, "oal": 9.0, "swa": 8.0, "oal-swa": 6.0})
    assert lines[0].startswith("The sliding-window baseline beats OAL in adapted test PPL: SWA 8.0000 vs OAL 9.0000")
    assert "is closer to softmax than both OAL and SWA" in lines[2] and "hybrid 1.0000" in lines[2]
    lines = window_comparison({"softmax": 5.0, "oal": 7.0, "swa": 8.0, "oal-swa": 7.5})
    assert lines[0].startswith("OAL beats the sliding-window baseline")
    assert "is NOT closer to softmax than both (closer than SWA only)" in lines[2]
    lines = window_comparison({"oal": 7.0, "swa": 8.0, "oal-swa": 9.0})  # softmax not run: lower PPL is closer
    assert "is NOT closer to softmax than OAL or SWA" in lines[2] and "softmax not run" in lines[2]
