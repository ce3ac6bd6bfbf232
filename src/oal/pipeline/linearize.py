"""`oal.linearize`: the main job in one call on a model held in Python, and `oal.add_lora` for the adaptation that
follows it in the user's own training loop (or `transformers.Trainer`).

`linearize` runs the stages of `oal run` that make a converted model, with the pipeline's own functions:
contribution analysis and App. B grouping (`oal.analysis.analyze`), output-matching calibration with per-layer
checkpoints (`oal.calibration.resume.calibrate_directory`), layer selection for `layers="auto:K"`
(`pipeline.selection`), and the swap (`oal.convert`). It does not adapt, evaluate or write a report: `oal run` does
(the protocol, with its guarantees on the run directory); `add_lora` attaches what App. F.2 trains jointly.
"""

from __future__ import annotations

import logging
import math
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:  # annotations only: importing them costs seconds
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from oal.data import Corpus

__all__ = ["add_lora", "linearize"]

log = logging.getLogger("oal")

CALIB_VAL_BLOCKS = 2  # as the default plan's calib_val (the fidelity criterion scores the layers on these)


def _corpus(texts):
    """A `Corpus` from a list of strings (joined by blank lines), a corpus name or local path, or a Corpus."""
    from oal.data import Corpus, load_corpus

    if isinstance(texts, Corpus):
        return texts
    if isinstance(texts, (str, Path)):
        try:
            return load_corpus(texts)
        except (ValueError, OSError) as exc:
            raise ValueError(f"texts: {exc} (a list of strings is taken as your text)") from None
    if not isinstance(texts, Sequence) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("texts: expected a non-empty list of strings, a corpus name or text file/folder "
                         "('builtin', 'notes.txt', as `oal run --data` takes) or an oal.data.Corpus")
    return Corpus("texts", {"train": "\n\n".join(texts), "validation": "", "test": ""})


def _plan(prompts: int, prompt_len: int, block_len: int, calib_blocks: int, val_blocks: int):
    """Disjoint roles at the head of the train split: the grouping prompts, then the calibration train and
    validation blocks, then the swap probe's perplexity blocks (`val_blocks`; 0 when the probe does not run)."""
    from oal.data import BlockSet, SplitPlan

    first = -(-prompts * prompt_len // block_len)  # the first block_len block after the prompts

    def blocks(start: int, count: int) -> BlockSet:
        return BlockSet("train", block_len, list(range(start, start + count)))

    none = BlockSet("train", block_len, [])
    calib_val = first + calib_blocks
    return SplitPlan(grouping=BlockSet("train", prompt_len, list(range(prompts))),
                     calib_train=blocks(first, calib_blocks), calib_val=blocks(calib_val, CALIB_VAL_BLOCKS),
                     fidelity=none, adapt_train=none, val=blocks(calib_val + CALIB_VAL_BLOCKS, val_blocks),
                     test=none, notes="oal.linearize: the head of the text, one role after another")


def calib_config(calib: Mapping | None, seed: int):
    """The CalibConfig of `linearize`'s `calib` ({"preset": name} and CalibConfig fields); ValueError naming calib."""
    from oal.calibration.data import CalibConfig

    if calib is not None and not isinstance(calib, Mapping):
        raise ValueError(f"calib: expected a dict of CalibConfig settings or None (e.g. {{'preset': 'paper'}}, "
                         f"{{'max_steps': 100}}), got {calib!r}")
    settings = dict(calib or {})
    for key, value in settings.items():  # one message for a flag or non-finite value of any key (CalibConfig checks
        # each field's range too)
        if isinstance(value, bool) or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"calib: {key}: expected a finite number, got {value!r}")
    try:
        return CalibConfig.preset(settings.pop("preset", "default"), **{"seed": seed, **settings})
    except (TypeError, ValueError) as exc:  # an unknown field is a TypeError of the dataclass
        raise ValueError(f"calib: {exc}") from None


