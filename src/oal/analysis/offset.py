"""Per-query offsets: how much of each group's score is a constant per query, which softmax ignores.

A dimension r whose contribution x_r = q_r k_r / sqrt(d) is large but nearly the same for every key of a query adds
a per-query offset o_i to the logits. Softmax cancels it (exp(s + o_i) / sum_j exp(s_j + o_i)); a quadratic kernel
of the total score cannot, since p(s + o_i) is not proportional to p(s). OAL's kernel sees the group scores s_g
separately (Eq. 7) and can switch off a group that carries only such an offset; the learned global quadratic
(one group) cannot. This module measures that structure on captured post-RoPE q/k.

Per layer and query head, over the causal pairs (i, j <= i) of real tokens, pooled over prompts (each pair one
count, so a query weighs by its number of keys and the law of total variance holds exactly):

    m_g(i)       = mean_{j <= i} s_g(i, j)                        the per-query mean of group g's score
    share_g      = Var_i(m_g) / Var_(i,j)(s_g)                    its offset share, in [0, 1]
    offset_std_g = sqrt(Var_i(m_g))                               the per-query offset, in logits

and the same for the head's total score s (`offset_share`, `offset_std`). The dimensions that carry the head's
offset are ranked by their part of Var_i(m): Cov_i(m_r, m) / Var_i(m), which sums to 1 over r. Everything follows
from per-head moments (sums of x_r x_t over pairs, and of m_r m_t over queries weighted by their keys), so any
grouping can be scored after the capture. `offset_moments_reference` forms every pair explicitly (the oracle).

Verdict (`offset_verdict`): a head has the structure OAL exploits when one of its non-bulk groups (the isolated
high-contribution dims, App. B groups >= 1) is mostly per-query offset (share >= ISOLATED_SHARE) and that offset is
large (offset std >= ISOLATED_OFFSET_STD logits); the model has it when at least half of its heads do. The
threshold is where `oal diagnose --parts offset` measured OAL's held-out error to fall clearly below global's on
the embedded model (docs/guides/regime.md).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

__all__ = ["ISOLATED_OFFSET_STD", "ISOLATED_SHARE", "PAPER_FIG5", "OffsetAccumulator", "group_offsets",
           "offset_markdown", "offset_moments", "offset_moments_reference", "offset_summary", "offset_verdict"]

ISOLATED_SHARE = 0.5
ISOLATED_OFFSET_STD = 1.0
TOP_DIMS = 5
# Fig. 5: top-5 share of chi on the representative Qwen2.5-0.5B head, and its two isotropic Gaussian controls
PAPER_FIG5 = {"real_top5": 0.5071, "gaussian_top5": 0.0782, "gaussian_at_real_top5": 0.0781}


def _pair_counts(mask: torch.Tensor, causal: bool) -> torch.Tensor:
    """Keys each query sees: [B, N] (0 for padded queries)."""
    m = mask.to(torch.float64)
    n = m.cumsum(-1) if causal else m.sum(-1, keepdim=True).expand_as(m)
    return n * m


def offset_moments(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, *, causal: bool = True,
                   scale: float | None = None, query_chunk: int = 64) -> dict[str, torch.Tensor]:
    """Pair moments of one batch: q [B, Hq, N, d], k [B, Hkv, N, d] (GQA: head h reads KV h // (Hq // Hkv)).

    Returns float64 sums over the batch: "n" (pairs), "s1" [Hq, d] (sum of x_r), "s2" [Hq, d, d] (sum of x_r x_t
    over pairs), "b2" [Hq, d, d] (sum over queries of n_i m_r(i) m_t(i), m_r(i) the mean of x_r over the keys of
    query i). Cost O(N d^2) per head: the sums over keys are prefix sums of k and k k^T.
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] \
            or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q, k: expected [B, Hq, N, d] and [B, Hkv, N, d] with Hq % Hkv == 0, got "
                         f"{tuple(q.shape)} and {tuple(k.shape)}")
    bsz, hq, n_tok, d = q.shape
    rep = hq // k.shape[1]
    scale = d**-0.5 if scale is None else scale
    mask = torch.ones(bsz, n_tok, dtype=torch.bool, device=q.device) if mask is None else mask.bool()
    if mask.shape != (bsz, n_tok):
        raise ValueError(f"mask: expected [{bsz}, {n_tok}], got {tuple(mask.shape)}")
    qd = (q.double() * scale * mask[:, None, :, None]).view(bsz, k.shape[1], rep, n_tok, d)
    kd = k.double() * mask[:, None, :, None]  # [B, Hkv, N, d]: prefix sums per KV head, shared by its query heads
    cnt = _pair_counts(mask, causal)  # [B, N]
    s1, s2, b2 = (torch.zeros(k.shape[1], rep, *shape, dtype=torch.float64, device=q.device)
                  for shape in ((d,), (d, d), (d, d)))
    ksum = kd.sum(2) if not causal else torch.zeros_like(kd[:, :, 0])  # [B, Hkv, d]
    kk = torch.einsum("bgnr,bgnt->bgrt", kd, kd) if not causal else torch.zeros_like(ksum[..., None] * ksum[:, :, None])
    for start in range(0, n_tok, query_chunk):
        sl = slice(start, min(start + query_chunk, n_tok))
        qc, w = qd[:, :, :, sl], cnt[:, sl]
        if causal:  # prefix sums over keys j <= i, carried across chunks
            kc = kd[:, :, sl]
            kpre = ksum[:, :, None] + kc.cumsum(2)  # [B, Hkv, c, d]
            kkpre = kk[:, :, None] + (kc[..., :, None] * kc[..., None, :]).cumsum(2)  # [B, Hkv, c, d, d]
            ksum, kk = kpre[:, :, -1], kkpre[:, :, -1]
        else:
            kpre, kkpre = ksum[:, :, None], kk[:, :, None]
        s1 += (qc * kpre[:, :, None]).sum((0, 3))
        s2 += torch.einsum("bgpnr,bgpnt,bgnrt->gprt", qc, qc, kkpre.expand(-1, -1, qc.shape[3], -1, -1))
        mean = qc * kpre[:, :, None] / w.clamp_min(1)[:, None, None, :, None]  # m_r(i) [B, Hkv, rep, c, d]
        b2 += torch.einsum("bn,bgpnr,bgpnt->gprt", w, mean, mean)
    return {"n": cnt.sum().cpu(), "s1": s1.reshape(hq, d).cpu(), "s2": s2.reshape(hq, d, d).cpu(),
            "b2": b2.reshape(hq, d, d).cpu()}


