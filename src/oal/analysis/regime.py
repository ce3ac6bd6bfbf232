"""Attention-regime diagnostics: is a model's softmax attention in the regime where quadratic kernels approximate it?

A positive quadratic kernel kappa(s) = a + b s + c s^2 (global, App. D) or its grouped form (OAL, Eq. 7) can follow
exp(s) only over a moderate range of logits. When a head's softmax is nearly one-hot (one key takes almost all
the weight) the fitted parabola's vertex moves into the logit distribution, and the pairs below the vertex get a
kernel that *grows* as their logit falls; then every quadratic kernel fails the same way and OAL ties with global.

Per layer and query head, over the causal pairs of captured post-RoPE q/k (s = q.k / sqrt(d); for encoders,
`Captured.causal=False`, every pair of real tokens):
- `max_weight`: median over queries of the largest softmax weight of the row;
- `eff_keys`: median over queries of exp(entropy) of the row, the effective number of attended keys;
- `logit`: quantiles p01 / p50 / p99 and min / max of s (quantiles from every `logit_row_stride`-th query row);
and, given calibrated OAL-family kernels (`factor` L and `groups`, i.e. oal and global):
- `beyond_vertex`: share of causal pairs where the kernel grows as the logit falls. Along the ray t -> t * s_bar
  (all group scores scaled together, so the logit is t * s), dkappa/dt = 2 z . L^T [0, s_1..s_G] with
  z = L^T [1, s_1..s_G]; the pair is beyond the vertex when dkappa/dt and s have opposite signs (for G = 1 this
  is s < -b / 2c);
- `kernel_weight_beyond` / `softmax_weight_beyond`: mean over queries of the normalised weight each gives to them.
Only queries with at least `min_keys` causal keys count (the first positions are one-hot by construction).

Cost: every query row scores all its keys, O(N^2) per sequence and head, in fp64. With `max_rows` only that many
evenly spaced query rows of each sequence are scored (O(N max_rows)) and with `max_logits` the logit sample of a
sequence is thinned to that many evenly spaced values per head: the medians, shares and quantiles are then
estimates from those rows, and `pairs` counts the pairs scored. `oal analyze` uses both (ANALYZE_ROWS,
ANALYZE_LOGITS): at N = 4096 the full rows made it quadratic in N and the stored logit sample grew as P N^2.
`attention_regime` (oal run) scores every row and keeps at most REGIME_LOGITS logits per sequence and head.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from oal.device import release_memory

__all__ = ["ANALYZE_LOGITS", "ANALYZE_ROWS", "PEAKED_MAX_WEIGHT", "REGIME_FILE", "VERTEX_EXCESS", "RegimeAccumulator",
           "attention_regime", "regime_markdown", "regime_verdict"]

REGIME_FILE = "regime.json"  # `oal run`: the regime on the fidelity blocks with the calibrated kernels
# A head is outside the regime where quadratic kernels approximate softmax well when its typical query puts at
# least half of its weight on one key, or when its calibrated kernel gives the pairs beyond its vertex at least 15
# points more of a row's weight than softmax does (weight moved onto keys whose logit is low). The share of pairs
# beyond the vertex alone does not decide: a well-fitted kernel of spread-out attention can have its vertex near
# the median logit, where kernel and softmax both give those pairs little.
PEAKED_MAX_WEIGHT = 0.5
VERTEX_EXCESS = 0.15
ANALYZE_ROWS, ANALYZE_LOGITS = 256, 4096  # `oal analyze`: scored query rows, kept logits per sequence and head
# `attention_regime` (oal run's regime stage): every query row is scored, and at most this many logits of a sequence
# and head are kept for the quantiles (the whole sample of every 8th row held 112 MB per 4096-token block and layer
# of Qwen2.5-0.5B, ~36 GB at the paper's sizes; a 512-token block keeps ~16k, so shorter runs are unchanged)
REGIME_LOGITS = 32768


def _median(values: list[torch.Tensor]) -> torch.Tensor:
    """Per-head median [H] over the concatenated [H, n] pieces."""
    return torch.cat(values, dim=1).median(dim=1).values


class RegimeAccumulator:
    """Streaming reducer over `oal.models.capture.Captured` layers (use it as, or inside, a capture callback).

    kernels: optional {method name: {layer: AttentionMethod}} of calibrated OAL-family methods (oal, global);
    other methods, or layers they do not cover, are skipped.
    """

    def __init__(self, *, kernels: Mapping[str, Mapping[int, object]] | None = None, min_keys: int = 16,
                 query_chunk: int = 256, logit_row_stride: int = 8, max_rows: int | None = None,
                 max_logits: int | None = None):
        if min_keys < 1 or query_chunk < 1 or logit_row_stride < 1 or any(
                x is not None and x < 1 for x in (max_rows, max_logits)):
            raise ValueError("min_keys/query_chunk/logit_row_stride/max_rows/max_logits: expected positive integers")
        self.kernels = {name: per_layer for name, per_layer in (kernels or {}).items()
                        if all(hasattr(m, "factor") and hasattr(m, "groups") for m in per_layer.values())}
        self.min_keys, self.query_chunk, self.stride = min_keys, query_chunk, logit_row_stride
        self.max_rows, self.max_logits = max_rows, max_logits
        self.layers: dict[int, dict] = {}

    def _state(self, layer: int, n_heads: int) -> dict:
        if layer not in self.layers:
            self.layers[layer] = {"max_weight": [], "eff_keys": [], "logits": [], "pairs": 0,
                                  "lo": torch.full((n_heads,), math.inf, dtype=torch.float64),
                                  "hi": torch.full((n_heads,), -math.inf, dtype=torch.float64),
                                  "kernels": {name: {"beyond": torch.zeros(n_heads, dtype=torch.float64),
                                                     "pairs": torch.zeros(n_heads, dtype=torch.float64),
                                                     "kernel_w": [], "softmax_w": []} for name in self.kernels}}
        return self.layers[layer]

    @torch.no_grad()
    def __call__(self, c) -> None:
        q = c.q.double().cpu()  # the statistics, masks and running state live on the CPU (a CUDA run captures on GPU)
        k = c.k.double().cpu().repeat_interleave(q.shape[1] // c.k.shape[1], dim=1)  # GQA: head h reads KV h // rep
        bsz, n_heads, n, d = q.shape
        mask = torch.ones(bsz, n, dtype=torch.bool) if c.attention_mask is None else c.attention_mask.bool().cpu()
        st = self._state(c.layer, n_heads)
        methods = {name: per_layer[c.layer] for name, per_layer in self.kernels.items() if c.layer in per_layer}
        keys = torch.arange(n)
        row_ids = keys if self.max_rows is None or n <= self.max_rows else \
            torch.linspace(0, n - 1, self.max_rows, dtype=torch.float64).round().long().unique()
        for b in range(bsz):
            logits = []
            for start in range(0, row_ids.numel(), self.query_chunk):
                rows = row_ids[start : start + self.query_chunk]
                # the keys each query sees: its causal prefix (all keys for encoders, `causal=False`), real ones only
                causal = ((keys[None, :] <= rows[:, None]) | (not c.causal)) & mask[b][None, :]  # [n, M]
                valid = mask[b, rows] & (causal.sum(-1) >= self.min_keys)
                if not bool(valid.any()):
                    continue
                s = (q[b, :, rows] @ k[b].transpose(-1, -2)) / math.sqrt(d)  # [H, n, M]
                s_masked = s.masked_fill(~causal, -math.inf)
                p = torch.softmax(s_masked, dim=-1)
                ent = -(p * torch.log(p.clamp_min(1e-300))).sum(-1)
                st["max_weight"].append(p.amax(-1)[:, valid])
                st["eff_keys"].append(ent.exp()[:, valid])
                pair = causal & valid[:, None]
                st["lo"] = torch.minimum(st["lo"], s.masked_fill(~pair, math.inf).amin((1, 2)))
                st["hi"] = torch.maximum(st["hi"], s.masked_fill(~pair, -math.inf).amax((1, 2)))
                sub = valid & (torch.arange(start, start + rows.numel()) % self.stride == 0)
                if bool(sub.any()):
                    logits.append(s[:, sub][:, pair[sub]])
                st["pairs"] += int(pair.sum())
                for name, m in methods.items():
                    self._kernel_stats(st["kernels"][name], m, q[b, :, rows], k[b], s, p, pair, valid)
            if logits:
                seq = torch.cat(logits, dim=1)
                if self.max_logits is not None and seq.shape[1] > self.max_logits:  # evenly spaced, deterministic
                    seq = seq[:, torch.linspace(0, seq.shape[1] - 1, self.max_logits).round().long()]
                st["logits"].append(seq)

    @staticmethod
    def _kernel_stats(acc, method, q, k, s, p, pair, valid) -> None:
        """beyond-vertex counts and the weight share kernel and softmax give those pairs, for one query chunk."""
        d = q.shape[-1]
        lower = torch.tril(method.factor.detach().double().cpu())  # [H, G+1, G+1]
        g1 = lower.shape[-1]
        onehot = torch.nn.functional.one_hot(method.groups.long().cpu(), g1 - 1).double().transpose(1, 2)  # [H,G,d]
        sg = torch.einsum("hnd,hgd,hmd->hgnm", q, onehot, k) / math.sqrt(d)  # group scores s_g [H, G, n, M]
        z_lin = torch.einsum("hug,hgnm->hunm", lower[:, 1:, :].transpose(1, 2), sg)  # L^T [0, s_1..s_G]
        z = z_lin + lower[:, 0, :][:, :, None, None]  # L^T [1, s_1..s_G]
        slope = (z * z_lin).sum(1)  # dkappa/dt / 2 at t = 1
        kappa = (method.eps + (z * z).sum(1)).masked_fill(~pair, 0.0)
        beyond = (slope * s < 0) & pair
        acc["beyond"] += beyond.sum((1, 2)).double()
        acc["pairs"] += float(pair.sum())
        kw = (kappa * beyond).sum(-1) / kappa.sum(-1)
        sw = (p * beyond).sum(-1)
        acc["kernel_w"].append(kw[:, valid])
        acc["softmax_w"].append(sw[:, valid])

    def summary(self) -> dict:
        """{"layers": {layer: {per-head lists}}, "settings": ...}; see the module docstring for the fields."""
        out = {}
        for layer, st in sorted(self.layers.items()):
            if not st["max_weight"]:
                continue
            logits = torch.cat(st["logits"], dim=1) if st["logits"] else None
            q = torch.tensor([0.01, 0.5, 0.99], dtype=torch.float64)
            quant = (torch.quantile(logits, q, dim=1) if logits is not None and logits.shape[1]
                     else torch.full((3, st["lo"].numel()), math.nan, dtype=torch.float64))
            row = {"max_weight": _median(st["max_weight"]).tolist(), "eff_keys": _median(st["eff_keys"]).tolist(),
                   "logit_p01": quant[0].tolist(), "logit_p50": quant[1].tolist(), "logit_p99": quant[2].tolist(),
                   "logit_min": st["lo"].tolist(), "logit_max": st["hi"].tolist(), "pairs": st["pairs"],
                   "kernels": {}}
            for name, acc in st["kernels"].items():
                if not acc["kernel_w"]:
                    continue
                row["kernels"][name] = {
                    "beyond_vertex": (acc["beyond"] / acc["pairs"].clamp_min(1)).tolist(),
                    "kernel_weight_beyond": torch.cat(acc["kernel_w"], 1).mean(1).tolist(),
                    "softmax_weight_beyond": torch.cat(acc["softmax_w"], 1).mean(1).tolist(),
                }
            out[str(layer)] = row
        settings = {"min_keys": self.min_keys, "logit_row_stride": self.stride, "max_rows": self.max_rows,
                    "max_logits": self.max_logits,
                    "peaked_max_weight": PEAKED_MAX_WEIGHT, "vertex_excess": VERTEX_EXCESS}
        return {"settings": settings, "layers": out, "verdict": regime_verdict(out)}


def regime_verdict(layers: Mapping[str, Mapping]) -> dict:
    """Which heads are outside the quadratic-kernel regime, and one plain sentence saying so.

    A head is outside when its median largest softmax weight is >= PEAKED_MAX_WEIGHT, or when a calibrated
    kernel gives the pairs beyond its vertex >= VERTEX_EXCESS more of a row's weight than softmax does.
    """
    peaked, vertex, total = {}, {}, 0
    for layer, row in layers.items():
        total += len(row["max_weight"])
        peaked[layer] = [h for h, w in enumerate(row["max_weight"]) if w >= PEAKED_MAX_WEIGHT]
        for name, ks in row.get("kernels", {}).items():
            excess = [k - s for k, s in zip(ks["kernel_weight_beyond"], ks["softmax_weight_beyond"], strict=True)]
            bad = [h for h, e in enumerate(excess) if e >= VERTEX_EXCESS]
            if bad:
                vertex.setdefault(name, {})[layer] = bad
    n_peaked = sum(len(v) for v in peaked.values())
    n_vertex = max((sum(len(v) for v in per.values()) for per in vertex.values()), default=0)
    outside = {layer: sorted(set(peaked[layer]) | {h for per in vertex.values() for h in per.get(layer, [])})
               for layer in layers}
    n_outside = sum(len(v) for v in outside.values())
    if total == 0:
        text = "no attention statistics were collected"
    elif 2 * n_outside > total:
        text = (f"OUTSIDE the regime where quadratic kernels approximate softmax well: {n_outside} of {total} heads "
                f"({n_peaked} with a median largest softmax weight >= {PEAKED_MAX_WEIGHT}"
                + (f", {n_vertex} whose calibrated kernel puts >= {VERTEX_EXCESS:.0%} more of a row's weight than "
                   "softmax on pairs beyond its vertex" if vertex else "")
                + "). " + _expectation(sorted({n for row in layers.values() for n in row.get("kernels", {})})))
    elif n_outside:
        text = (f"mostly inside the quadratic-kernel regime: {n_outside} of {total} heads are outside "
                f"(peaked or beyond the kernel's vertex); the rest have spread-out attention.")
    else:
        text = "inside the quadratic-kernel regime: no head is peaked or beyond its kernel's vertex."
    return {"outside": outside, "peaked": peaked, "beyond_vertex": vertex, "n_outside": n_outside, "n_heads": total,
            "outside_regime": total > 0 and 2 * n_outside > total, "text": text}


WINDOW_HYBRIDS = ("oal-swa", "global-swa")  # exact softmax on the window; the kernel only on the keys older than it


def _expectation(kernels: list[str]) -> str:
    """What the verdict expects of the run's calibrated `kernels` (regime.json's names): a quadratic kernel over
    every key fails with the regime; a window hybrid uses it only beyond its window."""
    hybrids = [n for n in kernels if n in WINDOW_HYBRIDS]
    if not hybrids:
        return "Expect every quadratic kernel (OAL, global, Taylor) to fail in the same way here, and OAL to gain " \
               "little over global."
    keeps, its, uses, is_ = ("keeps", "its", "uses", "it is") if len(hybrids) == 1 else ("keep", "their", "use",
                                                                                         "they are")
    window = (f"{', '.join(hybrids)} {keeps} exact softmax weights inside {its} sliding window and {uses} the kernel "
              f"only on keys beyond it, so {is_} hit only as far as those older keys matter.")
    if len(hybrids) == len(kernels):
        return "A quadratic kernel over every key (OAL, global, Taylor) would fail in the same way here; " + window
    return "Expect every quadratic kernel over every key (OAL, global, Taylor) to fail in the same way here, and " \
           "OAL to gain little over global; " + window


@torch.no_grad()
def attention_regime(model, blocks: torch.Tensor, layers: Sequence[int], *,
                     kernels: Mapping[str, Mapping[int, object]] | None = None, batch_size: int = 1,
                     min_keys: int = 16, max_logits: int | None = REGIME_LOGITS) -> dict:
    """Capture `layers` of `model` on token `blocks` [B, N] and summarise their attention regime (see module doc).
    Freed heap pages go back to the OS after every captured layer (`release_memory`): the fp64 query chunks
    otherwise stay resident."""
    from oal.models.capture import capture_batches

    if not torch.is_tensor(blocks) or blocks.dim() != 2 or blocks.shape[0] == 0:
        raise ValueError(f"blocks: expected a LongTensor [B, N] with B >= 1, got {getattr(blocks, 'shape', blocks)}")
    acc = RegimeAccumulator(kernels=kernels, min_keys=min(min_keys, blocks.shape[1]), max_logits=max_logits)

    def on_layer(captured):
        acc(captured)
        release_memory(collect=False)

    capture_batches(model, blocks, layers, on_layer, batch_size)
    res = acc.summary()
    res["settings"].update(blocks=list(blocks.shape))
    return res


def regime_markdown(summary: Mapping, where: str) -> list[str]:
    """The report's section body: the verdict in plain words, then one row per layer (medians / means over heads)."""
    layers = summary.get("layers", {})
    if not layers:
        return ["No attention statistics were collected.", ""]
    kernels = sorted({name for row in layers.values() for name in row.get("kernels", {})})
    head = ["layer", "largest softmax weight (median)", "effective keys (median)", "logit p01 .. p99", "logit range"]
    head += [f"{name}: pairs beyond vertex" for name in kernels]
    head += [f"{name}: weight there, kernel / softmax" for name in kernels]
    rows = []
    for layer, row in layers.items():
        mw, ek = torch.tensor(row["max_weight"]), torch.tensor(row["eff_keys"])
        cells = [layer, f"{mw.median():.3f} ({mw.min():.2f}-{mw.max():.2f})",
                 f"{ek.median():.2f} ({ek.min():.1f}-{ek.max():.1f})",
                 f"{min(row['logit_p01']):.1f} .. {max(row['logit_p99']):.1f}",
                 f"{min(row['logit_min']):.1f} .. {max(row['logit_max']):.1f}"]
        ks = row.get("kernels", {})
        cells += [f"{100 * sum(ks[n]['beyond_vertex']) / len(ks[n]['beyond_vertex']):.1f}%" if n in ks else "-"
                  for n in kernels]
        cells += [(f"{100 * sum(ks[n]['kernel_weight_beyond']) / len(ks[n]['kernel_weight_beyond']):.1f}% / "
                   f"{100 * sum(ks[n]['softmax_weight_beyond']) / len(ks[n]['softmax_weight_beyond']):.2f}%")
                  if n in ks else "-" for n in kernels]
        rows.append("| " + " | ".join(cells) + " |")
    verdict = regime_verdict(layers)  # from the recorded statistics: the wording is today's, the numbers the run's
    return [f"**This model is {verdict['text']}**", "",
            f"Measured {where}: per query (with at least {summary['settings']['min_keys']} causal keys) the largest "
            "softmax weight and exp(entropy); medians over queries, then over heads (min-max over heads in "
            "brackets). A pair is beyond the kernel's vertex when the calibrated quadratic grows as its logit falls; "
            "the last columns give the share of the row's weight kernel and softmax put on such pairs. "
            f"Thresholds: a head is peaked at a median largest weight >= {PEAKED_MAX_WEIGHT}, and its kernel "
            f"misfits when it gives the pairs beyond its vertex >= {VERTEX_EXCESS:.0%} more of a row's weight than "
            "softmax does.", "",
            "| " + " | ".join(head) + " |", "|" + "---|" * len(head), *rows, ""]
