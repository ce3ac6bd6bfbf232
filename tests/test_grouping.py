"""Appendix B stable-gap grouping and the fixed-budget diagnostic grouping."""

import pytest
import torch

from oal.analysis import (
    candidate_cuts,
    fixed_budget_groups,
    stable_gap_groups,
    stable_gap_groups_reference,
)
from oal.analysis.grouping import _select


def _repeat(profile, p=8):
    """Identical prompts: every bootstrap replicate equals the full sample, so S_k is exactly 0 or 1."""
    return torch.tensor(profile, dtype=torch.float64).expand(p, -1).clone()


def _noisy(profile, p, gen, noise=0.2):
    base = torch.tensor(profile, dtype=torch.float64)
    return base * torch.exp(noise * torch.randn(p, base.numel(), dtype=torch.float64, generator=gen))


def test_candidate_cuts_follow_appendix_b():
    assert candidate_cuts(64, 0.25).tolist() == list(range(48, 64))
    assert candidate_cuts(10, 0.25).tolist() == [7, 8, 9]  # m = ceil(2.5) = 3
    assert candidate_cuts(4, 1.0).tolist() == [1, 2, 3]  # max(1, d - m) keeps both sides non-empty


def test_tail_size_is_the_exact_ceiling_of_alpha_d():
    """App. B: m = ceil(alpha d). 0.55 * 100 is 55.00000000000001 in floating point; the tail is still 55 dims
    (candidate cuts k = 45..99), not 56, and the oracle agrees."""
    assert candidate_cuts(100, 0.55).tolist() == list(range(45, 100))
    chi = torch.rand(3, 100, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    ref = stable_gap_groups_reference(chi, tail_fraction=0.55, n_bootstrap=2)
    assert len(ref["ratios"]) == 55
    assert candidate_cuts(64, 1e-12).tolist() == [63]  # alpha > 0: at least the top dimension (m >= 1)


def test_hand_built_profile_known_groups():
    # d = 16, alpha = 0.25 -> candidates k = 12..15. Sorted tail 1 | 2 | 5 | 20 | 40: ratios 2, 2.5, 4, 2.
    profile = [1.0] * 16
    profile[3], profile[9], profile[0], profile[14] = 2.0, 5.0, 20.0, 40.0
    res = stable_gap_groups(_repeat(profile), n_bootstrap=50)
    want = torch.zeros(16, dtype=torch.long)
    want[3], want[9], want[0], want[14] = 1, 2, 3, 4
    assert torch.equal(res.groups, want)
    assert res.cuts == [12, 13, 14, 15] and res.n_groups == 5 and res.fallback == []
    torch.testing.assert_close(res.ratios, torch.tensor([2.0, 2.5, 4.0, 2.0], dtype=torch.float64))
    assert res.support.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_many_natural_cuts_are_not_capped():
    # d = 64, alpha = 0.25 -> 16 candidates; the top 12 dims form a geometric ladder of ratio 2 over the bulk.
    profile = [1.0] * 64
    dims = list(range(5, 64, 5))[:12]
    for i, r in enumerate(dims):
        profile[r] = 2.0 ** (i + 1)
    res = stable_gap_groups(_repeat(profile), n_bootstrap=20)
    assert res.n_groups == 13
    assert res.cuts == list(range(52, 64))
    for i, r in enumerate(dims):
        assert res.groups[r] == i + 1


def test_fallback_when_no_natural_cut_picks_largest_gap():
    # all tail ratios below tau -> S = 0 everywhere; fallback takes candidates by descending rho.
    profile = [1.0] * 12 + [1.1, 1.1 * 1.3, 1.1 * 1.3 * 1.2, 1.1 * 1.3 * 1.2 * 1.05]
    res = stable_gap_groups(_repeat(profile), n_bootstrap=30)
    assert res.natural.sum() == 0 and res.cuts == [13] and res.fallback == [13]
    res3 = stable_gap_groups(_repeat(profile), min_groups=3, n_bootstrap=30)
    assert res3.cuts == [13, 14] and res3.n_groups == 3
    assert stable_gap_groups(_repeat(profile), min_groups=1, n_bootstrap=30).n_groups == 1


def test_fallback_prefers_support_then_ratio_then_candidate_order():
    natural = torch.zeros(1, 5, dtype=torch.bool)
    support = torch.tensor([[0.2, 0.8, 0.8, 0.8, 0.1]], dtype=torch.float64)
    ratios = torch.tensor([[9.0, 1.2, 1.4, 1.4, 1.0]], dtype=torch.float64)
    # S first (0.8 beats 0.2 despite rho 9), then rho (1.4 > 1.2), exact tie (1.4, 0.8) keeps candidate order
    assert _select(natural, support, ratios, 2)[0].tolist() == [False, False, True, False, False]
    assert _select(natural, support, ratios, 3)[0].tolist() == [False, False, True, True, False]
    assert _select(natural, support, ratios, 4)[0].tolist() == [False, True, True, True, False]
    natural[0, 4] = True  # natural cuts count toward min_groups and are never dropped
    assert _select(natural, support, ratios, 2)[0].tolist() == [False, False, False, False, True]


def test_exact_ties_keep_candidate_order():
    # sorted tail 1, 1, 2, 4, 8: candidate ratios 1, 2, 2, 2 (< tau = 3, S = 0). The three tied (S, rho) = (0, 2)
    # candidates 13, 14, 15 rank above 12; among them the earliest candidates come first.
    profile = [1.0] * 13 + [2.0, 4.0, 8.0]
    res = stable_gap_groups(_repeat(profile), min_ratio=3.0, min_groups=3, n_bootstrap=10)
    assert res.candidates.tolist() == [12, 13, 14, 15]
    assert res.cuts == [13, 14]


def test_tied_scores_sort_stably_by_index():
    profile = [1.0] * 8
    profile[2] = profile[5] = 10.0  # tie inside the top: stable order puts dim 2 before dim 5
    res = stable_gap_groups(_repeat(profile), tail_fraction=0.5, n_bootstrap=10)
    assert res.order.tolist()[-2:] == [2, 5]
    assert res.cuts == [6]  # the 1 -> 10 gap; the tie itself has rho = 1
    assert res.groups[2] == res.groups[5] == 1


@pytest.mark.parametrize("alpha", [0.3, 1.0])  # 1.0: every cut k = 1..d-1 is a candidate
def test_vectorised_bootstrap_matches_literal_loop(alpha):
    # The oracle draws its own bootstrap replicates (Python's random), so supports agree up to Monte Carlo error:
    # sd of the difference of two independent estimates <= sqrt(2 * 0.25 / B); 5 sd tolerance.
    gen = torch.Generator().manual_seed(0)
    base = torch.linspace(1.0, 2.0, 24).tolist()
    base[4], base[17], base[9] = 3.5, 5.0, 8.0
    chi = torch.stack([_noisy(base, 11, gen, noise=0.3) for _ in range(3)])  # 3 heads, P = 11, d = 24
    n_boot = 800
    fast = stable_gap_groups(chi, tail_fraction=alpha, min_support=0.6, n_bootstrap=n_boot, seed=3)
    tol = 5 * (0.5 / n_boot) ** 0.5
    for h in range(3):
        ref = stable_gap_groups_reference(chi[h], tail_fraction=alpha, min_support=0.6, n_bootstrap=n_boot, seed=3)
        one = fast[h]
        torch.testing.assert_close(one.support, torch.tensor(ref["support"], dtype=torch.float64), rtol=0, atol=tol)
        torch.testing.assert_close(one.ratios, torch.tensor(ref["ratios"], dtype=torch.float64))
        clear = (one.support - 0.6).abs() > tol  # decisions away from the threshold must agree
        assert one.natural[clear].tolist() == [n for n, c in zip(ref["natural"], clear.tolist(), strict=True) if c]
        if bool(clear.all()):
            assert torch.equal(one.groups, ref["groups"]) and one.cuts == ref["cuts"]
    # the noise puts some supports strictly between 0 and 1, so the bootstrap is actually exercised
    assert ((fast.support > 0.2) & (fast.support < 0.8)).any()


def test_bootstrap_weights_are_multiplicities_of_p_draws():
    """App. B: replicate b draws P prompt indices with replacement, kept with their multiplicities; its weights are
    those counts / P, so each row sums to 1 and each weight times P is a whole number (not all 1: repeats occur)."""
    from oal.analysis.grouping import bootstrap_weights

    p = 7
    w = bootstrap_weights(p, 200, seed=0)
    assert w.shape == (200, p) and w.dtype == torch.float64
    counts = w * p
    assert torch.equal(counts, counts.round()) and (counts >= 0).all()
    assert torch.equal(counts.sum(1), torch.full((200,), float(p), dtype=torch.float64))
    assert (counts == 0).any() and (counts >= 2).any()  # with replacement: some prompts left out, some repeated
    assert torch.equal(w, bootstrap_weights(p, 200, seed=0)) and not torch.equal(w, bootstrap_weights(p, 200, seed=1))


def test_a_ratio_equal_to_tau_is_a_natural_cut():
    """The thresholds are inclusive: rho_k >= tau (Eq. 16) with S_k >= gamma, where S_k counts R_k^(b) >= tau
    (Eq. 18). Sorted tail 1, 1, 1, 1 | 1.5 with tau = 1.5: rho_15 = R_15^(b) = 1.5 exactly (P = 8 makes every
    bootstrap average exact), so the cut is natural with support 1, even with G_min = 1 (no fallback)."""
    profile = [1.0] * 15 + [1.5]
    res = stable_gap_groups(_repeat(profile), min_ratio=1.5, min_groups=1, n_bootstrap=20)
    assert res.ratios.tolist() == [1.0, 1.0, 1.0, 1.5] and res.support.tolist() == [0.0, 0.0, 0.0, 1.0]
    assert res.natural.tolist() == [False, False, False, True] and res.cuts == [15] and res.fallback == []
    ref = stable_gap_groups_reference(_repeat(profile), min_ratio=1.5, min_groups=1, n_bootstrap=20)
    assert ref["natural"] == [False, False, False, True] and ref["cuts"] == [15]


def test_oracle_catches_sampling_without_replacement(monkeypatch):
    # a fast path that resampled prompts without replacement would reproduce the full sample every time
    # (support 0 or 1); the oracle's own draw exposes it
    import oal.analysis.grouping as grouping

    gen = torch.Generator().manual_seed(0)
    base = torch.linspace(1.0, 2.0, 24).tolist()
    base[17], base[9] = 5.0, 8.0
    chi = _noisy(base, 11, gen, noise=0.3)
    ref = stable_gap_groups_reference(chi, tail_fraction=0.3, n_bootstrap=400, seed=1)
    mid = [i for i, s in enumerate(ref["support"]) if 0.2 < s < 0.8]
    assert mid  # a candidate whose separation is genuinely uncertain

    def permutations(n_prompts, n_bootstrap, seed):
        return torch.ones(n_bootstrap, n_prompts, dtype=torch.float64) / n_prompts

    monkeypatch.setattr(grouping, "bootstrap_weights", permutations)
    wrong = stable_gap_groups(chi, tail_fraction=0.3, n_bootstrap=400, seed=1)
    assert all(float(wrong.support[i]) in (0.0, 1.0) for i in mid)
    assert max(abs(float(wrong.support[i]) - ref["support"][i]) for i in mid) > 5 * (0.5 / 400) ** 0.5


@pytest.mark.parametrize("heads_per_chunk", [None, 4])
def test_batched_equals_per_head(monkeypatch, heads_per_chunk):
    """Every head of a batch is grouped as if alone, also when the bootstrap runs over several chunks of heads
    (4 heads a chunk: chunks of 4 and 2 of the 6 heads)."""
    import oal.analysis.grouping as grouping

    if heads_per_chunk is not None:
        monkeypatch.setattr(grouping, "_CHUNK_ELEMENTS", heads_per_chunk * 64 * 16)  # B * d elements a head
    gen = torch.Generator().manual_seed(1)
    chi = torch.rand(2, 3, 9, 16, dtype=torch.float64, generator=gen) ** 4
    batch = stable_gap_groups(chi, n_bootstrap=64)
    assert batch.groups.shape == (2, 3, 16) and batch.support.shape == (2, 3, 4)
    for i in range(2):
        for j in range(3):
            one = stable_gap_groups(chi[i, j], n_bootstrap=64)
            assert torch.equal(batch.groups[i, j], one.groups)
            assert torch.equal(batch.support[i, j], one.support)


def test_permuting_dimensions_permutes_groups():
    gen = torch.Generator().manual_seed(2)
    base = (torch.rand(32, dtype=torch.float64, generator=gen) + 0.5).tolist()
    base[7], base[20], base[3] = 6.0, 12.0, 30.0
    chi = _noisy(base, 10, gen, noise=0.25)
    perm = torch.randperm(32, generator=gen)
    a = stable_gap_groups(chi, n_bootstrap=200)
    b = stable_gap_groups(chi[:, perm], n_bootstrap=200)
    assert torch.equal(b.groups, a.groups[perm])
    assert a.cuts == b.cuts and torch.equal(a.support, b.support)
    torch.testing.assert_close(a.ratios, b.ratios)


def test_seed_determinism():
    gen = torch.Generator().manual_seed(3)
    chi = torch.stack([_noisy([1.0] * 12 + [1.6, 2.6, 4.0, 6.5], 6, gen, noise=0.4) for _ in range(8)])
    a = stable_gap_groups(chi, n_bootstrap=40, seed=5)
    b = stable_gap_groups(chi, n_bootstrap=40, seed=5)
    c = stable_gap_groups(chi, n_bootstrap=40, seed=6)
    assert torch.equal(a.support, b.support) and torch.equal(a.groups, b.groups)
    assert not torch.equal(a.support, c.support)


def test_fixed_budget_groups_nest_and_use_largest_gaps():
    chi = torch.tensor([1.0, 8.0, 1.1, 2.0, 30.0, 1.05], dtype=torch.float64)
    # sorted: 1, 1.05, 1.1, 2, 8, 30 -> ratios 1.05, 1.048, 1.82, 4, 3.75
    assert fixed_budget_groups(chi, 1).tolist() == [0] * 6
    assert fixed_budget_groups(chi, 2).tolist() == [0, 1, 0, 0, 1, 0]
    assert fixed_budget_groups(chi, 3).tolist() == [0, 1, 0, 0, 2, 0]
    assert fixed_budget_groups(chi, 4).tolist() == [0, 2, 0, 1, 3, 0]
    gen = torch.Generator().manual_seed(4)
    x = torch.rand(3, 20, dtype=torch.float64, generator=gen)
    prev = fixed_budget_groups(x, 1)
    for g in range(2, 21):
        cur = fixed_budget_groups(x, g)
        assert (cur.max(-1).values == g - 1).all()
        same = cur[..., :, None] == cur[..., None, :]
        assert (prev[..., :, None] == prev[..., None, :])[same].all()  # only subdivides
        prev = cur


def test_bad_input_raises():
    good = torch.rand(4, 8, dtype=torch.float64)
    for kwargs, name in [
        (dict(tail_fraction=0.0), "tail_fraction"),
        (dict(min_support=1.5), "min_support"),
        (dict(min_ratio=-1.0), "min_ratio"),
        (dict(min_groups=0), "min_groups"),
        (dict(n_bootstrap=0), "n_bootstrap"),
    ]:
        with pytest.raises(ValueError, match=name):
            stable_gap_groups(good, **kwargs)
    with pytest.raises(ValueError, match="chi_per_prompt"):
        stable_gap_groups(-good)
    with pytest.raises(ValueError, match="chi_per_prompt"):
        stable_gap_groups(torch.rand(8))
    with pytest.raises(ValueError, match="n_groups"):
        fixed_budget_groups(torch.rand(8), 9)


def test_settings_are_accepted_on_their_boundaries_and_refused_past_them():
    """App. B's ranges, closed or open as check_settings documents: alpha in (0, 1], gamma in [0, 1], finite tau > 0,
    integer G_min and B >= 1, G_min at most the candidate cuts + 1, d >= 2, P >= 1; NaN fails every range."""
    good = torch.rand(4, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    n_cand = candidate_cuts(8, 0.25).numel()  # alpha 0.25, d 8: 2 candidate cuts
    for kwargs in [dict(tail_fraction=1.0), dict(min_support=0.0), dict(min_support=1.0), dict(min_ratio=1e-9),
                   dict(n_bootstrap=1), dict(min_groups=1), dict(min_groups=n_cand + 1)]:
        res = stable_gap_groups(good, **{"n_bootstrap": 20, **kwargs})
        assert res.groups.shape == (8,) and res.groups.max() + 1 >= kwargs.get("min_groups", 2)
    nan = float("nan")
    for kwargs, name in [
        (dict(tail_fraction=1.0 + 1e-9), "tail_fraction"), (dict(tail_fraction=nan), "tail_fraction"),
        (dict(min_support=-1e-9), "min_support"), (dict(min_support=1.0 + 1e-9), "min_support"),
        (dict(min_support=nan), "min_support"), (dict(min_ratio=0.0), "min_ratio"),
        (dict(min_ratio=float("inf")), "min_ratio"), (dict(min_ratio=nan), "min_ratio"),
        (dict(n_bootstrap=True), "n_bootstrap"), (dict(n_bootstrap=2.0), "n_bootstrap"),
        (dict(min_groups=n_cand + 2), "min_groups"), (dict(min_groups=True), "min_groups"),
        (dict(eps=0.0), "eps"), (dict(tail_fraction=0.0, min_groups=1), "tail_fraction"),
    ]:
        with pytest.raises(ValueError, match=f"^{name}:"):  # the message starts with the argument it refuses
            stable_gap_groups(good, **kwargs)
    smallest = stable_gap_groups(good[:1, :2], n_bootstrap=5, tail_fraction=1.0)  # P 1, d 2
    assert sorted(smallest.groups.tolist()) == [0, 1]  # G_min 2 from d 2: one dimension a group
    for bad in (good[:1, :1], good[:0]):
        with pytest.raises(ValueError, match="chi_per_prompt"):
            stable_gap_groups(bad)
