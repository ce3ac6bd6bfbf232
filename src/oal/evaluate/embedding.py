"""Sentence-embedding agreement of a converted encoder with its original, on held-out passages.

Both models run through the ordinary HF forward (`model(input_ids=..., attention_mask=...)`); the last hidden
state is pooled in the two usual ways, mean over real tokens (sentence-transformers' default) and the first token
([CLS] / <s>), and each passage's two embeddings are compared by cosine similarity. Reported per pooling: mean,
minimum and 5th percentile over passages, plus the per-passage values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["POOLINGS", "cosine_summary", "embedding_similarity", "pool", "sentence_embeddings"]

POOLINGS = ("mean", "cls")


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """[B, N, H] -> [B, H]: "mean" over real tokens (mask 1) or "cls" (the first token)."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "mean":
        m = attention_mask.to(hidden.dtype)[..., None]
        return (hidden * m).sum(1) / m.sum(1).clamp_min(1.0)
    raise ValueError(f"mode: expected one of {POOLINGS}, got {mode!r}")


@torch.no_grad()
def sentence_embeddings(model, batch: Mapping[str, torch.Tensor], *, batch_size: int = 16,
                        poolings: Sequence[str] = POOLINGS) -> dict[str, torch.Tensor]:
    """pooling -> [P, H] float64 embeddings of the tokenised passages `batch` (input_ids, attention_mask [P, N])."""
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise ValueError(f"batch: expected input_ids and attention_mask [P, N], got {tuple(ids.shape)} and "
                         f"{tuple(mask.shape)}")
    device = next(model.parameters()).device
    out: dict[str, list[torch.Tensor]] = {p: [] for p in poolings}
    for start in range(0, ids.shape[0], batch_size):
        i, m = ids[start : start + batch_size].to(device), mask[start : start + batch_size].to(device)
        hidden = model(input_ids=i, attention_mask=m).last_hidden_state
        for p in poolings:
            out[p].append(pool(hidden, m, p).double().cpu())
    return {p: torch.cat(v) for p, v in out.items()}


def cosine_summary(reference: torch.Tensor, other: torch.Tensor) -> dict:
    """Cosine similarity per passage of two [P, H] embedding sets: mean, min, 5th percentile and the values."""
    cos = torch.nn.functional.cosine_similarity(reference.double(), other.double(), dim=-1)
    return {"mean": float(cos.mean()), "min": float(cos.min()), "p05": float(torch.quantile(cos, 0.05)),
            "n": int(cos.numel()), "per_passage": cos.tolist()}


def embedding_similarity(original, converted, batch: Mapping[str, torch.Tensor], *, batch_size: int = 16,
                         poolings: Sequence[str] = POOLINGS) -> dict[str, dict]:
    """pooling -> cosine_summary of `converted`'s embeddings against `original`'s on the same passages."""
    ref = sentence_embeddings(original, batch, batch_size=batch_size, poolings=poolings)
    got = sentence_embeddings(converted, batch, batch_size=batch_size, poolings=poolings)
    return {p: cosine_summary(ref[p], got[p]) for p in poolings}
