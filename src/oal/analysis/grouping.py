"""Stable-gap bootstrap grouping of head dimensions (paper Sec. 4.2 and Appendix B, followed to the letter).

For one layer/head with per-prompt scores chi_{p,r} (Eq. 2):
1. chi_r = mean_p chi_{p,r}; sort dims ascending with a stable sort -> order pi (kept fixed from here on).
2. Candidate cuts k in {max(1, d - m), ..., d - 1}, m = ceil(alpha d); cut k puts pi_1..pi_k below (L_k) and
   pi_{k+1}..pi_d above (U_k).
3. rho_k = chi_{pi_{k+1}} / max(chi_{pi_k}, eps) on the full-sample sort (Eq. 16).
4. B prompt-level bootstrap replicates (P indices drawn with replacement, multiplicities kept), order pi fixed:
   R_k^(b) = min_{U_k} chi^(b) / max(max_{L_k} chi^(b), eps) (Eq. 17); S_k = mean_b 1[R_k^(b) >= tau] (Eq. 18).
5. Natural cuts: rho_k >= tau and S_k >= gamma, all kept, no cap. If fewer than G_min groups result, unused
   candidates are added in descending lexicographic (S_k, rho_k) order (exact ties keep candidate order).
6. Groups (Eq. 19) are the runs between retained cuts, mapped back to the original dimension indices:
   id 0 = low-contribution bulk, ids ascending with contribution.

The bootstrap is vectorised over replicates and over any leading (layer, head) dimensions; every head uses the
same replicate draws, so a batched call equals a per-head loop. `stable_gap_groups_reference` is the plain loop.
"""

from __future__ import annotations

import inspect
import math
import random
from dataclasses import dataclass, field

import torch

from oal.errors import InputError

_CHUNK_ELEMENTS = 1 << 22  # bootstrap working set per chunk of heads (float64 elements), bounds memory


@dataclass
class GroupingResult:
    """Grouping of one head (groups [d]) or a batch of heads (groups [..., d]); evidence per candidate cut.

    groups: LongTensor [..., d], group id per original dimension (0 = bulk, ascending contribution).
    order: LongTensor [..., d], the stable ascending sort pi of chi (0-based dimension indices).
    chi: [..., d] full-sample mean contribution (Eq. 2).
    candidates: LongTensor [K], candidate cut positions k (number of dims below the cut).
    ratios: [..., K] rho_k (Eq. 16); support: [..., K] S_k (Eq. 18).
    natural: BoolTensor [..., K] natural cuts; selected: BoolTensor [..., K] retained cuts (natural + fallback).
    """

    groups: torch.Tensor
    order: torch.Tensor
    chi: torch.Tensor
    candidates: torch.Tensor
    ratios: torch.Tensor
    support: torch.Tensor
    natural: torch.Tensor
    selected: torch.Tensor
    params: dict = field(default_factory=dict)

    @property
    def n_groups(self):
        """Number of groups (int for one head, LongTensor [...] for a batch)."""
        n = self.selected.sum(-1) + 1
        return int(n) if n.dim() == 0 else n

    @property
    def cuts(self):
        """Retained cut positions k, ascending (list for one head, nested lists for a batch)."""
        if self.selected.dim() == 1:
            return self.candidates[self.selected].tolist()
        return [self[i].cuts for i in range(self.selected.shape[0])]

    @property
    def fallback(self):
        """Retained cuts that did not pass the natural-cut thresholds (added to reach min_groups)."""
        if self.selected.dim() == 1:
            return self.candidates[self.selected & ~self.natural].tolist()
        return [self[i].fallback for i in range(self.selected.shape[0])]

    def __getitem__(self, idx) -> GroupingResult:
        if self.groups.dim() == 1:
            raise IndexError("GroupingResult of a single head cannot be indexed")
        return GroupingResult(
            self.groups[idx], self.order[idx], self.chi[idx], self.candidates, self.ratios[idx],
            self.support[idx], self.natural[idx], self.selected[idx], self.params,
        )


