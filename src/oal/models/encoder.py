"""BERT-family encoders: which models count, where their attention lives, and the non-causal converted path.

Supported: BERT, RoBERTa, XLM-RoBERTa, CamemBERT and ELECTRA (base models and their heads, e.g. sentence-embedding
checkpoints loaded with `AutoModel`) configured as encoders (`is_decoder=False`). transformers 5 runs their self
attention as `encoder.layer[i].attention.self` (query/key/value projections, `is_causal=False`) through
`AttentionInterface`, with the padding mask built by `create_bidirectional_mask`; the output projection is
`encoder.layer[i].attention.output.dense`, followed by dropout and a residual LayerNorm. No RoPE, no GQA
(Hkv = Hq), no KV cache.

`models.capture` and `models.convert` call the helpers here when they meet an encoder, so capture, conversion,
`oal.load` and `oal.save_kernels` work on encoders through the same functions as on decoders.

Padding in converted layers (`noncausal_attention`): the linear-time methods take no per-key mask, and in the
non-causal path a padded key would enter the state and the normaliser of every query. So rows are grouped by
their padding pattern and each group runs on its real tokens only; padded query positions get a zero output
(softmax would give them an average over the real keys; masked pooling never reads them). Any padding pattern
works (right, left or inner), and padding never changes the output at real positions.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from oal.models.families import ENCODER_ARCHITECTURES

__all__ = ["ENCODER_ARCHITECTURES", "POOLING_MODES", "attention_module", "encoder_layers", "is_encoder",
           "is_encoder_model", "load_encoder", "max_tokens", "noncausal_attention", "output_projection",
           "sentence_pooling"]


def _config(model_or_config):
    return getattr(model_or_config, "config", model_or_config)


def is_encoder(model_or_config) -> bool:
    """True for a supported BERT-family model (or config) used as an encoder (not `is_decoder`)."""
    cfg = _config(model_or_config)
    family = getattr(cfg, "oal_family", None) or getattr(cfg, "model_type", None)  # "oal_bert": a converted BERT
    return family in ENCODER_ARCHITECTURES and not getattr(cfg, "is_decoder", False)


def is_encoder_model(name_or_path) -> bool:
    """True when `name_or_path` is a local model folder whose config.json describes a supported encoder."""
    cfg = Path(str(name_or_path)) / "config.json"
    if not cfg.is_file():
        return False
    try:
        data = json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return data.get("model_type") in ENCODER_ARCHITECTURES and not data.get("is_decoder", False)


def encoder_layers(model: nn.Module) -> nn.ModuleList:
    """`encoder.layer` of the base model (BertModel itself, or `model.bert` / `model.roberta` of a head model)."""
    if not is_encoder(model):
        supported = ", ".join(f"{v} ({k})" for k, v in ENCODER_ARCHITECTURES.items())
        raise ValueError(f"model: {type(model).__name__} is not a supported encoder; supported: {supported}")
    layers = getattr(getattr(getattr(model, "base_model", model), "encoder", None), "layer", None)
    if layers is None:
        raise ValueError(f"model: {type(model).__name__} has no `encoder.layer` list")
    return layers


def _layer(model: nn.Module, layer: int) -> nn.Module:
    layers = encoder_layers(model)
    if not isinstance(layer, int) or not 0 <= layer < len(layers):
        raise ValueError(f"layer: expected an int in [0, {len(layers)}), got {layer!r}")
    return layers[layer]


def attention_module(model: nn.Module, layer: int) -> nn.Module:
    """The self-attention module (`attention.self`, with query/key/value projections) of encoder layer `layer`."""
    attn = getattr(getattr(_layer(model, layer), "attention", None), "self", None)
    if attn is None or not all(hasattr(attn, p) for p in ("query", "key", "value")):
        raise ValueError(f"model: encoder layer {layer} has no attention.self with query/key/value projections")
    return attn


def output_projection(model: nn.Module, layer: int) -> nn.Linear:
    """The output projection W_o of encoder layer `layer` (`attention.output.dense`)."""
    return _layer(model, layer).attention.output.dense


def max_tokens(model: nn.Module) -> int | None:
    """The longest input (special tokens included) the encoder's position embeddings take, or None when its config
    sets no `max_position_embeddings`: RoBERTa, XLM-R and CamemBERT number positions from `padding_idx + 1`, so
    theirs is `max_position_embeddings - padding_idx - 1` (512 of 514)."""
    n = getattr(_config(model), "max_position_embeddings", None)
    if n is None:
        return None
    pad = getattr(getattr(getattr(model, "base_model", model), "embeddings", None), "padding_idx", None)
    return n - pad - 1 if isinstance(pad, int) else n


def noncausal_attention(method, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        valid: torch.Tensor | None = None) -> torch.Tensor:
    """Non-causal output [B, Hq, N, dv] of `method`, every real key visible to every query.

    `valid` [B, N] (True = real token) marks padding; padded keys enter neither the state nor the normaliser, and
    padded query positions get zero. Rows with the same padding pattern run as one batch on their real tokens.
    """
    if valid is None or bool(valid.all()):
        return method(q, k, v, causal=False)
    if valid.shape != (q.shape[0], q.shape[2]):
        raise ValueError(f"valid: expected shape {(q.shape[0], q.shape[2])}, got {tuple(valid.shape)}")
    patterns, which = torch.unique(valid.bool(), dim=0, return_inverse=True)
    rows: list[torch.Tensor | None] = [None] * q.shape[0]
    for p, pattern in enumerate(patterns):
        idx = pattern.nonzero().flatten()
        if idx.numel() == 0:
            raise ValueError("attention_mask: a row of the batch is entirely padding")
        members = (which == p).nonzero().flatten()
        sub = method(q[members][:, :, idx], k[members][:, :, idx], v[members][:, :, idx], causal=False)
        full = sub.new_zeros(*sub.shape[:2], q.shape[2], sub.shape[-1])
        full[:, :, idx] = sub
        for j, b in enumerate(members.tolist()):
            rows[b] = full[j]
    return torch.stack(rows)


def load_encoder(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """(model, tokenizer, provenance) of a local encoder folder, loaded with `AutoModel` (the base encoder: heads
    are dropped; sentence-embedding checkpoints keep their transformer weights at the folder's root). Weights load
    from safetensors only; provenance records the SHA256 of the files and of the tensors (`weights_record`)."""
    from transformers import AutoModel, AutoTokenizer

    from oal.models.folders import bad_model, check_model_folder, first_line
    from oal.models.provenance import hash_model_dir, weights_record

    path = Path(path).expanduser()
    if not path.is_dir():
        raise bad_model(f"no such encoder folder: {path}")
    check_model_folder(path, ENCODER_ARCHITECTURES)
    if not is_encoder_model(path):
        raise bad_model(f"{path}: config.json sets is_decoder=true; expected an encoder")
    from safetensors import SafetensorError

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        model = AutoModel.from_pretrained(path, dtype=dtype, local_files_only=True, use_safetensors=True)
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:  # SafetensorError: a truncated file
        raise bad_model(f"{path}: cannot load the encoder or its tokenizer ({first_line(exc)})") from exc
    model = model.to(device).eval()
    provenance = {"model": str(path), "source": "local", "path": str(path.resolve()), "revision": None,
                  "architecture": type(model).__name__, "sha256": hash_model_dir(path), **weights_record(model),
                  "pooling": sentence_pooling(path)}
    return model, tokenizer, provenance


def sentence_pooling(path: str | Path) -> str | None:
    """The pooling a sentence-transformers folder declares (its Pooling module's config.json, where modules.json
    puts it, else `1_Pooling/`): one of `POOLING_MODES`, several joined by "+" in the order
    sentence-transformers concatenates them, or None (no Pooling module, no mode set)."""
    path = Path(path)
    where = "1_Pooling"
    modules = _json_file(path / "modules.json")
    if isinstance(modules, list):
        where = next((m.get("path") for m in modules if isinstance(m, dict)
                      and str(m.get("type", "")).endswith(".Pooling") and m.get("path")), where)
    data = _json_file(path / where / "config.json")
    if not isinstance(data, dict):
        return None
    modes = [m for m in POOLING_MODES if data.get(f"pooling_mode_{POOLING_MODES[m]}")]
    return "+".join(modes) or None


# sentence-transformers' Pooling modes (in its concatenation order) -> their config key `pooling_mode_<key>`
POOLING_MODES = {"cls": "cls_token", "max": "max_tokens", "mean": "mean_tokens",
                 "mean_sqrt_len": "mean_sqrt_len_tokens", "weightedmean": "weightedmean_tokens",
                 "lasttoken": "lasttoken"}


def _json_file(path: Path):
    """The JSON in `path`, None when there is no such file; a damaged one is an error naming it."""
    from oal.models.folders import bad_model

    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_model(f"{path}: not readable JSON ({exc}); restore it from the model's source") from None
