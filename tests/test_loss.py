"""Chunked, checkpointed next-token cross-entropy (oal.evaluate.loss) against the full-logits reference, in fp64."""

import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from oal.evaluate.loss import (
    CausalLMLoss,
    causal_lm_loss,
    causal_lm_nll,
    chunk_tokens,
    chunked_cross_entropy,
    full_cross_entropy,
    fused_backend,
    lm_parts,
)

F64 = torch.float64


def _head_and_hidden(b=2, n=13, dim=7, vocab=23, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    head = nn.Linear(dim, vocab, bias=bias).double()
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, dim, generator=gen, dtype=F64))
        if bias:
            head.bias.copy_(torch.randn(vocab, generator=gen, dtype=F64))
    hidden = torch.randn(b, n, dim, generator=gen, dtype=F64, requires_grad=True)
    labels = torch.randint(0, vocab, (b, n), generator=gen)
    return head, hidden, labels


@pytest.mark.parametrize("chunk", [1, 5, 11, 24, 1000])
def test_chunked_loss_and_gradients_equal_full_cross_entropy(chunk):
    head, hidden, labels = _head_and_hidden()
    labels[0, 4] = labels[1, 9] = labels[1, 0] = -100  # ignored targets (the first position is never a target)
    got, n_got = chunked_cross_entropy(hidden, head, labels, chunk=chunk)
    g_got = torch.autograd.grad(got, [hidden, head.weight, head.bias])
    want, n_want = full_cross_entropy(head(hidden), labels)
    g_want = torch.autograd.grad(want, [hidden, head.weight, head.bias])
    assert n_got == n_want == 2 * 12 - 2
    torch.testing.assert_close(got, want.to(F64), rtol=1e-12, atol=1e-12)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert hidden.grad is None  # grad() only; and the last position, which predicts nothing, gets no gradient
    assert float(g_got[0][:, -1].abs().max()) == 0.0


def test_chunked_loss_never_saves_full_logits_for_backward():
    """The point of the checkpointing: outside the chunk being recomputed no [T, V] tensor is kept."""
    head, hidden, labels = _head_and_hidden(b=1, n=41, dim=5, vocab=97)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, n = chunked_cross_entropy(hidden, head, labels, chunk=8)
    loss.backward()
    assert n == 40 and max(saved) < 40 * 97 / 2  # the largest is the hidden states, not logits
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        full_cross_entropy(head(hidden), labels)[0].backward()
    assert max(saved) >= 40 * 97  # the reference does keep them (so the check above can fail)


def _tiny_lm(tie: bool, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=53, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tie)
    return Qwen2ForCausalLM(cfg).double().eval()


@pytest.mark.parametrize("tie", [True, False])
def test_causal_lm_loss_equals_transformers_loss_with_lora(tie):
    """Through peft: the same mean loss and LoRA gradients as the whole logits' cross-entropy (what
    `model(ids, labels=ids).loss` computes)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny_lm(tie), LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                    init_lora_weights=False))
    ids = torch.randint(0, 53, (2, 19), generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]
    got = CausalLMLoss(model, chunk=7, fused=False)(ids)
    g_got = torch.autograd.grad(got, params)
    total, count = full_cross_entropy(model(input_ids=ids).logits, ids)  # fp64 logits, all at once
    want = total / count
    g_want = torch.autograd.grad(want, params)
    assert got.dtype == F64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    # transformers' own loss (it upcasts logits to fp32 even for an fp64 model)
    assert abs(float(model(input_ids=ids, labels=ids).loss.detach()) - float(got.detach())) < 1e-5
    nll, count = causal_lm_nll(model, ids, chunk=4)
    torch.testing.assert_close(nll / count, want.detach(), rtol=1e-12, atol=1e-12)


def test_chunk_tokens_and_backend_choice():
    assert chunk_tokens(151_936) == 2**28 // (4 * 151_936) == 441
    assert chunk_tokens(10, chunk_bytes=4) == 1
    with pytest.raises(ValueError, match="vocab_size"):
        chunk_tokens(0)
    head = nn.Linear(3, 5)
    assert fused_backend("cpu", head, available=True) is None  # CUDA only
    assert fused_backend("cuda", head, available=True) == "liger"
    assert fused_backend("cuda", head, available=False) is None
    assert fused_backend("cuda", nn.Sequential(head), available=True) is None  # a wrapped head: chunked


def test_fused_refused_where_unavailable_and_bad_inputs_named():
    model = _tiny_lm(True)
    ids = torch.randint(0, 53, (1, 6))
    with pytest.raises(ValueError, match="fused"):
        causal_lm_loss(model, ids, fused=True)  # CPU
    head, hidden, labels = _head_and_hidden()
    with pytest.raises(ValueError, match="labels"):
        chunked_cross_entropy(hidden, head, labels[:, :-1])
    with pytest.raises(ValueError, match="chunk"):
        chunked_cross_entropy(hidden, head, labels, chunk=-1)
    with pytest.raises(ValueError, match="model"):
        lm_parts(nn.Linear(2, 2))