def _layers(spec, model) -> tuple[list[int], int | None]:
    """(candidate layers, K or None): 'auto:K' makes every layer a candidate; a list or 'A-B' string is fixed."""
    from oal.models.convert import layer_indices
    from oal.models.registry import default_layers
    from oal.pipeline.inputs import parse_layers
    from oal.pipeline.selection import parse_auto

    n_layers = model.config.num_hidden_layers
    if spec is None:
        return list(default_layers(model)), None
    if isinstance(spec, str):
        k = parse_auto(spec)
        if k is not None:
            if k > n_layers:
                raise ValueError(f"layers: expected auto:K with K <= {n_layers} (this model's layers), got {spec!r}")
            return list(range(n_layers)), k
        return parse_layers(spec, n_layers), None
    if not isinstance(spec, Iterable):
        raise ValueError(f"layers: expected a list of layer indices, a range '3-20' or 'auto:K', got {spec!r}")
    layers = sorted(set(layer_indices(spec)))  # numpy ints too; 1.5 is not layer 1
    if layers[0] < 0 or layers[-1] >= n_layers:
        raise ValueError(f"layers: expected layer indices in [0, {n_layers}), got {list(spec)}")
    return layers, None


def _non_finite_weights(model: nn.Module) -> list[str]:
    """The names of `model`'s floating-point parameters and buffers that hold a NaN or inf."""
    import torch

    return [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.is_floating_point() and not bool(torch.isfinite(t).all())]


