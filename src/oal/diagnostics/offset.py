"""The per-query-offset experiment: plant a function-preserving offset in captured q/k, regroup, recalibrate, compare.

For one layer's captured post-RoPE q/k/v, in the lowest-frequency RoPE pair P = (r1, r2) of every KV head g (and
every query head h that reads it):

    q'_{h,P} = c_g q_{h,P}          k'_{g,P} = k_{g,P} / c_g + u_g        (u_g constant over positions)

so that q'_P . k'_P = q_P . k_P + c_g q_P . u_g: every pair keeps its contribution and gains a term that depends on
the query only. Softmax cancels a per-query constant, so the attention output is unchanged in exact arithmetic; the
largest change is measured in float64 (and in the captured dtype). The planted key component is constant in the
post-RoPE frame, as a key bias on RoPE's slowest pair nearly is (Qwen2's k_proj bias). u_g = a_g e_g: e_g is the
top principal direction of the pair's queries (covariance averaged over the group's query heads), a_g the RMS norm of
the pair's keys (a key-sized constant), and c_g is set so that the offset c_g q_P . u_g / sqrt(d) has the requested
standard deviation over the training queries (root mean square over the group's query heads).

For each offset size the App. B groups are recomputed (`stable_gap_groups` on the planted grouping prompts, with the
run's grouping settings), the learned global quadratic and OAL are recalibrated by the one calibration driver
(`calibration.fit.calibrate_methods`, the run's settings), and both are scored by Eq. 22 (RelMSE, before and after
W_o) on the planted held-out blocks against the unchanged softmax output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from oal.rundir.files import atomic_save_figure

__all__ = ["OFFSET_FILE", "OFFSET_STDS", "offset_experiment", "offset_plan", "plant_offset", "plot_offset",
           "slowest_rope_pair", "softmax_reference"]

OFFSET_FILE = "offset.json"
OFFSET_STDS = (0.0, 1.0, 2.0, 3.0, 6.0)  # per-query offset std, logits


def slowest_rope_pair(model) -> tuple[int, int]:
    """The dims (i, i + R/2) of RoPE's lowest frequency (HF rotate_half layout, R the rotary dims); without RoPE
    (no `rotary_emb.inv_freq`) every pair is position-free and the last one, (d/2 - 1, d - 1), is taken."""
    rot = getattr(getattr(model, "model", None), "rotary_emb", None)
    inv = getattr(rot, "inv_freq", None)
    if inv is not None and inv.numel() > 0:
        i = int(inv.float().argmin())
        return i, i + inv.numel()
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return d // 2 - 1, d - 1


def softmax_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Dense causal softmax attention in float64 (GQA): q [B, Hq, N, d], k/v [B, Hkv, N, *] -> [B, Hq, N, dv]."""
    rep = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = qd @ kd.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
    n = q.shape[2]
    s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), -math.inf)
    return torch.softmax(s, -1) @ vd


def offset_plan(q: torch.Tensor, k: torch.Tensor, dims: Sequence[int], offset_std: float) -> dict[str, torch.Tensor]:
    """c [Hkv], u [Hkv, len(dims)] (float64) that plant a per-query offset of std `offset_std` logits on the
    queries q [S, Hq, N, d] with keys k [S, Hkv, N, d] (see the module doc); c = 1, u = 0 for offset_std 0."""
    hkv, d = k.shape[1], q.shape[-1]
    rep = q.shape[1] // hkv
    if offset_std < 0 or not math.isfinite(offset_std):
        raise ValueError(f"offset_std: expected a finite value >= 0, got {offset_std}")
    dims = list(dims)
    c = torch.ones(hkv, dtype=torch.float64)
    u = torch.zeros(hkv, len(dims), dtype=torch.float64)
    if offset_std == 0:
        return {"c": c, "u": u}
    qp = q[..., dims].double().transpose(0, 1).reshape(hkv, rep, -1, len(dims))  # [Hkv, rep, S*N, 2]
    qc = qp - qp.mean(2, keepdim=True)
    cov = torch.einsum("grni,grnj->gij", qc, qc) / (rep * qc.shape[2])  # averaged over the group's query heads
    evals, evecs = torch.linalg.eigh(cov)
    e = evecs[..., -1]  # [Hkv, 2] top principal direction
    a = k[..., dims].double().square().sum(-1).mean((0, 2)).sqrt()  # RMS norm of the key pair [Hkv]
    spread = evals[..., -1].clamp_min(1e-30).sqrt()  # RMS std of q_P . e over the group's heads
    c = offset_std * math.sqrt(d) / (a.clamp_min(1e-30) * spread)
    return {"c": c, "u": a[:, None] * e}


