"""Perplexity on non-overlapping token blocks (paper App. F.3).

Each block of L tokens is an independent sequence with L - 1 next-token targets; the incomplete tail of the
split was already dropped when the blocks were cut (`oal.data.token_blocks`). PPL = exp(mean NLL) over all
scored tokens of all blocks (not a mean of per-block perplexities). The NLL is computed by
`oal.evaluate.loss.causal_lm_nll`: the LM head and the loss per token chunk, so the [L, V] logits never exist.
"""

from __future__ import annotations

import math

import torch

from oal.device import module_device
from oal.evaluate.loss import causal_lm_nll
from oal.launch import progress_bar

__all__ = ["block_nll", "perplexity"]


def _check_blocks(blocks) -> torch.Tensor:
    if not isinstance(blocks, torch.Tensor) or blocks.dim() != 2 or blocks.dtype not in (torch.int64, torch.int32):
        got = f"{blocks.dtype} {tuple(blocks.shape)}" if isinstance(blocks, torch.Tensor) else type(blocks).__name__
        raise ValueError(f"blocks: expected an integer tensor [n_blocks, L], got {got}")
    if blocks.shape[0] == 0 or blocks.shape[1] < 2:
        raise ValueError(f"blocks: need at least one block of length >= 2, got shape {tuple(blocks.shape)}")
    return blocks.long()


@torch.no_grad()
def block_nll(model, blocks: torch.Tensor, *, batch_size: int = 1, progress: bool = False,
              description: str = "perplexity") -> tuple[float, int]:
    """Summed next-token NLL (nats, accumulated in fp64) and the number of scored tokens over `blocks`.

    The blocks go to the model's device once; the sum stays there and comes back as one number at the end."""
    blocks = _check_blocks(blocks)
    if batch_size < 1:
        raise ValueError(f"batch_size: expected >= 1, got {batch_size}")
    blocks = blocks.to(module_device(model))
    was_training = model.training
    model.eval()
    total, count = blocks.new_zeros((), dtype=torch.float64), 0
    try:
        with progress_bar(progress) as bar:
            task = bar.add_task(description, total=blocks.shape[0])
            for start in range(0, blocks.shape[0], batch_size):
                ids = blocks[start : start + batch_size]
                nll, n = causal_lm_nll(model, ids)
                total += nll.double()
                count += n
                bar.advance(task, ids.shape[0])
    finally:
        model.train(was_training)
    return float(total), count


def perplexity(model, blocks: torch.Tensor, *, batch_size: int = 1, progress: bool = False) -> float:
    """exp(mean NLL over all scored tokens), L - 1 targets per block (App. F.3)."""
    total, count = block_nll(model, blocks, batch_size=batch_size, progress=progress)
    return math.exp(total / count)
