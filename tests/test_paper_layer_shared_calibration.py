"""App. F.1: SpectraFormer's FastFood vectors B, G, S are "shared across its query heads" (one set per layer) and
DiJiang's DCT projection is one fixed draw per layer. Calibration (App. B protocol, `oal.calibration.fit`) must
treat them as layer parameters whatever their shape: a layer whose query-head count equals the vectors' length
(Hq == p, or Hq == d for DiJiang's [d, d] projection) must not be calibrated as if each entry belonged to a head
(per-head checkpoint selection would then stitch entries of the shared vectors from different heads' checkpoints,
a vector no validation ever scored)."""

import torch

from oal.calibration.data import CalibConfig, LayerData
from oal.calibration.fit import _per_head_names, calibrate_layer, calibrate_layer_sequential
from oal.methods import build_method

HQ, HKV, D = 8, 2, 8  # Hq == d == p: the first dimension of B, G, S (and DiJiang's projection) equals Hq


def _data(n_seq, n_tok=33, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = 2 * torch.randn(n_seq, HQ, n_tok, D, generator=gen, dtype=torch.float64)
    k = 2 * torch.randn(n_seq, HKV, n_tok, D, generator=gen, dtype=torch.float64)
    v = torch.randn(n_seq, HKV, n_tok, D, generator=gen, dtype=torch.float64)
    return LayerData(q, k, v, build_method("softmax", HQ, HKV, D)(q, k, v))


def test_spectraformer_fastfood_vectors_are_layer_parameters_when_hq_equals_p():
    m = build_method("spectraformer", HQ, HKV, D)
    per_head, shared = _per_head_names(m)
    assert {"B", "G", "S"} <= shared and not per_head & {"B", "G", "S", "perm", "H"}
    res = calibrate_layer(m, _data(2), _data(1, seed=1), CalibConfig.preset("tiny", seed=3))
    assert not res.per_head and [h.head for h in res.heads] == [-1]  # one selection unit: the layer
    # the chosen vectors are one checkpoint's: applying them reproduces the recorded validation MSE
    fitted = res.apply(build_method("spectraformer", HQ, HKV, D))
    val = _data(1, seed=1)
    mse = (fitted(val.q, val.k, val.v) - val.out).square().mean()
    assert torch.allclose(mse, torch.tensor(res.heads[0].val_mse, dtype=mse.dtype), rtol=1e-4)


def test_dijiang_projection_is_not_sliced_per_head_when_hq_equals_d():
    m = build_method("dijiang", HQ, HKV, D)
    per_head, _ = _per_head_names(m)
    assert per_head == {"theta"}  # theta [Hq, d] per head; the [d, d] DCT projection is the layer's
    cfg = CalibConfig.preset("tiny", seed=2)
    train, val = _data(2), _data(1, seed=1)
    batched = calibrate_layer(m, train, val, cfg)
    sequential = calibrate_layer_sequential(m, train, val, cfg)  # slices every per-head tensor to one head
    torch.testing.assert_close(batched.params["theta"], sequential.params["theta"], rtol=1e-4, atol=1e-6)
