"""Perplexity (App. F.3) against a manual token-by-token computation."""

import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from oal.evaluate.perplexity import block_nll, perplexity


def _tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return Qwen2ForCausalLM(cfg).eval()


def test_perplexity_matches_manual_nll():
    model = _tiny_model()
    blocks = torch.randint(0, 61, (3, 13), generator=torch.Generator().manual_seed(1))
    # manual: each block independently, L-1 targets, log-softmax of the logit at position t for token t+1
    nll, n = 0.0, 0
    with torch.no_grad():
        for row in blocks:
            logp = torch.log_softmax(model(input_ids=row[None]).logits[0].double(), -1)
            for t in range(row.numel() - 1):
                nll -= float(logp[t, row[t + 1]])
                n += 1
    assert n == 3 * 12
    total, count = block_nll(model, blocks, batch_size=2)
    assert count == n
    assert total == pytest.approx(nll, rel=1e-5)
    assert perplexity(model, blocks) == pytest.approx(math.exp(nll / n), rel=1e-5)


def test_perplexity_is_token_weighted_not_block_mean():
    model = _tiny_model()
    a = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(2))
    b = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(3))
    na, _ = block_nll(model, a)
    nb, _ = block_nll(model, b)
    both = perplexity(model, torch.cat([a, b]))
    assert both == pytest.approx(math.exp((na + nb) / 16), rel=1e-6)


def test_perplexity_scores_in_eval_mode_and_restores_the_mode():
    """A model in the middle of training (dropout on) is scored in eval mode, then handed back still training; a
    model in eval mode stays so."""
    model = _tiny_model().train()
    modes = []
    model.model.layers[0].register_forward_pre_hook(lambda mod, args: modes.append(mod.training))
    blocks = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(4))
    perplexity(model, blocks)
    assert modes == [False, False]  # one forward per block, each in eval mode
    assert model.training and all(m.training for m in model.modules())
    perplexity(model.eval(), blocks)
    assert not any(m.training for m in model.modules())


@pytest.mark.parametrize("bad", [torch.zeros(4, dtype=torch.long), torch.zeros(2, 1, dtype=torch.long),
                                 torch.zeros(2, 5), "text"])
def test_perplexity_rejects_bad_blocks(bad):
    with pytest.raises(ValueError, match="blocks"):
        perplexity(_tiny_model(), bad)