def _check(chi_per_prompt, tail_fraction, min_support, min_ratio, min_groups, n_bootstrap, eps):
    if not torch.is_tensor(chi_per_prompt) or chi_per_prompt.dim() < 2:
        raise ValueError("chi_per_prompt: expected a tensor [..., P, d] (one row per calibration prompt)")
    p, d = chi_per_prompt.shape[-2:]
    if p < 1 or d < 2:
        raise ValueError(f"chi_per_prompt: expected P >= 1 prompts and d >= 2 dims, got P={p}, d={d}")
    if not torch.isfinite(chi_per_prompt).all() or (chi_per_prompt < 0).any():
        raise ValueError("chi_per_prompt: contribution scores must be finite and non-negative")
    check_settings(tail_fraction, min_support, min_ratio, min_groups, n_bootstrap, eps)
    check_min_groups(d, tail_fraction, min_groups)


def check_settings(tail_fraction, min_support, min_ratio, min_groups, n_bootstrap, eps=1e-12) -> None:
    """App. B's settings on their own (before any capture); InputError naming the `oal analyze` option. NaN fails
    every range check (each comparison is written so that NaN makes it fail)."""
    if not 0 < tail_fraction <= 1:
        raise InputError(f"expected alpha in (0, 1], got {tail_fraction}", "--tail-fraction")
    if not 0 <= min_support <= 1:
        raise InputError(f"expected gamma in [0, 1], got {min_support}", "--min-support")
    if not min_ratio > 0 or not math.isfinite(min_ratio):
        raise InputError(f"expected a finite tau > 0, got {min_ratio}", "--min-ratio")
    if isinstance(min_groups, bool) or not isinstance(min_groups, int) or min_groups < 1:
        raise InputError(f"expected an int >= 1, got {min_groups}", "--min-groups")
    if isinstance(n_bootstrap, bool) or not isinstance(n_bootstrap, int) or n_bootstrap < 1:
        raise InputError(f"expected an int >= 1, got {n_bootstrap}", "--n-bootstrap")
    if not eps > 0:
        raise ValueError(f"eps: expected > 0, got {eps}")


def check_min_groups(d: int, tail_fraction: float, min_groups: int, what: str | None = None) -> None:
    """G_min can be reached only with the candidate cuts there are: at most len(candidates) + 1 groups. `what`
    names the d ranked (default: the head dim's)."""
    most = len(candidate_cuts(d, tail_fraction)) + 1
    if min_groups > most:
        raise InputError(f"expected at most {most} for {what or f'head dim d={d}'} and tail_fraction={tail_fraction} "
                         f"({most - 1} candidate cuts), got {min_groups}", "--min-groups", "min_groups")


def _tail_size(d: int, tail_fraction: float) -> int:
    """m = ceil(alpha d) >= 1 for alpha > 0, the ceiling of the product as written (0.55 * 100 is
    55.00000000000001 in floats)."""
    return max(1, math.ceil(round(tail_fraction * d, 9)))


def candidate_cuts(d: int, tail_fraction: float) -> torch.Tensor:
    """k in {max(1, d - m), ..., d - 1}, m = ceil(alpha d) (App. B)."""
    m = _tail_size(d, tail_fraction)
    return torch.arange(max(1, d - m), d)


