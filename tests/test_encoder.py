"""Encoders (BERT family): capture, non-causal contributions, calibration, conversion with padding, fidelity."""

import copy
import math

import pytest
import torch
from _tiny_encoders import tiny_encoder

import oal
from oal.analysis import contribution_scores, contribution_scores_reference, head_contributions
from oal.calibration.data import CalibConfig, LayerData
from oal.calibration.fit import calibrate_oal_layer, sampled_dense_output
from oal.evaluate.embedding import embedding_similarity, pool, sentence_embeddings
from oal.evaluate.fidelity import fidelity
from oal.methods import build_method
from oal.models.attention import converted_methods, kernel_parameters
from oal.models.capture import attention_module, capture, output_projection
from oal.models.convert import convert
from oal.models.encoder import is_encoder, noncausal_attention

H, D = 4, 8


def _batch(n=11, lengths=(11, 7, 4), seed=0, low=5, high=60):
    """Token ids [B, n] and a right-padding mask with the given real lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, high, (len(lengths), n), generator=g)
    mask = torch.zeros(len(lengths), n, dtype=torch.long)
    for b, length in enumerate(lengths):
        mask[b, :length] = 1
    return ids, mask


def _qkv_by_hand(attn, h):
    b, n, _ = h.shape
    return [proj(h).view(b, n, H, D).transpose(1, 2) for proj in (attn.query, attn.key, attn.value)]


def _layer_inputs(model, ids, mask):
    """Hidden states entering each encoder layer's self-attention, from a plain forward."""
    seen = {}
    hooks = [layer.attention.self.register_forward_pre_hook(
        lambda mod, args, i=i: seen.__setitem__(i, args[0].detach())) for i, layer in enumerate(model.encoder.layer)]
    try:
        model(input_ids=ids, attention_mask=mask)
    finally:
        for hk in hooks:
            hk.remove()
    return seen


