"""Position dependence of a model's outputs: how much the last logits move when every position id is shifted by the
same amount. Softmax attention with RoPE depends on relative positions only, so the base model moves by rounding
alone; a kernel whose group sums split a RoPE pair (r, r + d/2) sees absolute positions and moves more."""

from __future__ import annotations

import torch

__all__ = ["shift_error"]


@torch.no_grad()
def shift_error(model, ids: torch.Tensor, shift: int = 3) -> float:
    """max |logits[:, -1](positions + shift) - logits[:, -1](positions)| over the rows of `ids` [B, N]."""
    if ids.dim() != 2 or ids.shape[1] < 1:
        raise ValueError(f"ids: expected token ids [B, N] with N >= 1, got shape {tuple(ids.shape)}")
    if shift < 0:
        raise ValueError(f"shift: expected >= 0, got {shift}")
    ids = ids.to(next(model.parameters()).device)
    pos = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
    a = model(input_ids=ids, position_ids=pos).logits[:, -1].double()
    b = model(input_ids=ids, position_ids=pos + shift).logits[:, -1].double()
    return (a - b).abs().max().item()
