"""`analyze`: capture -> per-prompt contribution scores -> stable-gap groups -> groups.json, analysis.json, figures.

Writes into `out_dir`:
- groups.json: per layer, per query head: groups, chi, order, candidate cuts with rho and bootstrap support,
  retained cuts (natural / fallback), top-5 dims and concentration. `load_groups` reads it back.
- analysis.json: the App. A diagnostics: top-5 concentration vs two isotropic Gaussian controls (Fig. 5),
  held-out stability (Spearman rho, top-5 overlap; Fig. 6), normalised top-5 contributions across prefix lengths
  (Table 4), group-count statistics, the attention regime and the per-query offsets (`oal.analysis.offset`).
- figures/*.png.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
import transformers
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from oal.analysis import figures as figs
from oal.analysis.contributions import check_finite_attention, head_contributions, prefix_contributions
from oal.analysis.controls import gaussian_chi, share_at, spearman, topk_concentration, topk_overlap
from oal.analysis.grouping import (
    check_min_groups,
    check_settings,
    fixed_budget_groups,
    grouping_params,
    pair_tied_groups,
    stable_gap_groups,
)
from oal.analysis.offset import OffsetAccumulator, offset_summary
from oal.analysis.regime import ANALYZE_LOGITS, ANALYZE_ROWS, RegimeAccumulator
from oal.errors import InputError
from oal.launch import log_console
from oal.models.capture import Captured, attention_module, capture
from oal.models.encoder import is_encoder
from oal.models.provenance import weights_record
from oal.rundir.files import atomic_write_json, check_out_dir, load_json, strict_json

GROUPS_FILE = "groups.json"
ANALYSIS_FILE = "analysis.json"
TOP_K = 5


def _batches(prompts, tokenizer, batch_size: int, device) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Token blocks [P, L] (no padding), a list of strings (tokenised without BOS/EOS, right-padded), or a tokenised
    batch {"input_ids": [P, L], "attention_mask": [P, L]} (e.g. encoder passages with their special tokens)."""
    if isinstance(prompts, Mapping):
        ids, mask = prompts.get("input_ids"), prompts.get("attention_mask")
        if not torch.is_tensor(ids) or ids.dim() != 2 or mask is None or mask.shape != ids.shape:
            raise ValueError("prompts: expected input_ids and an attention_mask of the same shape [P, L]")
        return [(ids[i : i + batch_size].to(device), mask[i : i + batch_size].to(device))
                for i in range(0, ids.shape[0], batch_size)]
    if torch.is_tensor(prompts):
        if prompts.dim() != 2 or prompts.shape[0] == 0 or prompts.shape[1] == 0:
            raise ValueError(f"prompts: expected token ids [P, L] with P, L >= 1, got {tuple(prompts.shape)}")
        return [(prompts[i : i + batch_size].to(device), None) for i in range(0, prompts.shape[0], batch_size)]
    if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts: expected a LongTensor [P, L] or a non-empty list of strings")
    if tokenizer is None:
        raise ValueError("tokenizer: required when prompts are strings")
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    if any(len(x) == 0 for x in ids):
        raise ValueError("prompts: every prompt must contain at least one token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = []
    for i in range(0, len(ids), batch_size):
        chunk = ids[i : i + batch_size]
        n = max(len(x) for x in chunk)
        t = torch.full((len(chunk), n), pad, dtype=torch.long)
        m = torch.zeros(len(chunk), n, dtype=torch.long)
        for j, x in enumerate(chunk):
            t[j, : len(x)] = torch.tensor(x)
            m[j, : len(x)] = 1
        out.append((t.to(device), m.to(device)))
    return out


class _Collector:
    """Streaming reducer: per layer, per-prompt chi [P, Hq, d] and running mean |q|, |k| per dimension."""

    def __init__(self, layers: list[int], n_prompts: int):
        self.chi: dict[int, torch.Tensor] = {}
        self.abs_q: dict[int, torch.Tensor] = {}
        self.abs_k: dict[int, torch.Tensor] = {}
        self.tokens = 0.0
        self.n_prompts, self.offset = n_prompts, 0
        self.layers = layers

    def __call__(self, c: Captured) -> None:
        b = c.q.shape[0]
        chi = head_contributions(c.q, c.k, c.attention_mask, causal=c.causal).to("cpu", torch.float64)  # Eq. (2)
        if c.layer not in self.chi:
            self.chi[c.layer] = torch.zeros(self.n_prompts, *chi.shape[1:], dtype=torch.float64)
            self.abs_q[c.layer] = torch.zeros(c.q.shape[1], c.q.shape[-1], dtype=torch.float64)
            self.abs_k[c.layer] = torch.zeros(c.k.shape[1], c.k.shape[-1], dtype=torch.float64)
        self.chi[c.layer][self.offset : self.offset + b] = chi
        m = torch.ones(c.q.shape[0], c.q.shape[2], device=c.q.device) if c.attention_mask is None \
            else c.attention_mask.to(c.q.dtype)
        self.abs_q[c.layer] += torch.einsum("bhnd,bn->hd", c.q.abs().float(), m.float()).cpu().double()
        self.abs_k[c.layer] += torch.einsum("bhnd,bn->hd", c.k.abs().float(), m.float()).cpu().double()
        if c.layer == self.layers[-1]:
            self.tokens += float(m.sum())
            self.offset += b


def _check_finite(c: Captured, where: str) -> None:
    """Each layer's capture is checked once, before any reducer reads it (they failed naming no layer); v and the
    output too, which the analysis does not read: a layer whose attention overflows makes every later layer's q, k
    non-finite, and the error then named a later layer."""
    check_finite_attention(c.layer, {"q": c.q, "k": c.k, "v": c.v, "out": c.out}, where, real=c.attention_mask)


def _run_capture(model, batches, layers, n_prompts, progress, task, *reducers, where: str) -> _Collector:
    col = _Collector(layers, n_prompts)

    def on_layer(c: Captured) -> None:
        _check_finite(c, where)
        col(c)
        for reduce in reducers:
            reduce(c)

    for ids, mask in batches:
        capture(model, ids, layers, on_layer, mask, stop_after_last=True)
        progress.advance(task, ids.shape[0])
    return col


def _prefix_shares(model, seq: torch.Tensor, layers: list[int], lengths: list[int]):
    """Table 4 data: normalised chi of each head's top-5 dims (identified at the longest length) per prefix length."""
    out = {}

    def on_layer(c: Captured) -> None:
        _check_finite(c, f"the {seq.numel()}-token sequence")
        rep = c.q.shape[1] // c.k.shape[1]
        k = c.k.repeat_interleave(rep, 1)  # GQA: query head h uses KV head h // rep
        chi = prefix_contributions(c.q[0], k[0], lengths).to("cpu", torch.float64)  # [n_len, Hq, d]
        share = chi / chi.sum(-1, keepdim=True)
        dims = chi[-1].topk(min(TOP_K, chi.shape[-1]), dim=-1).indices  # [Hq, 5] at the longest length
        out[c.layer] = (dims, share.gather(-1, dims[None].expand(len(lengths), -1, -1)))  # [n_len, Hq, 5]

    capture(model, seq[None], layers, on_layer, stop_after_last=True)
    return out


def _default_lengths(n: int) -> list[int]:
    lengths = [2**i for i in range(4, 20) if 2**i < n and 2**i >= max(16, n // 64)]
    return [*lengths, n]


def analyze(
    model,
    tokenizer,
    prompts,
    layers: Sequence[int],
    out_dir: str | Path,
    *,
    heldout=None,
    long_sequence: torch.Tensor | None = None,
    lengths: Sequence[int] | None = None,
    representative: tuple[int, int] | None = None,
    batch_size: int = 8,
    figures: bool = True,
    console: Console | None = None,
    results: Console | None = None,
    meta: dict | None = None,
    budget: int | None = None,
    pairs: bool = False,
    progress: bool = True,
    **grouping,
) -> dict:
    """Group every query head of `layers` from `prompts` (token blocks [P, L] or strings) and write the outputs.

    heldout: prompts for the App. A.3 input-stability check (same format as `prompts`);
    long_sequence: LongTensor [N] for the Table 4 sequence-length check at prefix `lengths`;
    **grouping: keyword arguments of `stable_gap_groups`; representative: (layer, head) for the single-head figures.
    console: progress bars (default: stderr; `progress=False`: none); results: the summary table (default:
    `console`).
    budget: G for the fixed-budget procedure of Fig. 2(b) (`fixed_budget_groups`: the G - 1 largest adjacent gaps
    of the sorted profile) instead of App. B's stable-gap groups -- a departure from the paper's protocol, which
    uses App. B for conversion; the App. B result is still computed and recorded beside it.
    pairs: App. B over RoPE's rotation pairs (`pair_tied_groups`: dims r and r + d/2 share a group, so that every
    group sum depends on relative positions only), also a departure, with App. B's result recorded beside it.
    Also records the attention regime of the prompts (`oal.analysis.regime`) in analysis.json["regime"], and
    their per-query offsets under the groups used (`oal.analysis.offset`) in analysis.json["offset"].
    Returns the analysis summary (also written to analysis.json).
    """
    params = grouping_params(**grouping)  # checked before the expensive capture
    check_settings(*(params[k] for k in ("tail_fraction", "min_support", "min_ratio", "min_groups", "n_bootstrap",
                                         "eps")))
    if budget is not None and (not isinstance(budget, int) or budget < 1):
        raise ValueError(f"budget: expected a group budget G >= 1, got {budget!r}")
    if budget is not None and pairs:
        raise ValueError("pairs: choose one of a group budget and pair-tied groups")
    seed = params["seed"]
    console = console or log_console()
    out = check_out_dir(out_dir)
    layers = sorted(int(i) for i in layers)
    for i in layers:
        attention_module(model, i)  # validates architecture and layer range with a clear error
    if layers:
        attn = attention_module(model, layers[0])
        head_dim = getattr(attn, "head_dim", None) or attn.attention_head_size  # the latter: BERT-family encoders
        check_min_groups(head_dim, params["tail_fraction"], params["min_groups"])
        if pairs:  # App. B over the d/2 RoPE pairs (`pair_tied_groups`): refused here, not after the capture
            if head_dim % 2:
                raise InputError(f"app-b-pairs ties RoPE pairs and needs an even head dim, got d = {head_dim}",
                                 "--grouping", "pairs")
            check_min_groups(head_dim // 2, params["tail_fraction"], params["min_groups"],
                             f"the d/2 = {head_dim // 2} RoPE pairs (app-b-pairs)")
        if budget is not None and budget > head_dim:  # it was capped at head_dim without a word
            raise ValueError(f"budget: a budget of {budget} groups exceeds the {head_dim} dimensions of a head")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers: duplicates in {layers}")
    device = next(model.parameters()).device
    batches = _batches(prompts, tokenizer, batch_size, device)
    held_batches = None if heldout is None else _batches(heldout, tokenizer, batch_size, device)
    n_prompts = sum(b[0].shape[0] for b in batches)
    prompt_lengths = [
        int(n) for ids, m in batches for n in (m.sum(1).tolist() if m is not None else [ids.shape[1]] * ids.shape[0])
    ]
    rep = representative if representative is not None else (layers[0], 0)
    if rep[0] not in layers or not 0 <= rep[1] < model.config.num_attention_heads:
        raise ValueError(f"representative: expected (layer in {layers}, head < Hq), got {rep}")
    if long_sequence is not None and is_encoder(model):
        raise ValueError("long_sequence: the prefix-length check (Table 4) needs causal attention; encoders have none")
    if long_sequence is not None:
        long_sequence = long_sequence.reshape(-1).to(device)
        lengths = list(lengths) if lengths is not None else _default_lengths(long_sequence.numel())
        if any(not 1 <= n <= long_sequence.numel() for n in lengths) or lengths != sorted(lengths):
            raise ValueError(f"lengths: expected increasing values in [1, {long_sequence.numel()}], got {lengths}")

    t0 = time.perf_counter()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with torch.no_grad(), Progress(*columns, console=console, transient=False, disable=not progress) as bars:
        task = bars.add_task("capture: calibration prompts", total=n_prompts)
        regime = RegimeAccumulator(min_keys=min(16, min(prompt_lengths)), max_rows=ANALYZE_ROWS,
                                    max_logits=ANALYZE_LOGITS)  # linear in N: see oal.analysis.regime
        offsets = OffsetAccumulator()
        calib = _run_capture(model, batches, layers, n_prompts, bars, task, regime, offsets,
                             where="the grouping prompts")
        held = None
        if held_batches is not None:
            n_held = sum(b[0].shape[0] for b in held_batches)
            task = bars.add_task("capture: held-out prompts", total=n_held)
            held = _run_capture(model, held_batches, layers, n_held, bars, task, where="the held-out prompts")
        prefix = None
        if long_sequence is not None:
            task = bars.add_task(f"capture: {long_sequence.numel()}-token sequence", total=1)
            prefix = _prefix_shares(model, long_sequence, layers, lengths)
            bars.advance(task)
    t_capture = time.perf_counter() - t0

    chi_pp = torch.stack([calib.chi[i].transpose(0, 1) for i in layers])  # [L, Hq, P, d]
    n_layers, n_heads, _, d = chi_pp.shape
    t1 = time.perf_counter()
    res = stable_gap_groups(chi_pp, **params)  # all heads of all layers in one vectorised call
    used = (fixed_budget_groups(res.chi, min(budget, d)) if budget is not None  # [L, Hq, d]
            else pair_tied_groups(chi_pp, **params) if pairs else res.groups)
    n_used = used.amax(-1) + 1
    t_group = time.perf_counter() - t1
    chi = res.chi  # [L, Hq, d]
    top_k = min(TOP_K, d)  # a head of fewer dims (a toy model's) failed after the capture with topk's RuntimeError
    top_dims = chi.topk(top_k, dim=-1).indices
    real_top = topk_concentration(chi, top_k)

    # Fig. 5 controls: i.i.d. N(0, 1) q/k with the real prompt count, lengths and head dim
    gen = torch.Generator().manual_seed(seed)
    causal = not is_encoder(model)  # the control takes the model's pairs (Eq. 2): every pair for encoders
    g_pp = torch.stack([gaussian_chi(n_prompts, n_heads, d, prompt_lengths, gen, causal=causal).transpose(0, 1)
                        for _ in layers])
    g_chi = g_pp.mean(2)
    g_res = stable_gap_groups(g_pp, **params)
    gauss_top = topk_concentration(g_chi, top_k)
    gauss_at_real = share_at(g_chi, top_dims)

    stab = None
    if held is not None:
        h_chi = torch.stack([held.chi[i].mean(0) for i in layers])  # [L, Hq, d]
        stab = dict(spearman=spearman(chi, h_chi), overlap=topk_overlap(chi, h_chi, top_k), chi=h_chi)

    heads_json = {}
    for li, layer in enumerate(layers):
        rows = []
        for h in range(n_heads):
            r = res[li, h]
            row = dict(
                head=h, kv_head=h // (n_heads // calib.abs_k[layer].shape[0]), n_groups=r.n_groups,
                groups=r.groups.tolist(), chi=r.chi.tolist(), order=r.order.tolist(), cuts=r.cuts,
                fallback_cuts=r.fallback, candidates=r.candidates.tolist(), rho=r.ratios.tolist(),
                support=r.support.tolist(), natural=r.natural.tolist(), top5=top_dims[li, h].tolist(),
                top5_concentration=float(real_top[li, h]),
            )
            if budget is not None or pairs:  # the groups used are the budget's (pairs'); App. B's stay as evidence
                g = used[li, h]
                row.update(app_b=dict(n_groups=r.n_groups, groups=r.groups.tolist(), cuts=r.cuts,
                                      fallback_cuts=r.fallback),
                           n_groups=int(n_used[li, h]), groups=g.tolist(), fallback_cuts=[],
                           cuts=[int(k) for k in range(1, d) if g[r.order[k]] != g[r.order[k - 1]]])
            rows.append(row)
        heads_json[str(layer)] = rows
    procedure = f"budget:{budget}" if budget is not None else "app_b_pairs" if pairs else "app_b"
    info = dict(meta or {}, layers=layers, n_prompts=n_prompts, prompt_lengths=prompt_lengths, head_dim=d,
                n_heads=n_heads, n_kv_heads=int(calib.abs_k[layers[0]].shape[0]), grouping=params,
                procedure=procedure,
                versions=dict(torch=torch.__version__, transformers=transformers.__version__,
                              python=platform.python_version()),
                base_model=weights_record(model))  # what the groups were computed from (`check_groups_model`)
    atomic_write_json(out / GROUPS_FILE, dict(format="oal.groups/1", **info, heads=heads_json))

    li_rep = layers.index(rep[0])
    summary = dict(
        info,
        representative=dict(layer=rep[0], head=rep[1]),
        timing_s=dict(capture=t_capture, grouping=t_group),
        regime=regime.summary(),
        offset=offset_summary(offsets.layers, {i: used[li] for li, i in enumerate(layers)}),
        n_groups=dict(
            per_head=n_used.tolist(), histogram=_histogram(n_used),
            app_b_per_head=res.n_groups.tolist(), app_b_histogram=_histogram(res.n_groups),
            natural_only_fraction=float((res.selected == res.natural).all(-1).double().mean()),
            gaussian_histogram=_histogram(g_res.n_groups),
        ),
        concentration=dict(
            real_top5=real_top.tolist(), gaussian_top5=gauss_top.tolist(), gaussian_at_real_top5=gauss_at_real.tolist(),
            # a dead head (chi all zero) has no defined share: the means are over the heads that have one
            mean=dict(real_top5=float(real_top.nanmean()), gaussian_top5=float(gauss_top.nanmean()),
                      gaussian_at_real_top5=float(gauss_at_real.nanmean())),
            representative=dict(real_top5=float(real_top[li_rep, rep[1]]),
                                gaussian_top5=float(gauss_top[li_rep, rep[1]]),
                                gaussian_at_real_top5=float(gauss_at_real[li_rep, rep[1]])),
        ),
    )
    if stab is not None:
        summary["stability_inputs"] = dict(
            n_heldout=sum(b[0].shape[0] for b in held_batches),
            spearman=stab["spearman"].tolist(), top5_overlap=stab["overlap"].tolist(),
            mean_spearman=float(stab["spearman"].nanmean()), min_spearman=_nanmin(stab["spearman"]),
            mean_top5_overlap=float(stab["overlap"].double().mean()),
            representative=dict(spearman=float(stab["spearman"][li_rep, rep[1]]),
                                top5_overlap=int(stab["overlap"][li_rep, rep[1]])),
        )
    if prefix is not None:
        dims_rep, share_rep = prefix[rep[0]][0][rep[1]], prefix[rep[0]][1][:, rep[1]]
        summary["stability_lengths"] = dict(
            lengths=lengths,
            representative=dict(dims=dims_rep.tolist(), percent=(100 * share_rep).tolist()),
            per_head={str(i): dict(dims=prefix[i][0].tolist(), percent=(100 * prefix[i][1]).transpose(0, 1).tolist())
                      for i in layers},
        )
    # on disk an undefined statistic (a dead head's) is null, not a bare NaN; the figures take the NaN
    atomic_write_json(out / ANALYSIS_FILE, strict_json(summary))

    if figures:
        _figures(out / "figures", layers, heads_json, calib, summary, stab, rep, li_rep)
    _print_table(results or console, layers, res, real_top, gauss_top, gauss_at_real, stab, summary)
    return summary


def _histogram(n_groups: torch.Tensor) -> dict[str, int]:
    vals, counts = torch.unique(n_groups, return_counts=True)
    return {str(int(v)): int(c) for v, c in zip(vals, counts, strict=True)}


def _figures(fig_dir: Path, layers, heads_json, calib, summary, stab, rep, li_rep) -> None:
    for layer in layers:
        figs.layer_profiles(fig_dir / f"profile_layer{layer}.png", layer, heads_json[str(layer)])
    head = heads_json[str(rep[0])][rep[1]]
    n_tok = max(calib.tokens, 1.0)
    figs.head_panels(fig_dir / "representative_head.png", rep[0], head,
                     (calib.abs_q[rep[0]][rep[1]] / n_tok).tolist(),
                     (calib.abs_k[rep[0]][head["kv_head"]] / n_tok).tolist())
    per_head = summary["n_groups"]["per_head"]
    figs.heatmap(fig_dir / "heatmap_groups.png", per_head, layers, "Groups per head (App. B)", "groups", "d")
    figs.heatmap(fig_dir / "heatmap_top5.png", summary["concentration"]["real_top5"], layers,
                 "Top-5 contribution concentration", "share of total $\\chi$", ".2f")
    label = f"layer {rep[0]}, head {rep[1]}"
    figs.gaussian_controls(fig_dir / "gaussian_controls.png", summary["concentration"]["representative"],
                           summary["concentration"]["mean"], label)
    if stab is not None:
        s = summary["stability_inputs"]["representative"]
        figs.stability_scatter(fig_dir / "stability_inputs.png", head["chi"], stab["chi"][li_rep, rep[1]].tolist(),
                               s["spearman"], s["top5_overlap"], label)
    if "stability_lengths" in summary:
        sl = summary["stability_lengths"]
        figs.length_stability(fig_dir / "stability_lengths.png", sl["lengths"], sl["representative"]["dims"],
                              [[p / 100 for p in row] for row in sl["representative"]["percent"]], label)


def _print_table(console, layers, res, real_top, gauss_top, gauss_at_real, stab, summary) -> None:
    table = Table(title="Contribution analysis (per layer, over query heads)", box=box.SIMPLE_HEAD, pad_edge=False,
                  show_edge=False)
    for col in ("layer", "G (mean)", "fallback", "top-5", "Gauss", "@real", "Spearman", "overlap"):
        table.add_column(col, justify="right", no_wrap=True, min_width=len(col))
    for li, layer in enumerate(layers):
        g = res.n_groups[li]
        n_fb = int((res.selected[li] & ~res.natural[li]).any(-1).sum())
        row = [str(layer), f"{int(g.min())}-{int(g.max())} ({g.double().mean():.2f})", f"{n_fb}/{g.numel()}",
               f"{100 * real_top[li].nanmean():.1f}%", f"{100 * gauss_top[li].nanmean():.1f}%",
               f"{100 * gauss_at_real[li].nanmean():.1f}%"]
        if stab is not None:
            row += [f"{stab['spearman'][li].nanmean():.3f}", f"{stab['overlap'][li].double().mean():.2f}"]
        else:
            row += ["-", "-"]
        table.add_row(*row)
    console.print(table)
    console.print("G: groups per head, min-max (mean); fallback: heads with cuts added to reach G_min; top-5: "
                  "share of total chi in the 5 largest dims; Gauss: the same for i.i.d. N(0,1) q/k; @real: Gaussian "
                  "share at the real top-5 dims; Spearman / overlap (of 5): calibration vs held-out chi")
    console.print(f"group-count histogram: {summary['n_groups']['histogram']} "
                  f"(Gaussian control: {summary['n_groups']['gaussian_histogram']})")
    if summary["procedure"] != "app_b":
        what = ("App. B over RoPE pairs" if summary["procedure"] == "app_b_pairs" else "Fig. 2(b)'s fixed budget")
        console.print(f"groups used: {summary['procedure']} ({what}, a departure from App. B; "
                      f"App. B would give {summary['n_groups']['app_b_histogram']})")
    console.print(f"attention regime on these prompts: {summary['regime']['verdict']['text']}")
    console.print(f"per-query offsets: this model {summary['offset']['verdict']['text']}")


def _nanmin(x: torch.Tensor) -> float:
    defined = x[~x.isnan()]
    return float(defined.min()) if defined.numel() else math.nan


def check_groups_model(path: str | Path, model, provenance=None) -> None:
    """Refuse `model` unless it is the model groups.json was computed from (its tensors; with `provenance` from
    `load_model` and a groups.json written by `oal analyze`, also the files of its folder)."""
    from oal.models.provenance import check_base_model

    path = Path(path)
    path = path / GROUPS_FILE if path.is_dir() else path
    data = load_json(path)
    record = dict(data.get("base_model") or {}) if isinstance(data, dict) else {}
    files = (data.get("provenance") or {}).get("sha256") if isinstance(data, dict) else None
    check_base_model({**record, "hashes": files}, model, provenance, where=str(path))


def load_groups(path: str | Path) -> dict[int, torch.Tensor]:
    """Read groups.json (or a directory containing it) -> {layer: LongTensor [Hq, d]}."""
    path = Path(path)
    if path.is_dir():
        path = path / GROUPS_FILE
    if not path.is_file():
        what = "is a directory, not the groups file" if path.is_dir() else "is missing"
        raise ValueError(f"{path}: {what} (`oal analyze` writes {GROUPS_FILE})")
    data = load_json(path)
    if not isinstance(data, dict) or data.get("format") != "oal.groups/1":
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"path: {path} is not an oal groups file (format={got!r})")
    try:
        out = {}
        for layer, rows in data["heads"].items():
            if sorted(h["head"] for h in rows) != list(range(len(rows))):
                raise ValueError(f"layer {layer}: expected one row per head 0..{len(rows) - 1}")
            ids = [h["groups"] for h in sorted(rows, key=lambda h: h["head"])]
            # Eq. 19: an integer id >= 0 per dimension (torch.tensor would truncate 1.5 to 1 without a word)
            if not all(type(g) is int and g >= 0 for row in ids for g in row):
                raise ValueError(f"layer {layer}: group ids must be integers >= 0")
            out[int(layer)] = torch.tensor(ids, dtype=torch.long)
        return out
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"{path}: damaged groups record ({type(exc).__name__}: {exc})") from None
