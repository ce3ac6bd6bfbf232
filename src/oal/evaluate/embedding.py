"""Sentence-embedding agreement of a converted encoder with its original, on held-out passages.

Both models run through the ordinary HF forward (`model(input_ids=..., attention_mask=...)`); the last hidden
state is pooled in the two usual ways, mean over real tokens (sentence-transformers' default) and the first token
([CLS] / <s>), and each passage's two embeddings are compared by cosine similarity. Reported per pooling: mean,
minimum and 5th percentile over passages, plus the per-passage values.

`pool` also takes sentence-transformers' other modes (`SENTENCE_POOLINGS`), computed as its Pooling module does,
so that a folder declaring one of them is measured with its own pooling; several modes joined by "+" are
concatenated in the order sentence-transformers concatenates them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from oal.models.encoder import POOLING_MODES

__all__ = ["POOLINGS", "SENTENCE_POOLINGS", "cosine_summary", "embedding_similarity", "pool",
           "sentence_embeddings"]

POOLINGS = ("mean", "cls")
SENTENCE_POOLINGS = tuple(POOLING_MODES)  # sentence-transformers' modes, in the order it concatenates them


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """[B, N, H] -> [B, H]: "mean" over real tokens (mask 1), "cls" (the first token), or another of
    `SENTENCE_POOLINGS` as sentence-transformers computes it ("a+b": both, concatenated)."""
    if "+" in mode:
        return torch.cat([pool(hidden, attention_mask, m) for m in mode.split("+")], -1)
    m = attention_mask.to(hidden.dtype)[..., None]
    if mode == "cls":
        return hidden[:, 0]
    if mode in ("mean", "mean_sqrt_len"):
        n = m.sum(1).clamp_min(1.0)
        return (hidden * m).sum(1) / (n if mode == "mean" else n.sqrt())
    if mode == "max":
        return hidden.masked_fill(m == 0, -1e9).amax(1)  # padded tokens never win (sentence-transformers' -1e9)
    if mode == "weightedmean":  # weights 1..N by position, real tokens only
        w = m * torch.arange(1, hidden.shape[1] + 1, device=hidden.device, dtype=hidden.dtype)[:, None]
        return (hidden * w).sum(1) / w.sum(1).clamp_min(1e-9)
    if mode == "lasttoken":  # the last real token, whichever side the padding is on
        pos = torch.arange(hidden.shape[1], device=hidden.device)
        last = (attention_mask.bool() * pos).amax(1)
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    raise ValueError(f"mode: expected one of {SENTENCE_POOLINGS} (or several joined by '+'), got {mode!r}")


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
            out[p].append(pool(hidden.double(), m, p).cpu())  # pooled in float64: a bf16 sum would round the mean
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