def offset_moments_reference(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None = None, *,
                             causal: bool = True, scale: float | None = None) -> dict[str, torch.Tensor]:
    """The same sums from every pair formed explicitly (O(N^2 d^2)); the oracle for `offset_moments`."""
    bsz, hq, n_tok, d = q.shape
    scale = d**-0.5 if scale is None else scale
    kd = k.double().repeat_interleave(hq // k.shape[1], dim=1)
    mask = torch.ones(bsz, n_tok, dtype=torch.bool) if mask is None else mask.bool()
    out = {"n": torch.zeros((), dtype=torch.float64), "s1": torch.zeros(hq, d, dtype=torch.float64),
           "s2": torch.zeros(hq, d, d, dtype=torch.float64), "b2": torch.zeros(hq, d, d, dtype=torch.float64)}
    for b in range(bsz):
        for i in range(n_tok):
            keys = [j for j in range(n_tok) if mask[b, j] and (j <= i or not causal)]
            if not mask[b, i] or not keys:
                continue
            x = q[b, :, i, None, :].double() * kd[b, :, keys, :] * scale  # [H, n_i, d] contributions x_r(i, j)
            out["n"] += len(keys)
            out["s1"] += x.sum(1)
            out["s2"] += torch.einsum("hjr,hjt->hrt", x, x)
            m = x.mean(1)
            out["b2"] += len(keys) * m[:, :, None] * m[:, None, :]
    return out


class OffsetAccumulator:
    """Streaming reducer over `oal.models.capture.Captured` layers: the moments of `offset_moments` per layer."""

    def __init__(self, query_chunk: int = 64):
        self.query_chunk = query_chunk
        self.layers: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, c) -> None:
        got = offset_moments(c.q, c.k, c.attention_mask, causal=c.causal, scale=c.scaling,
                             query_chunk=self.query_chunk)
        acc = self.layers.setdefault(c.layer, {key: torch.zeros_like(v.cpu()) for key, v in got.items()})
        for key, v in got.items():
            acc[key] += v.cpu()


