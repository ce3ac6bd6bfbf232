"""The model card of a converted-model folder: README.md with Hugging Face front matter (library, base model, licence,
datasets, tags), the conversion and the paper, the run's verified metrics for this model and the data behind them,
its limitations, and how to load it (`pip install oal-attention`, then `import oal`); no path of the machine.

The card describes the model; it does not define it, so oal.json does not hash it (`models.pretrained.UNHASHED`):
editing or replacing it never makes the folder unloadable.
"""

from __future__ import annotations

from pathlib import Path

import torch

from oal.artefact.base_facts import DISTRIBUTION, PAPER, base_model_facts
from oal.rundir.files import atomic_write_text

__all__ = ["card_metrics", "card_text", "reference_card_text", "write_card"]

def card_metrics(metrics: dict, method: str, adapted: bool) -> dict[str, str]:
    """The run's numbers for `method` as exported (`adapted`: with its adapter) beside the softmax reference's, out
    of its metrics.json: {metric: "arm value, ..."}. Zero-shot scores are of the adapted arms (`oal run`)."""
    ppl, fid = ("perplexity", "fidelity_adapted") if adapted else ("perplexity_no_adapt", "fidelity")
    out: dict[str, str] = {}
    row = {m: metrics.get(ppl, {}).get(m) for m in ("softmax", method)}
    if row[method] is not None:
        out["perplexity (test blocks)"] = _row({m: v for m, v in row.items() if v is not None})
    got = metrics.get(fid, {}).get(method)
    if isinstance(got, dict):
        out["attention fidelity (relative MSE)"] = _row({k: got[k] for k in ("relmse", "relmse_post_o") if k in got})
    elif adapted and isinstance(got := metrics.get("fidelity", {}).get(method), dict):  # `oal run` measures these
        out["attention fidelity of the calibrated kernels, before adaptation (relative MSE)"] = _row(
            {k: got[k] for k in ("relmse", "relmse_post_o") if k in got})
    for m in ("softmax", method):  # the arm as exported: with its adapter or without
        got = (metrics.get("passkey", {}).get(m) or {}).get("adapted" if adapted else "no_adapt")
        if isinstance(got, dict) and got.get("by_length"):
            out[PASSKEY_ROW.format(m)] = ", ".join(
                [f"{n} tokens {v:.2f}" for n, v in sorted(got["by_length"].items(), key=lambda kv: int(kv[0]))]
                + ([f"mean {got['mean']:.2f}"] if isinstance(got.get("mean"), (int, float)) else []))
    if adapted:
        for m in ("softmax", method):
            for task, res in sorted((metrics.get("zeroshot", {}).get(m) or {}).items()):
                if isinstance(res, dict):  # two acc_norms: lm-eval's (per character) is what a reader reruns
                    out[f"zero-shot {task}, {m} (%)"] = _row({label: res[k] for k, label in _ZEROSHOT if k in res})
    return out


PASSKEY_ROW = "passkey retrieval, {} (accuracy by context length)"

_ZEROSHOT = (("acc", "acc"), ("acc_norm", "acc_norm (paper)"),
             ("acc_norm_lmeval", "acc_norm (lm-eval, per character)"), ("n", "n"))


