"""Capture of post-RoPE q/k/v and per-head attention output through transformers' AttentionInterface."""

import sys

import pytest
import torch
from _tiny import FAMILIES, tiny_model
from transformers import GPT2Config, GPT2LMHeadModel

from oal.models.capture import attention_module, capture, capture_layer
from oal.models.families import SUPPORTED_ARCHITECTURES


def _model(family, attn="sdpa"):
    return tiny_model(family, vocab_size=101, attn=attn)


def _inputs():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 101, (2, 13), generator=gen)
    mask = torch.ones(2, 13, dtype=torch.long)
    mask[1, :4] = 0  # left padding in the second row
    return ids, mask


def _manual(attn, hidden, position_embeddings, mask):
    """Recompute q/k/v (post-norm, post-RoPE), the causal padded softmax output and o_proj from the layer input."""
    mod = sys.modules[type(attn).__module__]
    b, n, _ = hidden.shape
    d = attn.head_dim
    q = attn.q_proj(hidden).view(b, n, -1, d)
    k = attn.k_proj(hidden).view(b, n, -1, d)
    if hasattr(attn, "q_norm"):  # Qwen3 normalises q/k per head before RoPE
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = attn.v_proj(hidden).view(b, n, -1, d).transpose(1, 2)
    cos, sin = position_embeddings
    q, k = mod.apply_rotary_pos_emb(q, k, cos, sin)
    rep = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    allowed = torch.ones(n, n, dtype=torch.bool).tril() & mask.bool()[:, None, None, :]
    logits = (q @ kr.transpose(-1, -2)) * d**-0.5
    out = logits.masked_fill(~allowed, float("-inf")).softmax(-1) @ vr
    proj = attn.o_proj(out.transpose(1, 2).reshape(b, n, -1))
    return q, k, v, out, proj


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_capture_matches_manual_and_keeps_logits(family):
    model = _model(family)
    ids, mask = _inputs()
    layers = [0, 2]
    seen_in, seen_out = {}, {}
    hooks = []
    for i in layers:
        attn = attention_module(model, i)
        hooks.append(attn.register_forward_pre_hook(
            lambda m, a, kw, i=i: seen_in.__setitem__(i, (kw["hidden_states"], kw["position_embeddings"])),
            with_kwargs=True))
        hooks.append(attn.register_forward_hook(lambda m, a, o, i=i: seen_out.__setitem__(i, o[0])))
    got = []
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        out = capture(model, ids, layers, got.append, mask)
        assert torch.equal(out.logits, plain)
        assert [c.layer for c in got] == layers
        for c in got:
            attn = attention_module(model, c.layer)
            q, k, v, o, proj = _manual(attn, *seen_in[c.layer], mask)
            hq, hkv = model.config.num_attention_heads, model.config.num_key_value_heads
            assert c.q.shape == (2, hq, 13, attn.head_dim) and c.k.shape == (2, hkv, 13, attn.head_dim)
            torch.testing.assert_close(c.q, q, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(c.k, k, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(c.v, v, rtol=1e-5, atol=1e-5)
            valid = mask.bool()  # padded query rows are not defined by the model; compare real tokens
            torch.testing.assert_close(c.out.transpose(1, 2)[valid], o.transpose(1, 2)[valid], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(seen_out[c.layer][valid], proj[valid], rtol=1e-5, atol=1e-5)
            assert c.scaling == pytest.approx(attn.head_dim**-0.5)
            assert torch.equal(c.attention_mask, mask)
    for h in hooks:
        h.remove()
    assert model.config._attn_implementation == "sdpa"


def test_eager_model_is_wrapped_exactly_and_restored():
    model = _model("qwen2", attn="eager")
    ids, mask = _inputs()
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=mask).logits
        got = []
        out = capture(model, ids, [1], got.append, mask)
    assert torch.equal(out.logits, plain)
    assert len(got) == 1 and got[0].layer == 1
    assert model.config._attn_implementation == "eager"


def test_streaming_stop_and_single_layer():
    model = _model("llama")
    ids, _ = _inputs()
    order = []
    with torch.no_grad():
        assert capture(model, ids, [2, 0], lambda c: order.append(c.layer), stop_after_last=True) is None
        one = capture_layer(model, ids, 1)
        full = []
        capture(model, ids, [1], full.append)
    assert order == [0, 2]  # depth order, one callback per layer
    assert one.layer == 1 and torch.equal(one.q, full[0].q) and torch.equal(one.out, full[0].out)


def test_implementation_restored_after_callback_error():
    model = _model("qwen2")
    ids, _ = _inputs()

    def boom(c):
        raise RuntimeError("callback failed")

    with pytest.raises(RuntimeError, match="callback failed"):
        capture(model, ids, [0], boom)
    assert model.config._attn_implementation == "sdpa"


def test_unsupported_architecture_and_bad_layers():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="supported: ") as err:
        capture(gpt2, torch.zeros(1, 4, dtype=torch.long), [0], lambda c: None)
    for name in SUPPORTED_ARCHITECTURES.values():
        assert name in str(err.value)
    model = _model("qwen2")
    with pytest.raises(ValueError, match="layers"):
        capture(model, torch.zeros(1, 4, dtype=torch.long), [3], lambda c: None)
    with pytest.raises(ValueError, match="input_ids"):
        capture(model, torch.zeros(4, dtype=torch.long), [0], lambda c: None)


def test_embedded_default_model():
    from oal.models.registry import load_model

    model, _, _ = load_model("default")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 259, (2, 33), generator=gen)
    got = []
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        out = capture(model, ids, list(range(model.config.num_hidden_layers)), got.append)
    assert torch.equal(out.logits, plain)
    hq, hkv = model.config.num_attention_heads, model.config.num_key_value_heads
    assert [c.layer for c in got] == list(range(model.config.num_hidden_layers))
    assert got[0].q.shape == (2, hq, 33, 64) and got[0].k.shape == (2, hkv, 33, 64)
