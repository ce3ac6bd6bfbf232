"""Which layers to convert: rank calibrated candidate layers by a cheap criterion and keep the K best.

The paper (and LoLCATs, Liger) fixes a middle range and keeps the first and last layers on softmax. Once every
candidate layer is calibrated, two cheap criteria are available without any training:

- ``fidelity``: the layer's frozen-attention RelMSE after W_o (Eq. 22, App. C) on the calibration validation
  blocks, held out from the coefficients' training (not the fidelity stage's blocks, which the report's Table 2
  measures: choosing on them would bias it);
- ``probe``: a one-layer swap probe, the validation perplexity of the model with only that layer converted
  (calibrated kernel, no adaptation).

Lower is better for both. `conversion_curve` gives the perplexity before adaptation as more layers of an order
are converted, which the report draws for the criterion's order and for the paper's range.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from torch import nn

from oal.evaluate.perplexity import block_nll
from oal.launch import progress_bar
from oal.models.convert import convert

__all__ = ["CRITERIA", "DEFAULT_CRITERION", "SELECTION_COLUMNS", "SELECTION_KEYS", "choose_layers", "comparison_sets",
           "conversion_curve", "criterion_curve", "layer_scores", "parse_auto", "rank_layers", "score_layers",
           "select_layers", "selection_rows", "selection_section", "swap_probe"]

CRITERIA = ("fidelity", "probe")
# The probe by default, as measured on the embedded default before its passkey stages (`oal run --layers auto:2`):
# RelMSE after W_o ranked layers 4, 2, 3, 1 best, exactly the paper's range, which adapted reached test PPL 101.1;
# the probe's top four (2, 3, 4, 5) reached 93.4 (softmax 88.5). A relative error does not see how much the rest of
# the network amplifies it (layer 0: RelMSE 0.33, middle of the pack; alone converted, val PPL 106.9 against 71-79
# for the others). On the shipped default both criteria pick 2-5 (layer 0: RelMSE 0.35, alone val PPL 88.6).
DEFAULT_CRITERION = "probe"
# The configuration keys (config.json's, dotted) of K and the criterion: a run directory may change them (`oal run
# --layers auto:K`, `oal select-layers`), since calibration and the scores depend on neither.
SELECTION_KEYS = ("config.select.", "converted_layers.k", "converted_layers.by")


def parse_auto(spec: str | None) -> int | None:
    """K of a layer spec 'auto:K', None for any other spec (an explicit list or range)."""
    if spec is None or not str(spec).strip().lower().startswith("auto"):
        return None
    _, _, k = str(spec).partition(":")
    try:
        value = int(k)
    except ValueError:
        raise ValueError(f"layers: expected 'auto:K' with an integer K >= 1, got {spec!r}") from None
    if value < 1:
        raise ValueError(f"layers: expected 'auto:K' with K >= 1, got {spec!r}")
    return value


def rank_layers(scores: Mapping[int, float]) -> list[int]:
    """Layers ordered best first (lowest score); ties keep the lower layer index first."""
    bad = {i: s for i, s in scores.items() if not math.isfinite(s)}
    if bad:
        raise ValueError(f"scores: non-finite values for layers {sorted(bad)}")
    return sorted(scores, key=lambda i: (scores[i], i))


def _ppl(model: nn.Module, blocks, batch_size: int) -> float:
    total, count = block_nll(model, blocks, batch_size=batch_size)
    return math.exp(total / count)


def swap_probe(make_model: Callable[[], nn.Module], methods: Mapping[int, nn.Module], blocks, *,
               batch_size: int = 1, progress: bool = False) -> dict[int, float]:
    """Validation perplexity with only layer i converted to `methods[i]`, for every i (no training)."""

    out = {}
    with progress_bar(progress) as bar:
        task = bar.add_task("swap probe", total=len(methods))
        for i in sorted(methods):
            out[i] = _ppl(convert(make_model(), [i], {i: methods[i]}), blocks, batch_size)
            bar.advance(task)
    return out


def conversion_curve(make_model: Callable[[], nn.Module], order: Sequence[int], methods: Mapping[int, nn.Module],
                     blocks, *, max_layers: int | None = None, batch_size: int = 1,
                     progress: bool = False) -> list[dict]:
    """[{"k", "layers", "ppl"}]: perplexity before adaptation with the first k layers of `order` converted."""

    order = list(order)[: max_layers or len(order)]
    missing = [i for i in order if i not in methods]
    if missing:
        raise ValueError(f"order: layers {missing} have no calibrated method")
    out = []
    with progress_bar(progress) as bar:
        task = bar.add_task("conversion curve", total=len(order))
        for k in range(1, len(order) + 1):
            chosen = sorted(order[:k])
            model = convert(make_model(), chosen, {i: methods[i] for i in chosen})
            out.append({"k": k, "layers": chosen, "ppl": _ppl(model, blocks, batch_size)})
            bar.advance(task)
    return out


def layer_scores(model: nn.Module, methods: Mapping[int, nn.Module], by: str, *, fidelity_blocks=None,
                 val_blocks=None, batch_size: int = 1, progress: bool = False) -> dict[int, float]:
    """{layer: score} of one criterion for every calibrated candidate in `methods` (lower is better): `fidelity`
    reads `fidelity_blocks` (held out from calibration training), `probe` the perplexity `val_blocks`."""
    import copy

    from oal.evaluate.fidelity import fidelity

    if by not in CRITERIA:
        raise ValueError(f"by: expected one of {', '.join(CRITERIA)}, got {by!r}")
    if by == "fidelity":
        fid = fidelity(model, fidelity_blocks, {"m": methods}, sorted(methods), batch_size=batch_size,
                       progress=progress)["m"]["per_layer"]
        return {i: fid[str(i)]["relmse_post_o"] for i in sorted(methods)}
    return swap_probe(lambda: copy.deepcopy(model), methods, val_blocks, batch_size=batch_size, progress=progress)


def score_layers(model: nn.Module, methods: Mapping[int, nn.Module], *, fidelity_blocks, val_blocks,
                 paper_layers: Sequence[int], batch_size: int = 1, progress: bool = False) -> dict:
    """What a selection reads that depends on neither K nor the criterion (one stage of `oal run --layers auto:K`,
    kept when only --k or --by changes): every candidate's score by both criteria, their orders, softmax's
    validation perplexity, and the perplexity curve before adaptation over the paper's range in layer order.

    `methods`: {layer: calibrated method} for every candidate; `fidelity_blocks`: blocks held out from calibration
    training (the plan's calibration validation blocks), `val_blocks`: the validation blocks of the perplexity probe.
    Both are validation data: the test blocks stay untouched by the choice.
    """
    import copy

    scores = {c: layer_scores(model, methods, c, fidelity_blocks=fidelity_blocks, val_blocks=val_blocks,
                              batch_size=batch_size, progress=progress) for c in CRITERIA}
    paper = [i for i in paper_layers if i in methods]
    curve = conversion_curve(lambda: copy.deepcopy(model), paper, methods, val_blocks, batch_size=batch_size,
                             progress=progress) if paper else []
    return {"candidates": sorted(methods), "paper_layers": paper, "paper_k": len(paper),
            "scores": {c: {str(i): v for i, v in s.items()} for c, s in scores.items()},
            "order": {c: rank_layers(s) for c, s in scores.items()},
            "softmax_val_ppl": _ppl(model, val_blocks, batch_size), "paper_curve": curve}


def criterion_curve(model: nn.Module, methods: Mapping[int, nn.Module], scored: dict, by: str, *, val_blocks,
                    batch_size: int = 1, progress: bool = False) -> list[dict]:
    """The perplexity curve before adaptation over every candidate in the order of `by` (`scored`: `score_layers`'
    record); it depends on the criterion, not on K."""
    import copy

    if by not in CRITERIA:
        raise ValueError(f"by: expected one of {', '.join(CRITERIA)}, got {by!r}")
    return conversion_curve(lambda: copy.deepcopy(model), scored["order"][by], methods, val_blocks,
                            batch_size=batch_size, progress=progress)


def choose_layers(scored: dict, curve: list[dict], *, k: int, by: str) -> dict:
    """selection.json's record: the `k` best candidates by `by`, from `score_layers`' record and `by`'s curve."""
    if by not in CRITERIA:
        raise ValueError(f"by: expected one of {', '.join(CRITERIA)}, got {by!r}")
    candidates, order = scored["candidates"], scored["order"]
    if not 1 <= k <= len(candidates):
        raise ValueError(f"k: expected 1 <= K <= {len(candidates)} (the candidate layers), got {k}")
    return {"k": k, "by": by, "candidates": candidates, "chosen": sorted(order[by][:k]),
            "paper_layers": scored["paper_layers"], "paper_k": scored["paper_k"], "scores": scored["scores"],
            "order": order, "softmax_val_ppl": scored["softmax_val_ppl"],
            "curves": {"criterion": curve, "paper": scored["paper_curve"]},
            "agreement": len(set(order["fidelity"][:k]) & set(order["probe"][:k])) / k}


def select_layers(model: nn.Module, methods: Mapping[int, nn.Module], *, k: int, by: str, fidelity_blocks,
                  val_blocks, paper_layers: Sequence[int], batch_size: int = 1, progress: bool = False) -> dict:
    """Score every calibrated candidate layer by both criteria, keep the `k` best by `by`, and draw the perplexity
    curves before adaptation (the criterion's order over all candidates; the paper's range in layer order): the
    three steps above in one call (arguments as `score_layers`'). Returns selection.json's record."""
    if by not in CRITERIA:
        raise ValueError(f"by: expected one of {', '.join(CRITERIA)}, got {by!r}")
    if not 1 <= k <= len(methods):
        raise ValueError(f"k: expected 1 <= K <= {len(methods)} (the candidate layers), got {k}")
    scored = score_layers(model, methods, fidelity_blocks=fidelity_blocks, val_blocks=val_blocks,
                          paper_layers=paper_layers, batch_size=batch_size, progress=progress)
    curve = criterion_curve(model, methods, scored, by, val_blocks=val_blocks, batch_size=batch_size,
                            progress=progress)
    return choose_layers(scored, curve, k=k, by=by)


def selection_figure(sel: dict, path) -> bool:
    """Per-layer scores of both criteria, and validation perplexity against the number of converted layers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oal.rundir.files import atomic_save_figure

    layers = sel["candidates"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 3.6), layout="constrained")
    a.bar([i - 0.2 for i in layers], [sel["scores"]["fidelity"][str(i)] for i in layers], 0.4,
          label="RelMSE post-o")
    a.set_xlabel("layer")
    a.set_ylabel("RelMSE after W_o")
    twin = a.twinx()
    twin.bar([i + 0.2 for i in layers], [sel["scores"]["probe"][str(i)] for i in layers], 0.4, color="tab:orange",
             label="swap probe PPL")
    twin.set_ylabel("swap-probe val PPL")
    a.legend(handles=[*a.get_legend_handles_labels()[0], *twin.get_legend_handles_labels()[0]], fontsize=8)
    a.set_title("per-layer criteria (lower is better)", fontsize=9)
    for name, style in (("criterion", "o-"), ("paper", "s--")):
        pts = sel["curves"].get(name) or []
        if pts:
            label = f"{sel['by']} order" if name == "criterion" else "paper range (layer order)"
            b.plot([p["k"] for p in pts], [p["ppl"] for p in pts], style, label=label)
    b.axhline(sel["softmax_val_ppl"], color="grey", lw=0.8, label="softmax")
    b.axvline(sel["k"], color="black", lw=0.6, ls=":")
    b.set_xlabel("converted layers (before adaptation)")
    b.set_ylabel("validation PPL")
    b.legend(fontsize=8)
    atomic_save_figure(fig, path, dpi=120, bbox_inches="tight")
    return True


SELECTION_COLUMNS = ["layer", "RelMSE post-o", "swap-probe PPL", "rank (fidelity)", "rank (probe)", "converted",
                     "paper range"]


def selection_rows(sel: dict) -> list[list[str]]:
    """One row of SELECTION_COLUMNS per candidate layer of a selection record (report and terminal)."""
    return [[str(i), f"{sel['scores']['fidelity'][str(i)]:.4f}", f"{sel['scores']['probe'][str(i)]:.3f}",
             str(sel["order"]["fidelity"].index(i) + 1), str(sel["order"]["probe"].index(i) + 1),
             "yes" if i in sel["chosen"] else "", "yes" if i in sel["paper_layers"] else ""]
            for i in sel["candidates"]]


def selection_section(metrics: dict, fig_dir, table) -> list[str]:
    """report.md's layer-selection section from metrics.json["selection"] (absent for a fixed layer range)."""
    sel = metrics.get("selection")
    if not sel:
        return []
    how = ("frozen-attention RelMSE after W_o on the calibration validation blocks" if sel["by"] == "fidelity"
           else "the one-layer swap probe: validation perplexity with only that layer converted, no training")
    out = ["## Layer selection (`--layers auto:K`, beyond the paper)", "",
           f"Every candidate layer {sel['candidates']} was calibrated; layers are ranked by `{sel['by']}` "
           f"({how}) and the {sel['k']} best are converted: **{sel['chosen']}**. The paper's fixed range is "
           f"{sel['paper_layers']} (K = {sel['paper_k']}). The two criteria agree on "
           f"{sel['agreement']:.0%} of the top {sel['k']}. Selection uses validation data only; the test blocks "
           "are untouched.", ""]
    out += [table(SELECTION_COLUMNS, selection_rows(sel)), ""]
    if selection_figure(sel, fig_dir / "layer_selection.png"):
        out += ["![layer selection](figures/layer_selection.png)", ""]
    comp = sel.get("comparison") or {}
    if comp:
        rows = [[arm, str(r["layers"]), f"{r['ppl_no_adapt']:.3f}", f"{r['ppl']:.3f}"] for arm, r in comp.items()]
        out += [f"At the paper's K = {sel['paper_k']}, after adaptation ({sel['method']}, test perplexity):", "",
                table(["layers", "converted", "PPL no adapt", "PPL (LoRA)"], rows), ""]
    return out


def comparison_sets(sel: dict) -> dict[str, list[int]]:
    """The layer sets compared after adaptation at the paper's K: the criterion's top K and the paper's range."""
    k = sel["paper_k"]
    if not k:
        return {}
    return {f"{sel['by']}_top{k}": sorted(sel["order"][sel["by"]][:k]), "paper_range": list(sel["paper_layers"])}
