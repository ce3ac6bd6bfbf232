"""The baselines inside a converted HF model: prefill + token-by-token decoding with the recurrent state cache
gives the same logits as one full forward; gradients reach their trainable parameters."""

import pytest
import torch

BASELINES = ("performer", "spectraformer", "dijiang", "taylorshift")


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=61, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).double().eval()


@pytest.mark.parametrize("name", BASELINES)
def test_decode_with_state_matches_full_forward(name):
    from transformers import DynamicCache

    from oal.models.cache import cache_kwargs
    from oal.models.convert import convert

    model = convert(_model(), [1], name)
    ids = torch.randint(0, 61, (2, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(input_ids=ids).logits
        cache = DynamicCache()
        steps = [model(input_ids=ids[:, :8], **cache_kwargs(model, cache), use_cache=True).logits]
        for t in range(8, 13):
            steps.append(model(input_ids=ids[:, t : t + 1], **cache_kwargs(model, cache), use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-8, atol=1e-9)


@pytest.mark.parametrize("name", ["spectraformer", "dijiang", "taylorshift"])
def test_gradients_reach_method_parameters(name):
    from oal.models.attention import converted_methods
    from oal.models.convert import convert

    model = convert(_model(), [1, 2], name)
    ids = torch.randint(0, 61, (1, 11), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids, labels=ids).loss.backward()
    for m in converted_methods(model).values():
        grads = [p.grad for p in m.parameters() if p.requires_grad]
        assert grads and all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
