"""Table 1: the retained-error ratio R_S = E_S / E_full (Section 3.2, App. A.2, Eq. 8-15).

Per query head h, S_h is the union of its non-bulk groups (group id != 0). The hybrid kernel (Eq. 10) is the
method's kernel on q, k masked to S_h (its own input preprocessing kept: scaling, normalisation, features)
times the exact softmax factor exp(q_{~S} . k_{~S} / sqrt(d)) on the complement; causally masked and
normalised (Eq. 11). E_S (Eq. 12) and E_full (Eq. 13, the method on the full head) are output MSEs against
exact softmax attention, averaged over query heads, sampled query positions and output dimensions, per
(layer, sequence). Stochastic methods: E_S and E_full are first averaged over seeds, then divided (App. A.2);
the ratios are macro-averaged over layers and sequences (Eq. 14).

Controls: (1) Gaussian: q, k replaced by i.i.d. N(0, 1) samples, S_h from the same grouping procedure applied
to the Gaussian contribution scores; (2) matched-control randomisation test (Eq. 15): B random subsets of
|S_h| dimensions drawn from each head's bulk, one-sided p = (1 + #{R_b >= R_S}) / (B + 1).

Cost: only sampled query positions (32 per sequence) against their causal key prefix are evaluated, and all
subsets (full head, S, controls) are batched through one `dense_kernel` call per chunk.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch

from oal.methods import build_method, get_method
from oal.methods._common import shifted_exp
from oal.methods.base import AttentionMethod, repeat_kv
from oal.methods.features import FeatureMapMethod, dense_feature_kernel
from oal.methods.softmax import SoftmaxMethod

__all__ = [
    "RetainedErrorConfig",
    "SequenceQKV",
    "hybrid_output",
    "matched_controls",
    "gaussian_control",
    "gaussian_groups",
    "p_value",
    "retained_error",
    "subset_masks",
    "work_units",
]


@dataclass
class SequenceQKV:
    """One evaluation sequence of one layer: q [1, Hq, N, d], k/v [1, Hkv, N, d|dv] (post-RoPE, unscaled)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class RetainedErrorConfig:
    """Table 1 settings. `preset("paper")` is App. A.2 (B = 1000); the default is a quick CPU run."""

    queries: int = 32  # causal query positions sampled per sequence and layer
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)  # stochastic methods; deterministic ones use seeds[0] only
    n_controls: int = 100  # matched random subsets (paper: 1000)
    control_batch: int = 16  # subsets evaluated per dense_kernel call (memory knob)
    seed: int = 0  # query positions, controls, Gaussian draws
    dtype: str = "float64"
    gaussian_prompts: int = 40  # Gaussian "calibration prompts" for the control's grouping
    gaussian_prompt_len: int = 64
    grouping: dict = field(default_factory=lambda: dict(tail_fraction=0.25, min_support=0.9, min_ratio=1.5,
                                                        min_groups=2, n_bootstrap=200))

    @classmethod
    def preset(cls, name: str = "default", **overrides) -> RetainedErrorConfig:
        if name == "paper":
            base = cls(n_controls=1000, grouping=dict(tail_fraction=0.25, min_support=0.9, min_ratio=1.5,
                                                      min_groups=2, n_bootstrap=1000))
        elif name == "default":
            base = cls()
        elif name == "tiny":
            base = cls(queries=8, seeds=(0, 1), n_controls=10, gaussian_prompts=8, gaussian_prompt_len=16,
                       grouping=dict(tail_fraction=0.25, min_support=0.9, min_ratio=1.5, min_groups=2,
                                     n_bootstrap=50))
        else:
            raise ValueError(f"preset: expected 'default', 'paper' or 'tiny', got {name!r}")
        for k, v in overrides.items():
            if not hasattr(base, k):
                raise ValueError(f"{k}: not a RetainedErrorConfig field")
            setattr(base, k, v)
        return base

    def __post_init__(self):
        if self.queries < 1 or self.n_controls < 0 or self.control_batch < 1 or not self.seeds:
            raise ValueError("queries/control_batch: expected >= 1, n_controls >= 0, seeds non-empty")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype: expected 'float32' or 'float64', got {self.dtype!r}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["seeds"] = list(self.seeds)
        return d


# --------------------------------------------------------------------------------------------- the intervention