def linearize(model: nn.Module, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str] | str | Path | Corpus,
              *, layers: str | Sequence[int] | None = None, method: str = "oal", select_by: str = "fidelity",
              grouping: str = "app-b", window: int = 64, sinks: int = 4, block_len: int = 512,
              calib_blocks: int = 8, calib: Mapping | None = None, seed: int = 0,
              out_dir: str | Path | None = None, progress: bool = True) -> nn.Module:
    """Convert `model`'s attention in place, calibrated on `texts`, and return it: the main job in one call.

    Runs the analysis and grouping (App. B), the output-matching calibration (Eq. 20) and, for `layers="auto:K"`,
    the layer selection of `oal run`, then swaps the attention of the chosen layers. The result is a plain
    transformers model of a converted class: `generate`, `save_pretrained` (reloaded by `oal.load(folder)` or by
    `AutoModelForCausalLM` after `import oal`) and peft work on it; `add_lora` prepares its adaptation.

    Args:
        model: a Hugging Face causal LM (Llama, Qwen2, Mistral, Qwen3 families), on the device to compute on.
        tokenizer: its tokenizer.
        texts: the text to calibrate on: a list of strings (joined by blank lines), a corpus name or a local text
            file or folder as `oal run --data` takes them (`"builtin"`, `"notes.txt"`), or an `oal.data.Corpus`.
            Its head is used in order: the grouping prompts (40 x 128 tokens for most models), `calib_blocks`
            blocks to fit on and 2 to validate on, and, with `select_by="probe"`, 2 more for the probe.
        layers: the layers to convert: `None` (the model's default range: the paper's for its backbones, else every
            layer but the first and last), a list of indices, a range `"3-20"`, or `"auto:K"`: every layer is
            calibrated and the K best by `select_by` are converted.
        method: a trainable method of the registry (`oal.methods.method_names()`): `"oal"`, `"oal-swa"` (OAL's
            kernel beyond a sliding window with sinks), `"global"`, the baselines; `"swa"` needs no calibration.
        select_by: the `auto:K` criterion: `"fidelity"` (frozen-attention RelMSE after W_o on the calibration
            validation blocks, free once calibrated; the criterion of the SmolLM2 recipe) or `"probe"` (validation
            perplexity with only that layer converted, `oal run`'s default).
        grouping: `"app-b"` (the paper's), `"app-b-pairs"` (RoPE pairs tied) or `"budget:G"`.
        window: sliding-window length of the window methods; sinks: their attention sinks.
        block_len: tokens per calibration block.
        calib_blocks: calibration training blocks.
        calib: `oal.calibration.data.CalibConfig` settings (`max_steps`, `val_every`, `patience`, `lr`, ...), or the
            name of one of its presets under the key `"preset"` (`{"preset": "paper"}`: App. B's 1000 updates).
        seed: seed of the bootstrap, the sampled positions and the initialisations.
        out_dir: a folder to keep what the stages write (groups.json, analysis.json, the kernels, calibration.json,
            selection.json; a killed call resumes its calibration there); `oal.load(out_dir, base_model)` converts
            the same base model again (whichever the method). Default: a temporary folder, removed at the end.
        progress: show progress bars (stderr).

    Returns:
        `model`, converted in place.

    Raises:
        ValueError: bad input, naming the argument (too little text, an unknown method, a layer out of range or
            not an integer, a model of an unsupported family or compiled by `torch.compile`, weights holding NaN or
            inf, a tokenizer giving ids the model does not embed), before any work where it can be seen up front.
    """
    from oal.errors import check_int
    from oal.methods import get_method, method_names

    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise ValueError(f"model: expected a Hugging Face causal LM (a loaded model), got {type(model).__name__}")
    if hasattr(model, "_orig_mod"):  # it forwards `config` and layers, and failed at the swap, after the calibration
        raise ValueError("model: a torch.compile'd model; linearize the model itself (its `_orig_mod`), then compile "
                         "the converted model it returns")
    if any(p.is_meta for p in model.parameters()):  # device_map offload or a model built on the meta device
        raise ValueError("model: some of its weights are on the meta device (not loaded, or offloaded by device_map); "
                         "load it whole onto the device to compute on")
    bad = _non_finite_weights(model)
    if bad:  # it failed after the analysis's capture as "q, k: non-finite values", naming no layer
        raise ValueError(f"model: NaN or inf in {', '.join(bad[:3])}{' and more' if len(bad) > 3 else ''}; "
                         "calibration fits the model's own attention, which these weights make non-finite")
    from oal.models.attention import converted_methods
    from oal.models.encoder import is_encoder

    if is_encoder(model):  # its blocks would be cut from a token stream, past its position embeddings
        raise ValueError(f"model: {type(model).__name__} is an encoder; linearize calibrates causal LMs on token "
                         "blocks. Convert an encoder with `oal run --model PATH` (the passage protocol), then "
                         "oal.load(run_dir, PATH)")
    converted = sorted(converted_methods(model))
    if converted:  # its captures would be of converted layers' inputs, not of the base model's
        raise ValueError(f"model: layers {converted} are already converted; linearize the base model (its "
                         "calibration matches softmax attention on the base model's own activations)")
    if not callable(tokenizer):
        raise ValueError(f"tokenizer: expected the model's tokenizer (AutoTokenizer.from_pretrained), got "
                         f"{type(tokenizer).__name__}")
    if not isinstance(progress, bool):
        raise ValueError(f"progress: expected True or False, got {progress!r}")
    if method not in method_names() or method == "softmax":
        raise ValueError(f"method: expected one of {[m for m in method_names() if m != 'softmax']}, got {method!r}")
    if select_by not in ("fidelity", "probe"):
        raise ValueError(f"select_by: expected 'fidelity' or 'probe', got {select_by!r}")
    for name, value, low in (("block_len", block_len, 1), ("calib_blocks", calib_blocks, 1), ("seed", seed, 0),
                             ("window", window, 1), ("sinks", sinks, 0)):  # before any work: a bad one failed late
        check_int(name, value, low)
    cfg = calib_config(calib, seed)
    if get_method(method).positional and window + sinks >= block_len:
        raise ValueError(f"window: {window} + {sinks} sinks cover every {block_len}-token calibration block, so "
                         f"{method} would be plain softmax there; choose window + sinks below block_len")
    candidates, k = _layers(layers, model)
    settings = dict(method=method, select_by=select_by, grouping=grouping, window=window, sinks=sinks,
                    block_len=block_len, calib_blocks=calib_blocks, cfg=cfg, seed=seed, progress=progress)
    if out_dir is not None:  # one writer at a time: a second one would delete this one's capture files
        from oal.rundir.files import check_out_dir
        from oal.rundir.lock import own_dir

        with own_dir(check_out_dir(out_dir, "out_dir")):
            return _linearize(model, tokenizer, texts, Path(out_dir), candidates, k, **settings)
    with tempfile.TemporaryDirectory(prefix="oal-linearize-") as tmp:
        return _linearize(model, tokenizer, texts, Path(tmp), candidates, k, **settings)