def bootstrap_weights(n_prompts: int, n_bootstrap: int, seed: int) -> torch.Tensor:
    """[B, P] resampling weights: multiplicity of each prompt in replicate b, divided by P."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(n_prompts, (n_bootstrap, n_prompts), generator=gen)  # I_b, with replacement
    counts = torch.zeros(n_bootstrap, n_prompts, dtype=torch.float64).scatter_add_(
        1, idx, torch.ones(n_bootstrap, n_prompts, dtype=torch.float64)
    )
    return counts / n_prompts


def _support(chi_pp: torch.Tensor, order: torch.Tensor, cand: torch.Tensor, weights: torch.Tensor,
             tau: float, eps: float) -> torch.Tensor:
    """S_k (Eq. 18) for flat heads: chi_pp [H, P, d], order [H, d] -> [H, K].

    Columns are put in the full-sample order once (the order is held fixed, so sorting before the bootstrap
    average equals sorting after it). Candidates are contiguous, k = c0..d-1: max over L_k is the max of the bulk
    positions < c0 combined with a running max over the tail; min over U_k is a reverse running min of the tail.
    Replicates sit on the last (contiguous) axis so each running step is one vector op over [heads, B].
    """
    n_heads, n_prompts, d = chi_pp.shape
    n_boot = weights.shape[0]
    c0, n_cand = int(cand[0]), cand.numel()
    srt_t = chi_pp.gather(-1, order[:, None, :].expand(-1, n_prompts, -1)).transpose(1, 2)  # [H, d, P]
    w_t = weights.t().contiguous()  # [P, B]
    out = torch.empty(n_heads, n_cand, dtype=torch.float64)
    step = max(1, _CHUNK_ELEMENTS // (n_boot * d))
    for s in range(0, n_heads, step):
        boot = torch.matmul(srt_t[s : s + step], w_t)  # chi^(b) in full-sample order [h, d, B]
        low = boot[:, :c0].amax(1)  # running max over L_k, starts with the bulk positions < c0
        lows = []
        for j in range(n_cand):
            lows.append(low)
            low = torch.maximum(low, boot[:, c0 + j])
        high = boot[:, d - 1]  # running min over U_k, from the top down
        for j in range(n_cand - 1, -1, -1):
            high = torch.minimum(high, boot[:, c0 + j])
            ratio = high / lows[j].clamp_min(eps)  # R_k^(b), Eq. (17)
            out[s : s + step, j] = (ratio >= tau).to(torch.float64).mean(-1)  # S_k, Eq. (18)
    return out


def _select(natural: torch.Tensor, support: torch.Tensor, ratios: torch.Tensor, min_groups: int) -> torch.Tensor:
    """Natural cuts plus fallback cuts in descending lexicographic (S, rho), ties in candidate order."""
    selected = natural.clone()
    for h in range(natural.shape[0]):
        need = min_groups - 1 - int(natural[h].sum())
        if need <= 0:
            continue
        s, r = support[h].tolist(), ratios[h].tolist()
        unused = [i for i in range(natural.shape[1]) if not natural[h, i]]
        unused.sort(key=lambda i: (-s[i], -r[i]))  # Python's sort is stable: exact ties keep candidate order
        selected[h, unused[:need]] = True
    return selected


def _groups_from_cuts(order: torch.Tensor, cand: torch.Tensor, selected: torch.Tensor) -> torch.Tensor:
    """Eq. (19): sorted position p is in group #{retained cuts k <= p}; map back to original dims."""
    d = order.shape[-1]
    pos = torch.arange(d)
    gid_sorted = ((pos[:, None] >= cand[None, :]) & selected[:, None, :]).sum(-1)  # [H, d]
    return torch.empty_like(order).scatter_(-1, order, gid_sorted)