def _as_mha(method: AttentionMethod) -> AttentionMethod:
    """A view of `method` that takes one key head per query head (so keys can be masked per query head).

    Shares the parameters; only the KV-head count changes. Valid for methods whose KV-side computation does not
    depend on per-KV-head parameters (all built-in methods: their per-head tensors are indexed by query head).
    """
    view = copy.copy(method)
    view.n_kv_heads = method.n_heads
    return view


def subset_masks(groups: torch.Tensor) -> torch.Tensor:
    """S_h (App. A.2): bool [Hq, d], True on every non-bulk dimension (group id != 0)."""
    return torch.as_tensor(groups) != 0


def _sample_positions(n: int, count: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(n, generator=gen)[: min(count, n)].sort().values


def _softmax_output(qs, kr, vr, pos):
    """Exact causal softmax output at query positions: qs [B, Hq, n, d], kr/vr [B, Hq, M, .] (repeated)."""
    s = qs @ kr.transpose(-1, -2) / math.sqrt(qs.shape[-1])
    keep = torch.arange(kr.shape[2], device=qs.device)[None, :] <= pos[:, None]
    s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, dim=-1) @ vr


def hybrid_output(method: AttentionMethod, q, k, v, pos: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """Eq. 10-11 for a batch of subsets. q [1, Hq, N, d], k/v [1, Hkv, N, .], pos [n] query positions,
    masks bool [C, Hq, d] (True = approximated by the method). Returns outputs [C, Hq, n, dv].

    mask all True: the method on the full head; all False: exact softmax (for every built-in method the kernel
    of zero inputs is constant, so the approximate factor drops out).
    """
    m = int(pos.max()) + 1
    d = q.shape[-1]
    qs = q[:, :, pos]  # [1, Hq, n, d]
    kr = repeat_kv(k[:, :, :m], method.n_rep)  # [1, Hq, M, d]: M is the causal prefix only
    vr = repeat_kv(v[:, :, :m], method.n_rep)
    mk = masks.to(q.dtype)[:, :, None, :]  # [C, Hq, 1, d]
    keep = torch.arange(m, device=q.device)[None, :] <= pos[:, None]
    # method kernel on S (Eq. 9 with its preprocessing) as approx * exp(scale)
    approx, scale = _approx_factor(_as_mha(method), qs * mk, kr * mk, keep)
    logits = (qs * (1 - mk)) @ (kr * (1 - mk)).transpose(-1, -2) / math.sqrt(d)  # exact factor on the complement
    if scale is not None:
        logits = logits + scale
    # Eq. 10 in log space (kernels are positive; log 0 = -inf drops a key), one shift per row over the product: two
    # factors shifted apart could both be far below their own row max at every key, their product 0 (0/0 rows)
    w = shifted_exp(approx.abs().log_() + logits, keep)
    return (w @ vr.to(w.dtype)) / w.sum(-1, keepdim=True)  # Eq. 11


def _approx_factor(method: AttentionMethod, qa, ka, keep):
    """The method's kernel on masked inputs as (a, b), kernel = a * exp(b), b [C, Hq, 1, M] or None. Key log-features
    (Performer) keep each key's own max as b, instead of a shift over keys taken before the exact factor joins (which
    underflowed keys that factor makes dominant), softmax its scores; other methods give their masked kernel."""
    if isinstance(method, SoftmaxMethod):
        return torch.ones((), dtype=qa.dtype, device=qa.device), method._scores(qa, ka)
    if isinstance(method, FeatureMapMethod) and method.log_keys:
        fq, lk = method._features(qa, ka)
        top = lk.detach().amax(-1, keepdim=True)  # [C, Hq, M, 1]: factored out exactly, added back in log space
        return dense_feature_kernel(fq, torch.exp(lk - top)), top.transpose(-1, -2)
    return method.masked_kernel(qa, ka, keep), None


# --------------------------------------------------------------------------------------------- protocol


def p_value(observed: float, controls: Sequence[float]) -> float:
    """Eq. 15: one-sided Monte Carlo p = (1 + #{R_b >= R_S}) / (B + 1)."""
    b = len(controls)
    return (1 + sum(1 for r in controls if r >= observed)) / (b + 1)


def matched_controls(groups: torch.Tensor, n_controls: int, gen: torch.Generator) -> torch.Tensor:
    """bool [B, Hq, d]: per head, |S_h| dimensions drawn uniformly without replacement from the bulk (id 0)."""
    groups = torch.as_tensor(groups)
    hq, d = groups.shape
    out = torch.zeros(n_controls, hq, d, dtype=torch.bool)
    for h in range(hq):
        bulk = torch.nonzero(groups[h] == 0).flatten()
        size = int((groups[h] != 0).sum())
        if size > bulk.numel():
            raise ValueError(f"groups: head {h} has |S|={size} > bulk size {bulk.numel()}; no matched control")
        for b in range(n_controls):
            out[b, h, bulk[torch.randperm(bulk.numel(), generator=gen)[:size]]] = True
    return out


def _sequence_errors(make: Callable[[int], AttentionMethod], seeds, seq: SequenceQKV, pos, masks, batch, dtype,
                     progress: Callable[[int], None] | None = None):
    """MSE vs exact softmax for each mask [C], averaged over seeds (Eq. 12-13 before the ratio); on the CPU.

    The positions and masks (drawn with CPU generators, the same draws on every device) and the methods go where the
    sequence lives; the errors come back once, at the end. `progress(n)`: n masks done for one seed (`work_units`)."""
    q, k, v = (t.to(dtype) for t in (seq.q, seq.k, seq.v))
    pos, masks = pos.to(q.device), masks.to(q.device)
    m = int(pos.max()) + 1
    rep = q.shape[1] // k.shape[1]
    ref = _softmax_output(q[:, :, pos], repeat_kv(k[:, :, :m], rep), repeat_kv(v[:, :, :m], rep), pos)
    total = torch.zeros(masks.shape[0], dtype=torch.float64, device=q.device)
    with torch.no_grad():
        for s in seeds:
            method = copy.deepcopy(make(s)).to(device=q.device, dtype=dtype)  # never cast the caller's module
            for c0 in range(0, masks.shape[0], batch):
                y = hybrid_output(method, q, k, v, pos, masks[c0 : c0 + batch])
                total[c0 : c0 + batch] += (y - ref).pow(2).mean(dim=(1, 2, 3)).double()
                if progress is not None:
                    progress(y.shape[0])
    return total.cpu() / len(seeds)


def _seeds(method, cfg: RetainedErrorConfig) -> tuple[int, ...]:
    """The seeds a method is averaged over: all of `cfg.seeds` for a stochastic one (and for a factory)."""
    stochastic = get_method(method).stochastic if isinstance(method, str) else True
    return tuple(cfg.seeds) if stochastic else tuple(cfg.seeds[:1])


def work_units(method, pairs: int, cfg: RetainedErrorConfig | None = None, *, controls: bool = True) -> int:
    """What `retained_error` (`controls=False`: `gaussian_control`) computes for `method` over `pairs` (layer,
    sequence) pairs, in the units its `progress` counts: one subset's hybrid output for one seed. The full head, S
    and the B matched controls each cost about the same, so a Gaussian control (2 subsets) counts for what it costs
    beside the real data's 2 + B, and a deterministic method counts one seed, a stochastic one all of `cfg.seeds`."""
    cfg = cfg or RetainedErrorConfig()
    return pairs * len(_seeds(method, cfg)) * (2 + (cfg.n_controls if controls else 0))


def retained_error(
    method: str | Callable[[int, int], AttentionMethod],
    data: Mapping[int, Sequence[SequenceQKV]],
    groups: Mapping[int, torch.Tensor],
    cfg: RetainedErrorConfig | None = None,
    *,
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Table 1 for one method on captured data. `method` is a registered name (built at its initialisation,
    one instance per layer and seed) or a factory (layer, seed) -> AttentionMethod (e.g. calibrated ones).
    data: layer -> sequences; groups: layer -> LongTensor [Hq, d]. Returns a JSON-ready dict. `progress(n)` is
    called as the work goes, n in the units of `work_units` (which gives their total)."""
    cfg = cfg or RetainedErrorConfig()
    dtype = getattr(torch, cfg.dtype)
    if isinstance(method, str):
        name = method
        first = next(iter(data.values()))[0]
        hq, hkv, d = first.q.shape[1], first.k.shape[1], first.q.shape[-1]

        def factory(layer, seed):
            return build_method(name, hq, hkv, d, layer_idx=layer, seed=seed)
    else:
        factory, name = method, None
    seeds = _seeds(method, cfg)
    gen = torch.Generator().manual_seed(cfg.seed)
    ratios, ratios_ctrl, per_layer, sizes = [], [], {}, []
    for layer in sorted(data):
        g = torch.as_tensor(groups[layer]).long()
        s_mask = subset_masks(g)
        sizes.append(int(s_mask.sum()))
        ctrl = matched_controls(g, cfg.n_controls, gen) if cfg.n_controls else s_mask.new_zeros(0, *s_mask.shape)
        masks = torch.cat([torch.ones_like(s_mask)[None], s_mask[None], ctrl])  # [full, S, controls...]
        layer_r = []
        for seq in data[layer]:
            if name is None and len(layer_r) == 0:
                name = factory(layer, seeds[0]).name
            pos = _sample_positions(seq.q.shape[2], cfg.queries, gen)
            err = _sequence_errors(lambda s, L=layer: factory(L, s), seeds, seq, pos, masks, cfg.control_batch,
                                   dtype, progress)
            e_full = float(err[0])
            r = err[1:] / e_full if e_full > 0 else torch.full_like(err[1:], math.nan)  # Eq. 14 per (layer, seq)
            layer_r.append({"E_full": e_full, "E_S": float(err[1]), "R_S": float(r[0])})
            ratios.append(float(r[0]))
            ratios_ctrl.append(r[1:])
        per_layer[layer] = {
            "R_S": sum(x["R_S"] for x in layer_r) / len(layer_r),
            "E_S": sum(x["E_S"] for x in layer_r) / len(layer_r),
            "E_full": sum(x["E_full"] for x in layer_r) / len(layer_r),
            "subset_dims": int(s_mask.sum()),
            "sequences": len(layer_r),
        }
    r_s = sum(ratios) / len(ratios)  # macro-average over layers and sequences
    controls = torch.stack(ratios_ctrl).mean(0).tolist() if cfg.n_controls else []
    hq, d = next(iter(groups.values())).shape
    return {
        "method": name,
        "R_S": r_s,
        "controls": controls,
        "n_controls": cfg.n_controls,
        "p_value": p_value(r_s, controls) if controls else None,
        "seeds": list(seeds),
        "per_layer": per_layer,
        "subset_fraction": sum(sizes) / (len(sizes) * hq * d),
        "subset_dims_total": sum(sizes),
    }


# --------------------------------------------------------------------------------------------- Gaussian control


def gaussian_groups(n_heads: int, head_dim: int, cfg: RetainedErrorConfig, gen: torch.Generator) -> torch.Tensor:
    """Groups [Hq, d] from the App. B procedure applied to contribution scores of i.i.d. N(0, 1) q/k prompts."""
    from oal.analysis import head_contributions, stable_gap_groups

    chi = torch.stack([
        head_contributions(torch.randn(1, n_heads, cfg.gaussian_prompt_len, head_dim, generator=gen,
                                       dtype=torch.float64),
                           torch.randn(1, n_heads, cfg.gaussian_prompt_len, head_dim, generator=gen,
                                       dtype=torch.float64))[0]
        for _ in range(cfg.gaussian_prompts)
    ])  # [P, Hq, d]
    return stable_gap_groups(chi.transpose(0, 1), seed=cfg.seed, **cfg.grouping).groups


def gaussian_control(method, data: Mapping[int, Sequence[SequenceQKV]], cfg: RetainedErrorConfig | None = None,
                     *, progress: Callable[[int], None] | None = None) -> dict:
    """Table 1's Gaussian column: the same protocol with q, k replaced by i.i.d. N(0, 1) samples (v kept) and
    S_h from the same grouping procedure on Gaussian contribution scores (App. A.1)."""
    cfg = cfg or RetainedErrorConfig()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    g_data, g_groups = {}, {}
    for layer, seqs in data.items():
        hq, d = seqs[0].q.shape[1], seqs[0].q.shape[-1]
        g_groups[layer] = gaussian_groups(hq, d, cfg, gen)
        # drawn on the CPU (the same draws on every device), then placed beside the values they meet
        g_data[layer] = [SequenceQKV(torch.randn(s.q.shape, generator=gen, dtype=torch.float64).to(s.v.device),
                                     torch.randn(s.k.shape, generator=gen, dtype=torch.float64).to(s.v.device), s.v)
                         for s in seqs]
    no_ctrl = copy.copy(cfg)
    no_ctrl.n_controls = 0
    return retained_error(method, g_data, g_groups, no_ctrl, progress=progress)