def _linearize(model, tokenizer, texts, out: Path, candidates: list[int], k: int | None, *, method, select_by,
               grouping, window, sinks, block_len, calib_blocks, cfg, seed, progress):
    from rich.console import Console

    from oal.analysis import analyze, load_groups, parse_grouping
    from oal.calibration.kernels import kernel_dir, load_kernels, model_fingerprint, save_kernels
    from oal.calibration.resume import calibrate_directory
    from oal.data import plan_blocks
    from oal.launch import log_console
    from oal.methods import get_method
    from oal.models.convert import convert
    from oal.models.provenance import weights_record
    from oal.models.registry import PRESETS, preset_for
    from oal.pipeline.config import grouping_preset
    from oal.pipeline.selection import layer_scores, rank_layers
    from oal.rundir.claim import refuse_run_dir
    from oal.rundir.files import atomic_write_json, check_out_dir

    check_out_dir(out)
    refuse_run_dir(out, "conversion")
    console = log_console() if progress else Console(quiet=True)
    preset = preset_for(model)
    spec = PRESETS[preset]
    val_blocks = CALIB_VAL_BLOCKS if k is not None and select_by == "probe" else 0
    plan = _plan(spec["n_prompts"], spec["prompt_len"], block_len, calib_blocks, val_blocks)
    corpus = _corpus(texts)
    try:
        blocks = plan_blocks(corpus, tokenizer, plan)
    except ValueError as exc:
        raise ValueError(f"texts: too little text for the grouping prompts and calibration blocks ({exc})") from None
    vocab = model.get_input_embeddings().weight.shape[0]
    top = max(int(b.max()) for b in blocks.values() if b.numel())
    if top >= vocab:  # it failed in the analysis with torch's IndexError from the embedding
        raise ValueError(f"tokenizer: it gives token id {top}, and the model embeds {vocab} ids; pass the model's own "
                         "tokenizer")
    model.eval()
    name = str(getattr(model.config, "_name_or_path", "") or type(model).__name__)
    provenance = weights_record(model)  # binds the kernels to these tensors (`oal.load(out_dir, model)` checks)
    groups = {}
    if get_method(method).uses_groups:
        kw = {**grouping_preset(preset), **parse_grouping(grouping)}
        analyze(model, tokenizer, blocks["grouping"], candidates, out, figures=False, console=console,
                results=Console(quiet=True), seed=seed, meta={"model": name, "data": corpus.name}, **kw)
        groups = load_groups(out)
    root = out / "candidates" if k is not None else out
    calibrate_directory(root, model, blocks, candidates, [method], groups=groups, cfg=cfg, seed=seed,
                        base_model=name, provenance=provenance, extra={"seed": seed, "linearize": True},
                        progress=progress, console=console, options={"window": window, "sinks": sinks})
    methods, _ = load_kernels(kernel_dir(root, method))
    chosen = candidates
    if k is not None:
        scores = layer_scores(model, methods, select_by, fidelity_blocks=blocks["calib_val"],
                              val_blocks=blocks["val"], progress=progress)
        order = rank_layers(scores)
        chosen = sorted(order[:k])
        save_kernels({i: methods[i] for i in chosen}, kernel_dir(out, method), base_model=name,
                     provenance=provenance, fingerprint=model_fingerprint(model),
                     extra={"method": method, "seed": seed, "selected_from": candidates})
        atomic_write_json(out / "selection.json", {"k": k, "by": select_by, "candidates": candidates,
                                                   "chosen": chosen, "order": order,
                                                   "scores": {str(i): s for i, s in scores.items()},
                                                   "split_plan": plan.to_dict(), "calib": asdict(cfg)})
    log.info("oal.linearize: %s on layers %s", method, chosen)
    return convert(model, chosen, {i: methods[i] for i in chosen})