def group_offsets(moments: Mapping[str, torch.Tensor], groups: torch.Tensor) -> dict:
    """Offset statistics of one layer's moments under `groups` [Hq, d] (group 0 = bulk). See the module doc."""
    n = moments["n"].clamp_min(1)
    mu = moments["s1"] / n  # [H, d]
    c_tot = moments["s2"] / n - mu[:, :, None] * mu[:, None, :]
    c_bet = moments["b2"] / n - mu[:, :, None] * mu[:, None, :]
    groups = torch.as_tensor(groups, dtype=torch.long)
    n_groups = int(groups.max()) + 1
    onehot = torch.nn.functional.one_hot(groups, n_groups).double().transpose(1, 2)  # [H, G, d]

    def quad(c, e):  # e^T C e per head and row of e: [H, R]
        return torch.einsum("hgr,hrt,hgt->hg", e, c, e).clamp_min(0)

    ones = torch.ones_like(onehot[:, :1])
    var_t, var_b = quad(c_tot, ones)[:, 0], quad(c_bet, ones)[:, 0]
    g_t, g_b = quad(c_tot, onehot), quad(c_bet, onehot)
    carry = torch.einsum("hrt->hr", c_bet) / var_b.clamp_min(1e-300)[:, None]  # Cov(m_r, m) / Var(m)
    g_share = torch.where(g_t > 0, g_b / g_t.clamp_min(1e-300), torch.zeros_like(g_t))
    isolated = g_share >= ISOLATED_SHARE
    isolated[:, 0] = False  # the bulk is not isolated
    iso_b = quad(c_bet, (onehot * isolated[:, :, None]).sum(1, keepdim=True))[:, 0]  # offset of the isolated groups
    heads = []
    for h in range(groups.shape[0]):
        rows = []
        for g in range(n_groups):
            size = int((groups[h] == g).sum())
            if size:
                rows.append({"group": g, "dims": size, "share": float(g_share[h, g]),
                             "offset_std": math.sqrt(float(g_b[h, g])), "score_std": math.sqrt(float(g_t[h, g]))})
        top = carry[h].topk(min(TOP_DIMS, carry.shape[1])).indices.tolist()
        iso_std = max((r["offset_std"] for r in rows if isolated[h, r["group"]]), default=0.0)
        heads.append({"offset_share": float(var_b[h] / var_t[h]) if var_t[h] > 0 else 0.0,
                      "offset_std": math.sqrt(float(var_b[h])), "score_std": math.sqrt(float(var_t[h])),
                      "isolated_offset_std": iso_std,
                      "isolated_offset_share": float(iso_b[h] / var_t[h]) if var_t[h] > 0 else 0.0, "groups": rows,
                      "carrying_dims": top, "carrying_share": [float(carry[h, r]) for r in top]})
    return {"heads": heads}


def offset_summary(moments_by_layer: Mapping[int, Mapping[str, torch.Tensor]],
                   groups_by_layer: Mapping[int, torch.Tensor]) -> dict:
    """analysis.json["offset"]: per layer the per-head statistics of `group_offsets`, and the verdict."""
    layers = {str(i): group_offsets(moments_by_layer[i], groups_by_layer[i]) for i in sorted(moments_by_layer)}
    return {"settings": {"isolated_share": ISOLATED_SHARE, "isolated_offset_std": ISOLATED_OFFSET_STD},
            "layers": layers, "verdict": offset_verdict(layers)}


