"""The model card of a converted-model folder: README.md with Hugging Face front matter (library, base model, tags),
the conversion, the run's metrics for this model, and how to load it (`pip install oal`, then `import oal`).

The card describes the model; it does not define it, so oal.json does not hash it (`models.pretrained.UNHASHED`):
editing or replacing it never makes the folder unloadable.
"""

from __future__ import annotations

import re
from pathlib import Path

from oal.rundir.files import atomic_write_text

__all__ = ["card_metrics", "card_text", "write_card"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def _hub_id(name) -> str | None:
    """`name` when it is a hub repository id (the front matter's base_model), not a local path."""
    if isinstance(name, str) and _REPO_ID.match(name) and not Path(name).exists():
        return name
    return None


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
    if adapted:
        for m in ("softmax", method):
            for task, res in sorted((metrics.get("zeroshot", {}).get(m) or {}).items()):
                if isinstance(res, dict):
                    out[f"zero-shot {task}, {m} (%)"] = _row({k: res[k] for k in ("acc", "acc_norm", "n") if k in res})
    return out


def _row(values: dict) -> str:
    return ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())


def card_text(model, source: dict | None, metrics: dict[str, str] | None = None) -> str:
    """README.md of a converted model folder."""
    from huggingface_hub import ModelCard, ModelCardData

    from oal.models.attention import converted_methods
    from oal.models.encoder import is_encoder

    source = source or {}
    base = source.get("base_model") or {}
    name = base.get("name_or_path") or getattr(model.config, "_name_or_path", None) or "unknown"
    methods = converted_methods(model)
    kinds = sorted({m.name for m in methods.values()})
    encoder = is_encoder(model)
    data = ModelCardData(library_name="oal", base_model=_hub_id(name),
                         pipeline_tag="feature-extraction" if encoder else "text-generation",
                         tags=["oal", "linear-attention", *kinds, model.config.model_type])
    auto = "AutoModel" if encoder else "AutoModelForCausalLM"
    adapter = source.get("adapter")
    lines = [
        f"# {', '.join(kinds)} conversion of {name}", "",
        f"Attention layers {sorted(methods)} of `{name}` (state dict SHA256 "
        f"`{str(base.get('state_dict_sha256', '?'))[:16]}`) run {', '.join(kinds)} attention instead of softmax "
        "(Outlier-Aware Attention Linearization, `oal`); the other layers are unchanged. "
        + ("No LoRA adapter." if not adapter else
           f"With the run's LoRA adapter ({'merged into the weights' if adapter.get('merged') else 'kept unmerged'})"
           " and trained kernels."),
        "", "## Use", "", "```bash", "pip install oal", "```", "", "```python",
        "import oal  # registers the converted model types with transformers; without it loading fails",
        f"from transformers import {auto}, AutoTokenizer", "",
        f'model = {auto}.from_pretrained("<this folder>")  # or oal.load("<this folder>")',
        'tokenizer = AutoTokenizer.from_pretrained("<this folder>")', "```", "",
        "The family's own class and peft's loaders refuse this folder rather than give a softmax model; every load "
        "checks the SHA256 of the files listed in `oal.json`. lm-eval: `python -m oal.lm_eval --model hf "
        '--model_args pretrained=<this folder> --tasks ...`.', "",
    ]
    if metrics:
        lines += ["## Metrics (from the run that made it)", "", "| metric | values |", "| --- | --- |"]
        lines += [f"| {key} | {values} |" for key, values in metrics.items()] + [""]
    if source.get("run_dir"):
        lines += ["## Provenance", "", f"Exported from the run directory `{source['run_dir']}` (method "
                  f"`{source.get('method')}`); `oal.json` records the SHA256 of its kernels and adapter files.", ""]
    return str(ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines)))


def write_card(directory: str | Path, model, source: dict | None, metrics: dict[str, str] | None = None) -> Path:
    """DIR/README.md (atomically)."""
    return atomic_write_text(Path(directory) / "README.md", card_text(model, source, metrics))