@pytest.mark.parametrize("family", ["bert", "roberta"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_capture_equals_manual_recomputation(family, attn):
    model = tiny_encoder(family, attn)
    assert is_encoder(model)
    ids, mask = _batch()
    plain = model(input_ids=ids, attention_mask=mask).last_hidden_state
    got = {}
    out = capture(model, ids, [0, 2], lambda c: got.__setitem__(c.layer, c), mask)
    assert torch.equal(out.last_hidden_state, plain), "capturing must not change the output"
    inputs = _layer_inputs(model, ids, mask)
    for layer, c in got.items():
        attn_mod = attention_module(model, layer)
        assert attn_mod is model.encoder.layer[layer].attention.self and not c.causal
        q, k, v = _qkv_by_hand(attn_mod, inputs[layer])
        torch.testing.assert_close(c.q, q)
        torch.testing.assert_close(c.k, k)
        torch.testing.assert_close(c.v, v)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(D)
        scores = scores.masked_fill(~mask.bool()[:, None, None, :], -torch.inf)
        torch.testing.assert_close(c.out, scores.softmax(-1) @ v, atol=1e-5, rtol=1e-4)
        assert torch.equal(c.attention_mask, mask) and c.scaling == pytest.approx(D**-0.5)
        assert output_projection(model, layer) is model.encoder.layer[layer].attention.output.dense


def test_noncausal_contributions_match_reference_and_closed_form():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 9, 6, generator=g, dtype=torch.float64), torch.randn(2, 3, 9, 6, generator=g,
                                                                                   dtype=torch.float64)
    mask = torch.ones(2, 1, 9)
    mask[0, 0, 6:] = 0
    fast = contribution_scores(q, k, mask=mask, causal=False)
    ref = contribution_scores_reference(q, k, mask=mask, causal=False)
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    gq_fast, gk_fast = torch.autograd.grad(contribution_scores(q.requires_grad_(), k.requires_grad_(), mask=mask,
                                                               causal=False).sum(), (q, k))
    gq_ref, gk_ref = torch.autograd.grad(contribution_scores_reference(q, k, mask=mask, causal=False).sum(), (q, k))
    torch.testing.assert_close(gq_fast, gq_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gk_fast, gk_ref, rtol=1e-12, atol=1e-12)
    q, k = q.detach(), k.detach()
    n = 6  # row 0: every pair of its 6 real tokens, Eq. (2) over n^2 pairs
    by_hand = (q[0, :, :n, None, :] * k[0, :, None, :n, :]).abs().sum((1, 2)) / math.sqrt(6) / n**2
    torch.testing.assert_close(fast[0], by_hand, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(fast, contribution_scores(q, k, mask=mask)), "causal and non-causal pair sets differ"
    # head_contributions forwards causal=False (GQA mapping as before)
    kk = torch.randn(2, 1, 9, 6, generator=g, dtype=torch.float64)
    got = head_contributions(q, kk, mask[:, 0], causal=False)
    torch.testing.assert_close(got, contribution_scores(q, kk.expand_as(q), mask=mask, causal=False))


def _masked_reference(method, q, k, v, mask):
    """Dense non-causal output by rows: each row's real keys only (Eq. 1 with all real keys visible)."""
    out = torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype)
    for b in range(q.shape[0]):
        idx = mask[b].nonzero().flatten()
        out[b, :, idx] = method.reference(q[b : b + 1, :, idx], k[b : b + 1, :, idx], v[b : b + 1, :, idx],
                                          causal=False)[0]
    return out


def _oal(seed=0, hq=H, hkv=H, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    groups = torch.randint(0, 3, (hq, D), generator=g)
    factor = torch.randn(hq, 4, 4, generator=g) * 0.5 + torch.eye(4)
    return build_method("oal", hq, hkv, D, groups=groups, factor=factor).to(dtype)


def test_sampled_dense_output_noncausal_with_padding_matches_reference():
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(3, H, 10, D, generator=g, dtype=torch.float64) for _ in range(3))
    _, mask = _batch(10, (10, 6, 3))
    m = _oal()
    pos = torch.tensor([0, 2, 5, 9])
    for b in range(3):
        got = sampled_dense_output(m, q[b : b + 1], k[b : b + 1], v[b : b + 1], pos, causal=False,
                                   key_mask=mask[b : b + 1])
        want = _masked_reference(m, q[b : b + 1], k[b : b + 1], v[b : b + 1], mask[b : b + 1])[:, :, pos]
        real = mask[b, pos].bool()
        torch.testing.assert_close(got[:, :, real], want[:, :, real], rtol=1e-12, atol=1e-12)
    full = sampled_dense_output(m, q, k, v, torch.arange(10), causal=False)
    torch.testing.assert_close(full, m.reference(q, k, v, causal=False), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("hkv", [4, 2])
def test_noncausal_attention_padding_matches_per_row_reference(hkv):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(4, H, 13, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(4, hkv, 13, D, generator=g, dtype=torch.float64) for _ in range(2))
    valid = torch.ones(4, 13, dtype=torch.bool)
    valid[0, 9:] = False  # right padding
    valid[1, :3] = False  # left padding
    valid[2, 4:6] = False  # inner padding
    valid[3, 9:] = False  # same pattern as row 0: one batched call
    m = _oal(hkv=hkv)
    q.requires_grad_()
    got = noncausal_attention(m, q, k, v, valid)
    want = _masked_reference(m, q, k, v, valid)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    w = torch.randn(got.shape, generator=g, dtype=torch.float64)  # gradients w.r.t. q and the kernel factor
    grads = [torch.autograd.grad((out * w).sum(), (q, m.factor)) for out in (got, want)]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    got = got.detach()
    assert torch.equal(got[~valid[:, None, :].expand(-1, H, -1)], torch.zeros_like(got[~valid[:, None, :].expand(
        -1, H, -1)])), "padded query positions get zero"
    with pytest.raises(ValueError, match="entirely padding"):
        noncausal_attention(m, q, k, v, torch.zeros_like(valid))


def _layer_data(model, ids, mask, layer):
    got = []
    with torch.no_grad():
        capture(model, ids, [layer], got.append, mask, stop_after_last=True)
    return LayerData.from_captured(got)


def test_noncausal_calibration_beats_taylor_start_and_val_mse_is_eq20():
    model = tiny_encoder("bert")
    train = _layer_data(model, *_batch(24, (24, 20, 17, 12, 24, 9), seed=4), 1)
    val = _layer_data(model, *_batch(24, (24, 15), seed=5), 1)
    assert not train.causal and train.mask is not None and int(train.mask.sum()) == 24 + 20 + 17 + 12 + 24 + 9
    groups = torch.zeros(H, D, dtype=torch.long)
    groups[:, :2] = 1
    cfg = CalibConfig.preset("tiny", max_steps=60, val_every=10, patience=40)
    g_res, o_res = calibrate_oal_layer(train, val, groups, cfg, layer=1)
    for res in (g_res, o_res):
        for h in res.heads:
            start = h.curves["taylor"][0][1]  # validation MSE of the Taylor start, before any update
            assert h.val_mse < 0.9 * start, (res.method, h.head, h.val_mse, start)
    # the recorded validation MSE is Eq. 20 on real positions of the non-causal output, computed here by hand
    m = o_res.apply(build_method("oal", H, H, D, groups=groups, n_groups=2)).double()
    d64 = val.to(torch.float64)
    pred = _masked_reference(m, d64.q, d64.k, d64.v, d64.mask)
    real = d64.mask[:, None, :, None].double()
    mse = ((pred - d64.out).square() * real).sum((0, 2, 3)) / (real.sum() * D)
    torch.testing.assert_close(torch.tensor([h.val_mse for h in o_res.heads], dtype=torch.float64), mse,
                               rtol=1e-4, atol=1e-9)


def test_noncausal_padded_calibration_batched_equals_sequential():
    """The batched program (heads x inits) and the per-head loop agree on padded, non-causal data (float64)."""
    g = torch.Generator().manual_seed(6)
    q, k, v, out = (torch.randn(3, H, 14, D, generator=g, dtype=torch.float64) for _ in range(4))
    _, mask = _batch(14, (14, 9, 5))
    train = LayerData(q, k, v, out, mask=mask, causal=False)
    val = LayerData(*(t[:2, :, :10] for t in (q, k, v, out)), mask=mask[1:, :10].bool(), causal=False)
    groups = torch.zeros(H, D, dtype=torch.long)
    groups[:, :3] = 1
    cfg = CalibConfig.preset("tiny", dtype="float64", max_steps=12, val_every=4, patience=8, queries=6)
    batched = calibrate_oal_layer(train, val, groups, cfg)[1]
    seq = calibrate_oal_layer(train, val, groups, cfg, sequential=True)[1]
    assert [h.init for h in batched.heads] == [h.init for h in seq.heads]
    torch.testing.assert_close(torch.tensor([h.val_mse for h in batched.heads]),
                               torch.tensor([h.val_mse for h in seq.heads]), rtol=1e-9, atol=0)
    torch.testing.assert_close(batched.params["factor"], seq.params["factor"], rtol=1e-7, atol=1e-9)


def _oal_methods(model, seed=0):
    n = len(model.encoder.layer)
    return {i: _oal(seed + i, dtype=torch.float32) for i in range(n)}


def test_converted_encoder_matches_dense_kernel_by_hand():
    """Every layer on OAL; the whole forward recomputed with the dense kernel of Eq. 7 written out by hand."""
    model = tiny_encoder("bert").double()
    ids, mask = _batch()
    methods = _oal_methods(model)
    conv = convert(copy.deepcopy(model), list(methods), {i: copy.deepcopy(m) for i, m in methods.items()})
    assert sorted(converted_methods(conv)) == [0, 1, 2] and len(kernel_parameters(conv)) == 3
    got = conv(input_ids=ids, attention_mask=mask).last_hidden_state

    h = model.embeddings(input_ids=ids)
    keep = mask.bool()[:, None, None, :].double()
    for i, layer in enumerate(model.encoder.layer):
        q, k, v = _qkv_by_hand(layer.attention.self, h)
        m = methods[i]
        lower = torch.tril(m.factor.double())  # [H, G+1, G+1]
        onehot = torch.nn.functional.one_hot(m.groups, 3).double()  # [H, d, G]
        s = torch.einsum("bhid,bhjd,hdg->bhgij", q, k, onehot) / math.sqrt(D)  # s_g per pair
        s_bar = torch.cat([torch.ones_like(s[:, :, :1]), s], 2)  # [1, s_1, ..., s_G]
        z = torch.einsum("hac,bhaij->bhcij", lower, s_bar)  # L^T s_bar
        kappa = (m.eps + z.square().sum(2)) * keep  # Eq. 7, padded keys out
        attn = (kappa @ v) / kappa.sum(-1, keepdim=True)
        a = layer.attention.output(attn.transpose(1, 2).reshape(*h.shape), h)
        h = layer.output(layer.intermediate(a), a)
    real = mask.bool()
    torch.testing.assert_close(got[real], h[real], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_every_layer_on_softmax_reference_equals_the_original(family):
    model = tiny_encoder(family)
    ids, mask = _batch()
    conv = convert(copy.deepcopy(model), [0, 1, 2], "softmax")
    real = mask.bool()
    torch.testing.assert_close(conv(input_ids=ids, attention_mask=mask).last_hidden_state[real],
                               model(input_ids=ids, attention_mask=mask).last_hidden_state[real],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family,attn", [("bert", "sdpa"), ("roberta", "sdpa"), ("bert", "eager")])
def test_padding_does_not_change_unpadded_positions(family, attn):
    model = tiny_encoder(family, attn).double()
    conv = convert(model, [0, 1, 2], {i: m.double() for i, m in _oal_methods(model).items()})
    ids, mask = _batch(12, (12, 8, 5, 8))
    batched = conv(input_ids=ids, attention_mask=mask).last_hidden_state
    for b in range(ids.shape[0]):
        n = int(mask[b].sum())
        alone = conv(input_ids=ids[b : b + 1, :n]).last_hidden_state[0]
        torch.testing.assert_close(batched[b, :n], alone, rtol=1e-10, atol=1e-10)
    # and padding really is handled: including the padded keys would change the real positions
    flat = conv(input_ids=ids, attention_mask=torch.ones_like(mask)).last_hidden_state
    assert (flat[1, :8] - batched[1, :8]).abs().max() > 1e-3


def test_kernels_roundtrip_and_save_pretrained(tmp_path):
    model = tiny_encoder("bert")
    conv = convert(copy.deepcopy(model), [1, 2], {i: _oal(i, dtype=torch.float32) for i in (1, 2)})
    ids, mask = _batch()
    want = conv(input_ids=ids, attention_mask=mask).last_hidden_state
    oal.save_kernels(conv, tmp_path / "k")
    again = oal.load(tmp_path / "k", copy.deepcopy(model))
    torch.testing.assert_close(again(input_ids=ids, attention_mask=mask).last_hidden_state, want, rtol=0, atol=0)
    # save_pretrained writes the kernel tensors beside the base weights (what the saved artefact builds on)
    from safetensors.torch import load_file

    conv.save_pretrained(tmp_path / "hf")
    state = load_file(str(tmp_path / "hf" / "model.oal.safetensors"))  # the "oal" weights variant
    for i, m in converted_methods(conv).items():
        torch.testing.assert_close(state[f"encoder.layer.{i}.attention.self.oal_method.factor"], m.factor.detach())
        assert torch.equal(state[f"encoder.layer.{i}.attention.self.oal_method.groups"], m.groups)


@torch.no_grad()
def test_fidelity_noncausal_padded():
    model = tiny_encoder("bert")
    ids, mask = _batch(12, (12, 9, 5), seed=7)
    oal_m = {1: _oal(1, dtype=torch.float32), 2: _oal(2, dtype=torch.float32)}
    soft = {i: build_method("softmax", H, H, D) for i in (1, 2)}
    res = fidelity(model, ids, {"softmax": soft, "oal": oal_m}, attention_mask=mask, batch_size=2)
    assert res["softmax"]["relmse"] < 1e-10 and res["softmax"]["relmse_post_o"] < 1e-10
    # Eq. 21-22 by hand over real positions (sequence b collects both layers)
    err, energy = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    post_err, post_energy = torch.zeros(3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64)
    for layer, c in ((c.layer, c) for c in _captures(model, ids, mask, [1, 2])):
        y = _masked_reference(oal_m[layer].double(), c.q.double(), c.k.double(), c.v.double(), mask)
        w = output_projection(model, layer).weight.detach().double()
        for b in range(3):
            n = int(mask[b].sum())
            diff, ex = y[b, :, :n] - c.out[b, :, :n].double(), c.out[b, :, :n].double()
            err[b] += diff.square().sum()
            energy[b] += ex.square().sum()
            post_err[b] += _heads_through(diff, w).square().sum()
            post_energy[b] += _heads_through(ex, w).square().sum()
    n_b = mask.sum(1).double() * H * D * 2
    assert res["oal"]["relmse"] == pytest.approx(float((err / energy).mean()), rel=1e-4)
    assert res["oal"]["mse"] == pytest.approx(float((err / n_b).mean()), rel=1e-4)
    assert res["oal"]["relmse_post_o"] == pytest.approx(float((post_err / post_energy).mean()), rel=1e-4)
    assert set(res["oal"]["per_layer"]) == {"1", "2"}


def _heads_through(y, w):
    """[H, n, D] -> [n, hidden]: heads concatenated in order, times W_o (no bias)."""
    return y.transpose(0, 1).reshape(y.shape[1], H * D) @ w.T


def _captures(model, ids, mask, layers):
    got = []
    capture(model, ids, layers, got.append, mask)
    return got


def test_embedding_similarity_and_pooling():
    model = tiny_encoder("bert")
    ids, mask = _batch(12, (12, 6), seed=8)
    batch = {"input_ids": ids, "attention_mask": mask}
    same = embedding_similarity(model, copy.deepcopy(model), batch)
    assert same["mean"]["mean"] == pytest.approx(1.0, abs=1e-12) and same["cls"]["min"] == pytest.approx(1.0)
    conv = convert(copy.deepcopy(model), [1], {1: _oal(1, dtype=torch.float32)})
    diff = embedding_similarity(model, conv, batch)
    assert diff["mean"]["mean"] < 1 - 1e-6 and diff["mean"]["n"] == 2 and len(diff["cls"]["per_passage"]) == 2
    # mean pooling ignores padding: the padded passage pools like the same passage alone
    alone = sentence_embeddings(conv, {"input_ids": ids[1:, :6], "attention_mask": mask[1:, :6]})
    batched = sentence_embeddings(conv, batch)
    torch.testing.assert_close(batched["mean"][1], alone["mean"][0], rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="mode"):
        pool(torch.zeros(1, 2, 3), torch.ones(1, 2), "median")


@torch.no_grad()
def test_capture_store_keeps_padding_and_noncausality(tmp_path):
    """The one-pass capture store (calibration's) gives the same LayerData as a direct capture: q/k/v/out, the
    padding mask and causal=False, for every layer of one forward per passage."""
    from oal.models.capture_store import capture_to_disk, open_store

    model = tiny_encoder("bert")
    ids, mask = _batch(9, (9, 6, 3), seed=3)
    store = capture_to_disk(model, {"train": {"input_ids": ids, "attention_mask": mask}}, [0, 2], tmp_path,
                            key="k")
    assert not store.causal and open_store(tmp_path, "k") is not None
    for layer in (0, 2):
        got = []
        capture(model, ids, [layer], got.append, mask)
        want = LayerData.from_captured(got)
        data = LayerData(**store.load("train", layer), causal=store.causal)
        assert not data.causal and torch.equal(data.mask, mask.bool())
        for f in ("q", "k", "v", "out"):
            torch.testing.assert_close(getattr(data, f), getattr(want, f), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="attention_mask of shape"):
        capture_to_disk(model, {"train": {"input_ids": ids, "attention_mask": mask[:, :4]}}, [0], tmp_path / "x",
                        key="k")


@torch.no_grad()
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_converted_encoder_reloads_through_automodel(tmp_path, family):
    """save_pretrained of a converted encoder writes an "oal_<family>" folder that AutoModel reloads (after
    `import oal`) as the converted encoder: same kernels, same outputs with padding; a changed file is refused."""
    import json

    from transformers import AutoModel

    from oal.models.auto import ENCODER_FAMILIES
    from oal.models.families import ENCODER_ARCHITECTURES

    assert set(ENCODER_FAMILIES) == set(ENCODER_ARCHITECTURES)
    conv = convert(tiny_encoder(family), [0, 2], {i: _oal(i, dtype=torch.float32) for i in (0, 2)})
    ids, mask = _batch()
    want = conv(input_ids=ids, attention_mask=mask).last_hidden_state
    conv.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == f"oal_{family}"
    again = AutoModel.from_pretrained(tmp_path / "m")
    assert type(again).__name__ == f"OAL{type(tiny_encoder(family)).__name__}" and is_encoder(again)
    assert sorted(converted_methods(again)) == [0, 2]
    for i, m in converted_methods(again).items():
        torch.testing.assert_close(m.factor, converted_methods(conv)[i].factor, rtol=0, atol=0)
    torch.testing.assert_close(again(input_ids=ids, attention_mask=mask).last_hidden_state, want, rtol=0, atol=0)
    cfg = tmp_path / "m" / "config.json"
    cfg.write_text(cfg.read_text().replace('"hidden_act"', '"hidden_act" '))
    with pytest.raises(ValueError, match="does not match"):
        AutoModel.from_pretrained(tmp_path / "m")


@pytest.mark.parametrize("method", ["swa", "oal-swa"])
def test_a_sliding_window_on_an_encoder_is_refused_at_conversion(method):
    """The windows are causal only: oal.convert accepted them on an encoder and the first forward failed."""
    model = tiny_encoder("bert")
    with pytest.raises(ValueError, match=f"'{method}' is causal only .* this model is an encoder"):
        convert(model, [1], method)
    assert not converted_methods(model)


@torch.no_grad()
def test_output_hidden_states_of_a_converted_encoder():
    """oal.convert gives a BertModel its converted class after its __init__; transformers finds the output-capture
    hooks under the class's name, so output_hidden_states=True returned None."""
    model = tiny_encoder("bert")
    ids, mask = _batch()
    ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    conv = convert(tiny_encoder("bert"), [1], "oal")
    out = conv(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    assert out.hidden_states is not None and len(out.hidden_states) == len(ref) == 4
    torch.testing.assert_close(out.hidden_states[1], ref[1], rtol=0, atol=0)  # before the converted layer
    torch.testing.assert_close(out.hidden_states[-1], out.last_hidden_state, rtol=0, atol=0)


def test_a_converted_encoder_with_a_task_head_is_not_saved_as_if_it_reloaded(tmp_path):
    """BertForSequenceClassification saved as oal_bert; AutoModel and oal.load then refused its head's weights."""
    from _tiny_encoders import tiny_encoder_config
    from transformers import BertForSequenceClassification

    model = convert(BertForSequenceClassification(tiny_encoder_config("bert")).eval(), [1], "oal")
    with pytest.raises(ValueError, match="converted BertForSequenceClassification cannot be saved"):
        model.save_pretrained(tmp_path / "head")
    assert not (tmp_path / "head").exists()