def plant_offset(q: torch.Tensor, k: torch.Tensor, dims: Sequence[int], plan: Mapping[str, torch.Tensor],
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Planted (q', k') in the dtype of q/k; computed in float64. q [S, Hq, N, d], k [S, Hkv, N, d]."""
    dims = list(dims)
    rep = q.shape[1] // k.shape[1]
    c, u = plan["c"].to(q.device), plan["u"].to(q.device)
    qd, kd = q.double().clone(), k.double().clone()
    qd[..., dims] *= c.repeat_interleave(rep)[None, :, None, None]
    kd[..., dims] = kd[..., dims] / c[None, :, None, None] + u[None, :, None, :]
    return qd.to(q.dtype), kd.to(k.dtype)


def _planted(data, dims, plan):
    from oal.calibration.data import LayerData

    q, k = plant_offset(data.q, data.k, dims, plan)
    return LayerData(q, k, data.v, data.out, mask=data.mask, causal=data.causal)


def _softmax_change(datasets, dims, plan) -> dict[str, float]:
    """Largest |softmax(planted) - softmax(original)| in float64 and in the captured dtype, over all sequences."""
    change64, change = 0.0, 0.0
    for data in datasets:
        for s in range(data.q.shape[0]):
            q, k, v = data.q[s : s + 1], data.k[s : s + 1], data.v[s : s + 1]
            pq, pk = plant_offset(q.double(), k.double(), dims, plan)
            ref = softmax_reference(q, k, v)
            change64 = max(change64, float((softmax_reference(pq, pk, v) - ref).abs().max()))
            pq, pk = plant_offset(q, k, dims, plan)  # rounded to the dtype calibration sees
            change = max(change, float((softmax_reference(pq, pk, v) - ref).abs().max()))
    return {"float64": change64, "captured_dtype": change}


def _relmse(methods: Mapping[str, torch.nn.Module], held, o_proj=None) -> dict[str, dict[str, float]]:
    """Eq. 21-22 of each method on one layer's (planted) held-out data, before and (with `o_proj`) after W_o."""
    from oal.evaluate.fidelity import _post_o, sequence_errors, summarize

    out = {}
    with torch.no_grad():
        for name, m in methods.items():
            dt = next(m.parameters()).dtype
            y = torch.cat([m(held.q[s : s + 1].to(dt), held.k[s : s + 1].to(dt), held.v[s : s + 1].to(dt),
                             causal=True) for s in range(held.q.shape[0])])
            res = summarize(*sequence_errors(held.out, y))
            if o_proj is not None:
                post = summarize(*sequence_errors(_post_o(o_proj, held.out), _post_o(o_proj, y)))
                res.update({f"{key}_post_o": v for key, v in post.items()})
            out[name] = res
    return out


def _group_record(groups: torch.Tensor, dims: Sequence[int], plan: Mapping[str, torch.Tensor]) -> list[dict]:
    """Per head: G, the planted dims' group ids, and whether the dims that carry the planted constant (at least 10%
    of |u|^2) sit in non-bulk groups of their own (no other dim), as OAL needs to switch the offset off."""
    rep = groups.shape[0] // plan["u"].shape[0]
    rows = []
    for h in range(groups.shape[0]):
        u = plan["u"][h // rep]
        carry = [r for r, x in zip(dims, u.tolist(), strict=True) if x * x >= 0.1 * float(u.square().sum())]
        ids = sorted({int(groups[h, r]) for r in carry})
        alone = bool(carry) and 0 not in ids and all(
            set(torch.nonzero(groups[h] == g).flatten().tolist()) <= set(dims) for g in ids)
        rows.append({"n_groups": int(groups[h].max()) + 1, "planted_groups": [int(groups[h, r]) for r in dims],
                     "carrying_dims": carry, "isolated": alone})
    return rows


def offset_experiment(grouping, train, val, held, *, layer: int, dims: Sequence[int], grouping_params: dict,
                      cfg, seed: int, stds: Sequence[float] = OFFSET_STDS, o_proj=None,
                      done: Sequence[dict] = (), on_row: Callable[[dict], None] | None = None) -> dict:
    """Run the experiment on one layer's `oal.calibration.data.LayerData` (grouping prompts, calib_train, calib_val,
    held-out fidelity blocks). `done`: rows of an earlier, interrupted run with the same settings (kept, not
    recomputed); `on_row` is called with the rows so far after each new row (to checkpoint).

    Returns {"layer", "dims", "softmax_max_change", "softmax_max_change_captured_dtype", "rows": [...]}: per
    offset std, OAL's and global's held-out RelMSE, their ratio, the regrouped heads and the planted data's
    offset statistics (`oal.analysis.offset`)."""
    from oal.analysis import fixed_budget_groups, head_contributions, stable_gap_groups
    from oal.analysis.grouping import pair_tied_groups
    from oal.analysis.offset import group_offsets, offset_moments
    from oal.calibration.fit import calibrate_methods

    for name, data in (("grouping", grouping), ("train", train), ("val", val), ("held", held)):
        if data.mask is not None or not data.causal:
            raise ValueError(f"{name}: the offset experiment needs causal, unpadded blocks")
    rows = {float(r["offset_std"]): r for r in done}
    change = {"float64": 0.0, "captured_dtype": 0.0}
    for std in stds:
        plan = offset_plan(train.q, train.k, dims, float(std))
        ch = _softmax_change((grouping, train, val, held), dims, plan)
        change = {key: max(change[key], ch[key]) for key in change}
        if float(std) in rows:
            continue
        g_p, tr_p, va_p, ho_p = (_planted(x, dims, plan) for x in (grouping, train, val, held))
        chi_pp = head_contributions(g_p.q, g_p.k).double().transpose(0, 1)  # [Hq, P, d], Eq. 2 per prompt
        app_b = {k: v for k, v in grouping_params.items() if k not in ("pairs", "budget")}
        if grouping_params.get("budget") is not None:  # the run's fixed budget (`--grouping budget:G`)
            groups = fixed_budget_groups(chi_pp.mean(1), min(int(grouping_params["budget"]), chi_pp.shape[-1]))
        elif grouping_params.get("pairs"):  # the run's pair-tied procedure (`--grouping app-b-pairs`)
            groups = pair_tied_groups(chi_pp, seed=seed, **app_b)
        else:
            groups = stable_gap_groups(chi_pp, seed=seed, **app_b).groups
        fitted = calibrate_methods(("global", "oal"), tr_p, va_p, layer=layer, groups=groups, cfg=cfg, seed=seed)
        fid = _relmse({n: m for n, (m, _res) in fitted.items()}, ho_p, o_proj)
        stats = group_offsets(offset_moments(g_p.q, g_p.k), groups)["heads"]
        realised = [float(x) for x in _realised_std(ho_p, held, dims, plan)]
        row = {"offset_std": float(std), "oal_relmse": fid["oal"]["relmse"], "global_relmse": fid["global"]["relmse"],
               "ratio": fid["oal"]["relmse"] / fid["global"]["relmse"], "fidelity": fid,
               "softmax_max_change": ch["float64"], "softmax_max_change_captured_dtype": ch["captured_dtype"],
               "realised_offset_std": realised, "plan": {"c": plan["c"].tolist(), "u": plan["u"].tolist()},
               "groups": _group_record(groups, dims, plan), "group_ids": groups.tolist(),
               **{key: [h[key] for h in stats] for key in ("offset_share", "isolated_offset_share",
                                                          "isolated_offset_std")},
               "val_mse": {n: [h.val_mse for h in res.heads] for n, (_m, res) in fitted.items()}}
        rows[float(std)] = row
        if on_row is not None:
            on_row([rows[s] for s in sorted(rows)])
    return {"layer": layer, "dims": list(dims), "softmax_max_change": change["float64"],
            "softmax_max_change_captured_dtype": change["captured_dtype"], "rows": [rows[s] for s in sorted(rows)]}


def _realised_std(planted, orig, dims, plan) -> torch.Tensor:
    """Per query head, the std over held-out queries of the planted per-query term c q_P . u / sqrt(d)."""
    rep = orig.q.shape[1] // orig.k.shape[1]
    u = plan["u"].repeat_interleave(rep, 0)  # [Hq, 2]
    term = torch.einsum("shni,hi->shn", planted.q[..., list(dims)].double(), u) / math.sqrt(orig.q.shape[-1])
    return term.transpose(0, 1).reshape(orig.q.shape[1], -1).std(1)


def plot_offset(result: Mapping, path: str | Path) -> Path:
    """Held-out RelMSE against the planted offset std, OAL and the learned global quadratic."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    xs = [r["offset_std"] for r in rows]
    fig, ax = plt.subplots(figsize=(4.6, 3.2))
    ax.plot(xs, [r["global_relmse"] for r in rows], "s-", color="#7f7f7f", label="Learned global (G = 1)")
    ax.plot(xs, [r["oal_relmse"] for r in rows], "o-", color="#1f77b4", label="OAL")
    ax.set_xlabel("planted per-query offset std (logits)")
    ax.set_ylabel("held-out RelMSE (Eq. 22)")
    ax.set_title(f"Layer {result['layer']}: offset in RoPE pair {tuple(result['dims'])}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return atomic_save_figure(fig, path, dpi=110, bbox_inches="tight")