def add_lora(model: nn.Module, *, r: int = 8, alpha: float = 16, dropout: float = 0.05,
             target_modules: Sequence[str] | str = ("q_proj", "k_proj", "v_proj", "o_proj"),
             train_kernel: bool = True, seed: int = 42) -> PeftModel:
    """Attach LoRA (peft) to a converted model and mark its kernel parameters trainable: App. F.2's joint adaptation
    in any training loop.

    The returned peft model trains the LoRA matrices on `target_modules` of every layer (softmax layers included)
    and, with `train_kernel`, the converted layers' kernel coefficients (OAL's factors; groups stay fixed) from their
    calibrated values; the backbone stays frozen. Train it with your own loop or `transformers.Trainer`, then
    `merge_and_unload()` gives the converted model with LoRA merged and the trained kernels, which
    `save_pretrained` writes in the converted form. The peft model's own `save_pretrained` (each Trainer
    checkpoint) writes the kernel coefficients beside the LoRA matrices (`oal_kernels.safetensors`), and its
    `load_adapter` (the Trainer's resume and `load_best_model_at_end`) reads them back; peft's
    `PeftModel.from_pretrained` reads the LoRA matrices only: on a model from `add_lora`, use `load_adapter`.
    The defaults are App. F.2's (rank 8, alpha 16, dropout 0.05, q/k/v/o); `oal run` and `oal adapt` train the
    same way with AdamW, warmup and cosine decay.

    Args:
        model: a converted model (`oal.linearize`, `oal.convert`, `oal.load`).
        r: LoRA rank, an integer >= 1; alpha: its scaling (> 0; the update is scaled by alpha / r);
            dropout: LoRA dropout, in [0, 1).
        target_modules: the names of the projections that get LoRA (one name as a string: `"q_proj"`).
        train_kernel: train the kernel coefficients jointly (False: LoRA alone).
        seed: seed of the LoRA initialisation, an integer >= 0.

    Returns:
        a `peft.PeftModel` whose trainable parameters are the LoRA matrices and the kernel coefficients.

    Raises:
        ValueError: bad input, naming the argument (a model with no converted layers or already a peft model, a
            module name the model does not have).
    """
    from peft import PeftModel

    from oal.adaptation.config import AdaptConfig
    from oal.adaptation.peft_kernels import with_kernels_in_saves
    from oal.adaptation.train import wrap_lora
    from oal.errors import check_int
    from oal.models.attention import converted_methods

    if isinstance(model, PeftModel):  # add_lora's own result, or any peft model
        raise ValueError("model: it is already a peft model (oal.add_lora's result?); train it as it is, or "
                         "merge_and_unload() it first and call add_lora on the converted model that gives")
    if not converted_methods(model):
        raise ValueError("model: no converted layers; convert it first (oal.linearize, oal.convert or oal.load)")
    check_int("r", r, 1)
    check_int("seed", seed, 0)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha < float("inf"):
        raise ValueError(f"alpha: expected a finite number > 0, got {alpha!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise ValueError(f"dropout: expected a number in [0, 1), got {dropout!r}")
    if not isinstance(train_kernel, bool):
        raise ValueError(f"train_kernel: expected True or False, got {train_kernel!r}")
    targets = (target_modules,) if isinstance(target_modules, str) else tuple(target_modules)
    names = [name for name, _ in model.named_modules()]
    unknown = [t for t in targets if not isinstance(t, str) or not any(n == t or n.endswith("." + t) for n in names)]
    if not targets or unknown:  # peft's own error came from deep inside get_peft_model
        raise ValueError(f"target_modules: expected names of the model's modules (such as q_proj, o_proj), got "
                         f"{list(targets)}" + (f": {unknown} match none" if unknown else ""))
    if getattr(model, "_hf_peft_config_loaded", False):  # peft would add a fresh adapter and drop that one
        raise ValueError("model: it already carries a LoRA adapter (an unmerged export); a second one would leave "
                         "it out of training and out of the merge: load the export made with merging (`oal export`'s "
                         "default) to adapt further")
    cfg = AdaptConfig(lora_r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                      train_kernel=train_kernel, seed=seed)
    import torch

    cuda = sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)
    with torch.random.fork_rng(devices=cuda):  # `seed` seeds the LoRA initialisation, not the caller's own draws
        return with_kernels_in_saves(wrap_lora(model, cfg)[0])
