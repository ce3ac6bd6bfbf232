"""Eq. (2) contribution scores: O(N d) prefix-sum path against the brute-force O(N^2 d) pair sum."""

import pytest
import torch

from oal.analysis import (
    contribution_scores,
    contribution_scores_reference,
    head_contributions,
    prefix_contributions,
)


@pytest.mark.parametrize("n", [1, 7, 33])
def test_matches_bruteforce_outputs_and_gradients_fp64(n):
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(2, 3, n, 5, dtype=torch.float64, generator=gen).requires_grad_()
    k = torch.randn(2, 3, n, 5, dtype=torch.float64, generator=gen).requires_grad_()
    w = torch.randn(2, 3, 5, dtype=torch.float64, generator=gen)
    fast = contribution_scores(q, k)
    ref = contribution_scores_reference(q, k)
    torch.testing.assert_close(fast, ref, rtol=1e-12, atol=1e-12)
    gq, gk = torch.autograd.grad((fast * w).sum(), (q, k))
    rq, rk = torch.autograd.grad((ref * w).sum(), (q, k))
    torch.testing.assert_close(gq, rq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gk, rk, rtol=1e-12, atol=1e-12)


def test_single_pair_by_hand():
    q = torch.tensor([[2.0, -3.0]], dtype=torch.float64)
    k = torch.tensor([[-1.0, 4.0]], dtype=torch.float64)
    chi = contribution_scores(q, k, scale=0.5)
    torch.testing.assert_close(chi, torch.tensor([1.0, 6.0], dtype=torch.float64))


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_mask_equals_trimmed_sequence(side):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(11, 6, dtype=torch.float64, generator=gen)
    k = torch.randn(11, 6, dtype=torch.float64, generator=gen)
    mask = torch.ones(11, dtype=torch.long)
    keep = slice(4, None) if side == "left" else slice(None, 7)
    mask[:] = 0
    mask[keep] = 1
    got = contribution_scores(q, k, mask=mask)
    torch.testing.assert_close(got, contribution_scores(q[keep], k[keep]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got, contribution_scores_reference(q, k, mask=mask), rtol=1e-12, atol=1e-12)


def test_head_contributions_gqa_mapping_and_padding():
    gen = torch.Generator().manual_seed(2)
    b, hq, hkv, n, d = 2, 6, 2, 9, 4
    q = torch.randn(b, hq, n, d, dtype=torch.float64, generator=gen)
    k = torch.randn(b, hkv, n, d, dtype=torch.float64, generator=gen)
    mask = torch.ones(b, n, dtype=torch.long)
    mask[1, :3] = 0
    got = head_contributions(q, k, mask)
    assert got.shape == (b, hq, d)
    for bi in range(b):
        for h in range(hq):
            want = contribution_scores_reference(q[bi, h], k[bi, h // (hq // hkv)], mask=mask[bi])
            torch.testing.assert_close(got[bi, h], want, rtol=1e-12, atol=1e-12)


def test_prefix_contributions_match_truncated_sequences():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 21, 4, dtype=torch.float64, generator=gen)
    k = torch.randn(3, 21, 4, dtype=torch.float64, generator=gen)
    lengths = [1, 5, 16, 21]
    got = prefix_contributions(q, k, lengths)
    assert got.shape == (4, 3, 4)
    for i, n in enumerate(lengths):
        torch.testing.assert_close(got[i], contribution_scores_reference(q[:, :n], k[:, :n]), rtol=1e-12, atol=1e-12)


def test_low_precision_inputs_accumulate_in_fp32():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(64, 8, generator=gen)
    k = torch.randn(64, 8, generator=gen)
    got = contribution_scores(q.bfloat16(), k.bfloat16())
    assert got.dtype == torch.float32
    want = contribution_scores_reference(q.bfloat16().double(), k.bfloat16().double())
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_bad_input_raises():
    q = torch.randn(5, 4)
    with pytest.raises(ValueError, match="k"):
        contribution_scores(q, torch.randn(5, 3))
    with pytest.raises(ValueError, match="mask"):
        contribution_scores(q, q, mask=torch.zeros(5))
    with pytest.raises(ValueError, match="non-finite"):
        contribution_scores(q, torch.full((5, 4), float("nan")))
    with pytest.raises(ValueError, match="Hkv"):
        head_contributions(torch.randn(1, 3, 5, 4), torch.randn(1, 2, 5, 4))
    with pytest.raises(ValueError, match="lengths"):
        prefix_contributions(q, q, [0, 3])
    # a mask of one row for a batch of two masked both rows alike, without a word
    with pytest.raises(ValueError, match="attention_mask"):
        head_contributions(torch.randn(2, 4, 5, 4), torch.randn(2, 2, 5, 4), torch.ones(1, 5, dtype=torch.bool))