def stable_gap_groups(
    chi_per_prompt: torch.Tensor,
    tail_fraction: float = 0.25,
    min_support: float = 0.9,
    min_ratio: float = 1.5,
    min_groups: int = 2,
    n_bootstrap: int = 1000,
    seed: int = 0,
    *,
    eps: float = 1e-12,
) -> GroupingResult:
    """Appendix B grouping. chi_per_prompt [..., P, d] -> GroupingResult with groups [..., d].

    tail_fraction = alpha, min_support = gamma, min_ratio = tau, min_groups = G_min, n_bootstrap = B.
    Leading dimensions (layers, heads) are grouped independently, sharing the replicate draws of `seed`.
    """
    _check(chi_per_prompt, tail_fraction, min_support, min_ratio, min_groups, n_bootstrap, eps)
    lead = chi_per_prompt.shape[:-2]
    p, d = chi_per_prompt.shape[-2:]
    chi_pp = chi_per_prompt.detach().to("cpu", torch.float64).reshape(-1, p, d)
    chi = chi_pp.mean(1)  # equal-weight average over prompts (Eq. 2)
    order = torch.sort(chi, dim=-1, stable=True).indices  # pi: ascending, stable
    chi_sorted = chi.gather(-1, order)
    cand = candidate_cuts(d, tail_fraction)
    ratios = chi_sorted[:, cand] / chi_sorted[:, cand - 1].clamp_min(eps)  # rho_k, Eq. (16)
    support = _support(chi_pp, order, cand, bootstrap_weights(p, n_bootstrap, seed), min_ratio, eps)
    natural = (ratios >= min_ratio) & (support >= min_support)
    selected = _select(natural, support, ratios, min_groups)
    groups = _groups_from_cuts(order, cand, selected)
    params = dict(tail_fraction=tail_fraction, min_support=min_support, min_ratio=min_ratio,
                  min_groups=min_groups, n_bootstrap=n_bootstrap, seed=seed, eps=eps, n_prompts=p)
    k = cand.numel()
    return GroupingResult(
        groups.reshape(*lead, d), order.reshape(*lead, d), chi.reshape(*lead, d), cand,
        ratios.reshape(*lead, k), support.reshape(*lead, k), natural.reshape(*lead, k),
        selected.reshape(*lead, k), params,
    )


def grouping_params(**kwargs) -> dict:
    """The keyword arguments of `stable_gap_groups`, its defaults filled in: the one place the defaults live."""
    try:
        bound = inspect.signature(stable_gap_groups).bind_partial(**kwargs)
    except TypeError as exc:
        raise ValueError(f"grouping: {exc}; expected the keyword arguments of stable_gap_groups") from exc
    bound.apply_defaults()
    return dict(bound.arguments)


def stable_gap_groups_reference(chi_per_prompt: torch.Tensor, **kwargs) -> dict:
    """Literal per-replicate, per-candidate loop of Appendix B for one head [P, d] (the oracle in tests).

    Takes the keyword arguments of `stable_gap_groups`. Returns dict(groups [d], cuts list, ratios list, support
    list, natural list). The bootstrap draw is its own (Python's `random`, P prompt indices with replacement per
    replicate), not the fast path's: the two agree up to Monte Carlo error, so a mistake in the fast path's
    sampling (without replacement, wrong weights) shows up as a difference instead of being shared.
    """
    a = grouping_params(**kwargs)
    tail_fraction, min_support, min_ratio = a["tail_fraction"], a["min_support"], a["min_ratio"]
    min_groups, n_bootstrap, seed, eps = a["min_groups"], a["n_bootstrap"], a["seed"], a["eps"]
    _check(chi_per_prompt, tail_fraction, min_support, min_ratio, min_groups, n_bootstrap, eps)
    if chi_per_prompt.dim() != 2:
        raise ValueError("chi_per_prompt: the reference takes one head [P, d]")
    chi_pp = chi_per_prompt.to(torch.float64)
    p, d = chi_pp.shape
    chi = chi_pp.mean(0)
    order = sorted(range(d), key=lambda r: float(chi[r]))  # Python sort is stable
    m = _tail_size(d, tail_fraction)
    cands = list(range(max(1, d - m), d))
    rho = [float(chi[order[k]]) / max(float(chi[order[k - 1]]), eps) for k in cands]
    rng = random.Random(seed)
    hits = [0] * len(cands)
    for _ in range(n_bootstrap):
        draw = [rng.randrange(p) for _ in range(p)]  # I_b: P prompts drawn with replacement
        chi_b = chi_pp[draw].mean(0)  # repeated prompts counted with their multiplicity
        for c, k in enumerate(cands):
            low = max(float(chi_b[r]) for r in order[:k])
            high = min(float(chi_b[r]) for r in order[k:])
            hits[c] += high / max(low, eps) >= min_ratio
    support = [h / n_bootstrap for h in hits]
    natural = [rho[c] >= min_ratio and support[c] >= min_support for c in range(len(cands))]
    chosen = [c for c in range(len(cands)) if natural[c]]
    if len(chosen) + 1 < min_groups:
        rest = sorted((c for c in range(len(cands)) if not natural[c]), key=lambda c: (-support[c], -rho[c]))
        chosen += rest[: min_groups - 1 - len(chosen)]
    cuts = sorted(cands[c] for c in chosen)
    groups = torch.zeros(d, dtype=torch.long)
    bounds = [0, *cuts, d]
    for g in range(len(bounds) - 1):
        for pos in range(bounds[g], bounds[g + 1]):
            groups[order[pos]] = g
    return dict(groups=groups, cuts=cuts, ratios=rho, support=support, natural=natural)