def _row(values: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


LIMITATIONS = [
    "- **CPU and GPU paths.** On CPU the chunked path runs (exact to 1e-10 in float64 against the reference); on "
    "CUDA the Triton kernels run when Triton is installed, else the chunked path with a warning. Non-causal calls, "
    "float64 on CUDA and head dims above 128 take the torch paths.",
]


# Quoted only where the run did not measure passkey retrieval: the embedded default model's numbers
RETRIEVAL_UNMEASURED = (
    "- **Long-context retrieval is lost on the converted layers.** On oal's embedded default model, converting "
    "layers 1-4 keeps test perplexity within 14 PPL of softmax but drops passkey retrieval at 512 tokens from 1.00 "
    "to 0.00, before and after adaptation; measure it on this model with `oal evaluate --passkey` before relying "
    "on recall.")


def _retrieval_line(methods: dict, metrics: dict[str, str] | None) -> str:
    """The card's retrieval caution: the run's own passkey rows where it measured them (`card_metrics`), else the
    embedded default model's loss; a sliding window keeps exact softmax on its last keys, so only keys older than
    it are at stake there."""
    measured = {k: v for k, v in (metrics or {}).items() if k.startswith(PASSKEY_ROW.split("{", 1)[0])}
    windows = sorted({(m.name, m.window, m.sinks) for m in methods.values() if hasattr(m, "window")})
    window = ""
    if windows:
        older = ("dropped (swa)" if all(n == "swa" for n, _, _ in windows) else
                 "weighted by the converted kernel" + ("; swa drops them" if any(n == "swa" for n, _, _ in windows)
                                                         else ""))
        window = (" Within the sliding window (" + ", ".join(f"{n}: the last {w} keys and the first {s}, its sinks"
                                                             for n, w, s in windows)
                  + f") the converted layers attend with exact softmax weights, so a key there is retrieved as "
                  f"softmax retrieves it; older keys are {older}, so recall over longer distances rests on that.")
    if measured:
        rows = "; ".join(f"{k.split(', ', 1)[1].split(' (', 1)[0]}: {v}" for k, v in measured.items())
        return ("- **Long-context retrieval, as this run measured it** (passkey, greedy, exact match; the metrics "
                f"above): {rows}. The softmax row is what the base model itself does." + window
                + " Other lengths were not measured: `oal evaluate --passkey --lengths ...` before relying on "
                "recall there.")
    if windows:
        return ("- **Long-context retrieval was not measured in this run.**" + window
                + " Measure it on this model with `oal evaluate --passkey` before relying on recall beyond the "
                "window.")
    return RETRIEVAL_UNMEASURED


POSITIONS_SPLIT = (
    "- **Outputs depend on absolute positions.** The kernel's groups hold one dimension of some RoPE rotation pair "
    "(r, r + d/2) without the other, so a group's score depends on the absolute positions of query and key, not "
    "only on their distance. Pass the same `position_ids` you would for a single prompt (left-padded batches: "
    "`(attention_mask.cumsum(-1) - 1).clamp_min(0)`, as `generate` does); `model(**batch)` on a left-padded batch "
    "without `position_ids` differs from the single prompts. (`oal run --grouping app-b-pairs` keeps each pair "
    "in one group.)")
POSITIONS_TIED = (
    "- **Positions.** Every group holds whole RoPE rotation pairs (r, r + d/2), so the converted layers depend on "
    "the distance between query and key only, as softmax does; left-padded batches still want the `position_ids` "
    "of the single prompts, as for any RoPE model whose padding is counted.")


POSITIONS_FEATURES = (
    "- **Outputs depend on absolute positions.** A feature map of q and k separately sees RoPE's absolute "
    "rotations, not only the distance between query and key. Pass the same `position_ids` you would for a single "
    "prompt (left-padded batches: `(attention_mask.cumsum(-1) - 1).clamp_min(0)`, as `generate` does).")
FEATURE_MAPS = ("performer", "spectraformer", "dijiang")


def _positions_line(model) -> str:
    from oal.models.attention import converted_methods

    if any(m.name in FEATURE_MAPS for m in converted_methods(model).values()):
        return POSITIONS_FEATURES
    return POSITIONS_TIED if _pairs_tied(model) else POSITIONS_SPLIT


def _pairs_tied(model) -> bool:
    """Every grouped converted layer keeps each RoPE pair (r, r + d/2) in one group."""
    from oal.models.attention import converted_methods

    grouped = [m.groups for m in converted_methods(model).values() if isinstance(getattr(m, "groups", None),
                                                                                 torch.Tensor)]
    half = [g.shape[-1] // 2 for g in grouped]
    return all(torch.equal(g[..., :h], g[..., h:2 * h]) for g, h in zip(grouped, half, strict=True))


def card_text(model, source: dict | None, metrics: dict[str, str] | None = None) -> str:
    """README.md of a converted model folder. `source` may hold "base" (`base_facts.base_model_facts`: id,
    licence), "datasets" and "data_lines" (`base_facts.data_facts`), "run" (the run folder's name) and "method"."""
    from huggingface_hub import ModelCard, ModelCardData

    from oal.adaptation.adapter import KERNEL_FILE
    from oal.models.attention import converted_methods
    from oal.models.encoder import is_encoder
    from oal.models.provenance import model_dtype

    source = source or {}
    record = source.get("base_model") or {}
    facts = source.get("base") or base_model_facts(None, None)
    name = facts["id"]
    methods = converted_methods(model)
    kinds = sorted({m.name for m in methods.values()})
    encoder = is_encoder(model)
    data = ModelCardData(library_name="oal", base_model=name, license=facts["license"],
                         datasets=source.get("datasets") or None,
                         pipeline_tag="feature-extraction" if encoder else "text-generation",
                         tags=["oal", "linear-attention", *kinds, model.config.model_type])
    auto = "AutoModel" if encoder else "AutoModelForCausalLM"
    adapter = source.get("adapter")
    lines = [
        f"# {', '.join(kinds)} conversion of {name}", "",
        f"Attention layers {sorted(methods)} of `{name}` (state dict SHA256 "
        f"`{str(record.get('state_dict_sha256', '?'))[:16]}`) run {', '.join(kinds)} attention instead of softmax "
        f"(Outlier-Aware Attention Linearization, [paper]({PAPER}), library `oal`); the other layers are "
        "unchanged. "
        + ("No LoRA adapter." if not adapter else
           f"With the run's LoRA adapter ({'merged into the weights' if adapter.get('merged') else 'kept unmerged'})"
           + (" and trained kernels." if KERNEL_FILE in (adapter.get("sha256") or {}) else ".")),
        "", f"Licence: `{facts['license']}` ({facts['license_note']}).", "",
        "## Use", "", "```bash", f"pip install {DISTRIBUTION}", "```", "", "```python",
        "import oal  # registers the converted model types with transformers; without it loading fails",
        f"from transformers import {auto}, AutoTokenizer", "",
        f'model = {auto}.from_pretrained("<this folder>")  # or oal.load("<this folder>")',
        'tokenizer = AutoTokenizer.from_pretrained("<this folder>")', "```", "",
        "The family's own class and peft's loaders refuse this folder rather than give a softmax model; every load "
        "from a local folder checks the SHA256 of the files listed in `oal.json` (loaded by its hub id, through "
        "transformers' download cache, it is not checked: load the folder `huggingface_hub.snapshot_download(ID)` "
        "returns to have it checked). "
        "lm-eval: `python -m oal.lm_eval --model hf "
        '--model_args pretrained=<this folder> --tasks ...`.', "",
    ]
    lines += _metrics_lines(metrics, model_dtype(model), record.get("dtype")) + _data_lines(source)
    limits = [_retrieval_line(methods, metrics), _positions_line(model), *LIMITATIONS]
    lines += ["## Limitations", "", *limits, ""]
    lines += _provenance_lines(source, "its kernels and adapter files")
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


def _metrics_lines(metrics: dict[str, str] | None, weights: str | None = None, measured: str | None = None
                   ) -> list[str]:
    """`weights`: the dtype of the folder's weights; `measured`: the run's, which its numbers were measured in."""
    if not metrics:
        return ["## Metrics", "", "None quoted: the export was given no verified numbers of the run.", ""]
    other = (f" The weights in `{weights}` here differ from the run's: these numbers were measured in `{measured}`, "
             "before the cast." if weights and measured and weights != measured else "")
    return ["## Metrics (from the run that made it)", "",
            "Rebuilt from the run's verified records (the files they were computed from still have the SHA256 "
            "recorded with them); a number edited into the run's metrics.json is never quoted." + other, "",
            "| metric | values |", "| --- | --- |", *(f"| {key} | {values} |" for key, values in metrics.items()), ""]


def _data_lines(source: dict) -> list[str]:
    return ["## Data", "", *source["data_lines"], ""] if source.get("data_lines") else []


def _provenance_lines(source: dict, recorded: str) -> list[str]:
    if not source.get("run"):
        return []
    return ["## Provenance", "", f"Exported from the run directory `{source['run']}` (method `{source.get('method')}`)"
            f"; `oal.json` records the SHA256 of {recorded}.", ""]


def reference_card_text(source: dict, metrics: dict[str, str] | None = None, weights: str | None = None,
                        encoder: bool = False) -> str:
    """README.md of a run's exported softmax arm (`artefact.softmax_export`): the base model with the run's LoRA
    adapter for softmax merged, loaded by transformers alone. `source` as for `card_text`; `weights`: the dtype
    of the written weights."""
    from huggingface_hub import ModelCard, ModelCardData

    facts = source.get("base") or base_model_facts(None, None)
    name = facts["id"]
    adapter = source.get("adapter")
    auto = "AutoModel" if encoder else "AutoModelForCausalLM"
    data = ModelCardData(library_name="transformers", base_model=name, license=facts["license"],
                         datasets=source.get("datasets") or None,
                         pipeline_tag="feature-extraction" if encoder else "text-generation",
                         tags=["oal", "softmax-reference"])
    lines = [f"# Softmax reference of {name}", "",
             f"`{name}` with softmax attention in every layer, the reference arm of an oal run (library `oal`, "
             f"[paper]({PAPER})): "
             + ("adapted with the run's LoRA adapter for softmax (merged into the weights), the same budget as the "
                "converted arms, so that it is what they are compared against." if adapter else
                "without an adapter (the run adapted none for softmax)."),
             "", f"Licence: `{facts['license']}` ({facts['license_note']}).", "",
             "## Use", "", "```python", f"from transformers import {auto}, AutoTokenizer", "",
             f'model = {auto}.from_pretrained("<this folder>")  # no oal needed',
             'tokenizer = AutoTokenizer.from_pretrained("<this folder>")', "```", "",
             "`oal.json` records the SHA256 of every file that defines the model and of the run files it came "
             "from; `oal.models.pretrained.verify_manifest(folder)` checks them.", ""]
    measured = (source.get("base_model") or {}).get("dtype")
    lines += _metrics_lines(metrics, weights, measured) + _data_lines(source) + _provenance_lines(
        source, "its adapter files")
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


def write_card(directory: str | Path, model, source: dict | None, metrics: dict[str, str] | None = None) -> Path:
    """DIR/README.md (atomically)."""
    return atomic_write_text(Path(directory) / "README.md", card_text(model, source, metrics))