def offset_verdict(layers: Mapping[str, Mapping]) -> dict:
    """Which heads carry a large per-query offset in an isolated group, and one plain sentence on what that means."""
    having = {layer: [h for h, row in enumerate(v["heads"]) if row["isolated_offset_std"] >= ISOLATED_OFFSET_STD]
              for layer, v in layers.items()}
    total = sum(len(v["heads"]) for v in layers.values())
    n_have = sum(len(v) for v in having.values())
    iso = [row["isolated_offset_std"] for v in layers.values() for row in v["heads"]]
    share = [row["offset_share"] for v in layers.values() for row in v["heads"]]
    largest = max(iso, default=0.0)
    if total == 0:
        text = "no offset statistics were collected"
    elif 2 * n_have >= total:
        text = (f"HAS the per-query offset structure that lets OAL beat a global quadratic: {n_have} of {total} heads "
                f"have an isolated group whose score is mostly a per-query constant of std >= "
                f"{ISOLATED_OFFSET_STD:g} logit (largest {largest:.2f}). OAL can switch that group off; the global "
                "kernel cannot. Expect a clear gain over global")
    elif n_have:
        text = (f"has the per-query offset structure in {n_have} of {total} heads only (isolated offset std >= "
                f"{ISOLATED_OFFSET_STD:g} logit; largest {largest:.2f}): expect OAL's gain over global there and "
                "little elsewhere")
    else:
        text = (f"does NOT have the per-query offset structure that lets OAL beat a global quadratic: no head has an "
                f"isolated group whose score is mostly a per-query constant of std >= {ISOLATED_OFFSET_STD:g} logit "
                f"(largest {largest:.2f}; the whole score's offset share is {100 * max(share, default=0):.0f}% at "
                "most). Expect OAL to gain only a few percent over global")
    return {"heads": having, "n_heads": total, "n_with_offset": n_have, "largest_isolated_offset_std": largest,
            "has_offset_structure": total > 0 and 2 * n_have >= total, "text": text}


def offset_markdown(offset: Mapping, concentration: Mapping | None = None) -> list[str]:
    """The report lines: the verdict, then per layer the offset statistics and the top-5 chi share beside the
    Gaussian control and the paper's Fig. 5."""
    layers = offset.get("layers", {})
    if not layers:
        return ["No offset statistics were collected (`oal analyze` of an older version; rerun it).", ""]
    verdict = offset.get("verdict") or offset_verdict(layers)
    conc = concentration or {}
    layer_ids = sorted(layers, key=int)
    rows = []
    for li, layer in enumerate(layer_ids):
        heads = layers[layer]["heads"]
        share = [h["offset_share"] for h in heads]
        iso = [h["isolated_offset_std"] for h in heads]
        std = [h["offset_std"] for h in heads]
        dims = sorted({d for h in heads for d in h["carrying_dims"][:2]})
        cells = [layer, f"{100 * sum(share) / len(share):.1f}% ({100 * min(share):.0f}-{100 * max(share):.0f}%)",
                 f"{max(std):.2f}", f"{max(iso):.2f}", ", ".join(map(str, dims))]
        for key in ("real_top5", "gaussian_top5"):
            # a dead head's share is null in analysis.json: the mean is over the heads that have one
            vals = [v for v in conc.get(key)[li] if v is not None] if li < len(conc.get(key) or []) else []
            cells.append(f"{100 * sum(vals) / len(vals):.1f}%" if vals else "-")
        rows.append("| " + " | ".join(cells) + " |")
    head = ["layer", "offset share of the score (mean; min-max over heads)", "offset std, logits (max)",
            "isolated offset std, logits (max)", "dims carrying it (top 2 per head)", "top-5 chi share",
            "Gaussian control"]
    return [f"**Per-query offsets: this model {verdict['text']}.**", "",
            "Per head, over the causal pairs of the grouping prompts: the offset share is the variance of the "
            "per-query mean of the score over its keys against the score's total variance (softmax ignores that "
            "part, a quadratic kernel of the total score cannot); the isolated offset std is the per-query offset "
            f"(in logits) of a non-bulk App. B group whose own offset share is >= {ISOLATED_SHARE:g}, the part OAL's "
            "grouped kernel can switch off. The paper's Fig. 5 head (Qwen2.5-0.5B) has a top-5 chi share of "
            f"{100 * PAPER_FIG5['real_top5']:.1f}% against {100 * PAPER_FIG5['gaussian_top5']:.1f}% for its Gaussian "
            "control.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows, ""]