def fixed_budget_groups(chi: torch.Tensor, n_groups: int, *, eps: float = 1e-12) -> torch.Tensor:
    """Group-budget diagnostic (App. B): the n_groups - 1 largest adjacent ratios of the stable ascending sort
    of chi [..., d] become boundaries -> LongTensor [..., d] (0 = lowest). Ties in the ratio keep position
    order, so increasing n_groups only subdivides the same ordering."""
    if not torch.is_tensor(chi) or chi.dim() < 1 or not torch.isfinite(chi).all() or (chi < 0).any():
        raise ValueError("chi: expected a finite, non-negative tensor [..., d]")
    d = chi.shape[-1]
    if not isinstance(n_groups, int) or not 1 <= n_groups <= d:
        raise ValueError(f"n_groups: expected an int in [1, {d}], got {n_groups!r}")
    flat = chi.detach().to("cpu", torch.float64).reshape(-1, d)
    order = torch.sort(flat, dim=-1, stable=True).indices
    srt = flat.gather(-1, order)
    cand = torch.arange(1, d)
    ratio = srt[:, 1:] / srt[:, :-1].clamp_min(eps)  # adjacent gaps, as Eq. (16)
    top = torch.sort(ratio, dim=-1, descending=True, stable=True).indices[:, : n_groups - 1]
    selected = torch.zeros(flat.shape[0], d - 1, dtype=torch.bool).scatter_(1, top, True)
    return _groups_from_cuts(order, cand, selected).reshape(chi.shape)


def pair_tied_groups(chi_per_prompt: torch.Tensor, **params) -> torch.Tensor:
    """App. B on RoPE's rotation pairs: groups [..., d] in which dims r and r + d/2 (the pair RoPE rotates together,
    HF's rotate_half layout) always share a group. Each pair's profile is chi_r + chi_{r+d/2}; `stable_gap_groups`
    (with `params`) groups the d/2 pairs. A group sum over whole pairs depends on the distance between query and key
    only, as softmax's logit does; a group holding one dim of a pair also sees their absolute positions."""
    d = chi_per_prompt.shape[-1]
    if d % 2:
        raise ValueError(f"chi_per_prompt: pair-tied groups need an even head dim (RoPE pairs), got d = {d}")
    pairs = chi_per_prompt[..., : d // 2] + chi_per_prompt[..., d // 2:]
    g = stable_gap_groups(pairs, **params).groups
    return torch.cat([g, g], dim=-1)


def parse_grouping(spec: str) -> dict:
    """`--grouping`: "app-b" (App. B stable-gap groups, the paper's protocol) -> {}; "budget:G" -> {"budget": G},
    Fig. 2(b)'s fixed budget (the G - 1 largest adjacent gaps of each head's sorted profile), a departure from the
    paper, which converts with App. B's groups; "app-b-pairs" -> {"pairs": True}, App. B over RoPE pairs
    (`pair_tied_groups`), also a departure."""
    text = str(spec).strip().lower()
    if text in ("app-b", "app_b", "appb", "stable-gap"):
        return {}
    if text in ("app-b-pairs", "pairs"):
        return {"pairs": True}
    name, _, value = text.partition(":")
    if name == "budget" and value.strip().isdigit() and int(value) >= 1:
        return {"budget": int(value)}
    raise ValueError(f"grouping: expected 'app-b', 'app-b-pairs' or 'budget:G' with an integer G >= 1, got {spec!r}")
