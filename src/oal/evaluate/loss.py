"""Next-token cross-entropy of a causal LM without its [N, V] logits: the LM head and the loss per token chunk.

A causal LM's forward ends in `lm_head(hidden)` over the whole vocabulary: at N = 4096 and Qwen's 151,936 tokens
that is 2.5 GB of fp32 logits per block, and the softmax and its gradient triple it. Here the decoder runs once to
its final hidden states [B, N, D] (after the final norm), and the head + cross-entropy run on `chunk` tokens at a
time; under autograd each chunk is checkpointed, so its logits exist only while that chunk's forward or backward
runs. The sum is exact: the same logits (the head's output dtype; half precision upcast to fp32 as transformers'
`ForCausalLMLoss` does, fp64 kept, so tests compare in fp64), the same targets (labels shifted by one,
`ignore_index` skipped); only the order of the float additions differs (each chunk's sum is added in fp64).

`full_cross_entropy` is the reference: the whole logits at once, as transformers computes `model(...).loss`.

On CUDA, the training loss (`causal_lm_loss`) uses Liger-Kernel's fused linear cross-entropy when it is installed
(the `fused-ce` extra) and the head is a plain `nn.Linear`; perplexity and validation NLL (`causal_lm_nll`) always
use the chunked torch path, so reported numbers do not depend on an optional package.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from oal.errors import env_flag

__all__ = ["IGNORE_INDEX", "CausalLMLoss", "causal_lm_loss", "causal_lm_nll", "chunk_tokens", "chunked_cross_entropy",
           "full_cross_entropy", "fused_backend", "lm_parts"]

IGNORE_INDEX = -100  # transformers' and torch's
CHUNK_BYTES = 2**28  # fp32 logits of one chunk: 256 MiB (~440 tokens at V = 151,936; a whole block for small V)
FUSED_ENV = "OAL_FUSED_CE"  # "0": never use the fused kernel


def chunk_tokens(vocab_size: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take about `chunk_bytes`."""
    if vocab_size < 1 or chunk_bytes < 1:
        raise ValueError(f"vocab_size/chunk_bytes: expected positive integers, got {vocab_size}, {chunk_bytes}")
    return max(1, chunk_bytes // (4 * vocab_size))


def lm_parts(model) -> tuple[nn.Module, nn.Module]:
    """(decoder, head) of a causal LM, seen through peft and DDP wrappers: the decoder returns the final hidden states
    (`last_hidden_state`, after the final norm) and `head(hidden)` the logits. A tied head shares the embedding's
    weight; a LoRA-wrapped head is returned wrapped (it is called as a module)."""
    inner = model
    while isinstance(inner, nn.parallel.DistributedDataParallel) or hasattr(inner, "get_base_model"):
        inner = inner.module if isinstance(inner, nn.parallel.DistributedDataParallel) else inner.get_base_model()
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    decoder = inner.get_decoder() if hasattr(inner, "get_decoder") else None
    if head is None or decoder is None or decoder is inner:
        raise ValueError(f"model: {type(inner).__name__} is not a causal LM with a decoder and an output head")
    for attr in ("final_logit_softcapping", "logit_scale", "output_multiplier_scale"):
        if getattr(inner.config, attr, None) not in (None, 1.0):  # logits are not head(hidden) for these
            raise ValueError(f"model: {type(inner).__name__} transforms its logits ({attr}); not supported")
    return decoder, head


def _shifted(hidden: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states that predict a token [T, D] and their targets [T] (label of the next position), ignored ones
    dropped: transformers' shift (pad with ignore_index, labels[..., 1:])."""
    if hidden.dim() != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(f"labels: expected [B, N] = {tuple(hidden.shape[:2])}, got {tuple(labels.shape)}")
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    t = labels[:, 1:].reshape(-1).to(h.device)
    keep = t != ignore_index
    if not bool(keep.all()):
        h, t = h[keep], t[keep]
    return h, t


def _upcast(logits: torch.Tensor) -> torch.Tensor:
    """Half-precision logits to fp32 (as transformers' loss does); fp32 and fp64 stay as they are."""
    return logits if logits.dtype in (torch.float32, torch.float64) else logits.float()


def _chunk_nll(head: nn.Module, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(_upcast(head(h)), t, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, *, chunk: int | None = None,
                          ignore_index: int = IGNORE_INDEX) -> tuple[torch.Tensor, int]:
    """(summed next-token NLL as an fp64 tensor, number of targets) of `head(hidden)` against `labels` [B, N].

    `chunk` tokens at a time (default: `chunk_tokens` of the head's vocabulary); under autograd each chunk's head
    and loss are recomputed in backward (activation checkpointing), so at most one chunk's logits exist."""
    h, t = _shifted(hidden, labels, ignore_index)
    vocab = head.weight.shape[0] if hasattr(head, "weight") else head(h[:1]).shape[-1]
    chunk = chunk or chunk_tokens(vocab)
    if chunk < 1:
        raise ValueError(f"chunk: expected a positive token count, got {chunk}")
    grad = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in head.parameters()))
    total = h.new_zeros((), dtype=torch.float64)  # chunk sums added in fp64
    for start in range(0, t.numel(), chunk):
        hc, tc = h[start : start + chunk], t[start : start + chunk]
        part = checkpoint(_chunk_nll, head, hc, tc, use_reentrant=False) if grad else _chunk_nll(head, hc, tc)
        total = total + part.double()
    return total, t.numel()


def full_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX
                       ) -> tuple[torch.Tensor, int]:
    """Reference: (summed NLL, targets) from the whole logits [B, N, V] at once, shifted as transformers does."""
    t = labels[:, 1:].reshape(-1)
    nll = F.cross_entropy(_upcast(logits[:, :-1]).reshape(-1, logits.shape[-1]), t, ignore_index=ignore_index,
                          reduction="sum")
    return nll, int((t != ignore_index).sum())


def _hidden(decoder: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    return decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state


def causal_lm_nll(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                  attention_mask: torch.Tensor | None = None, chunk: int | None = None) -> tuple[torch.Tensor, int]:
    """(summed next-token NLL, targets) of `model` on `input_ids` [B, N] (labels default to the inputs), chunked."""
    decoder, head = lm_parts(model)
    hidden = _hidden(decoder, input_ids, attention_mask)
    return chunked_cross_entropy(hidden, head, input_ids if labels is None else labels, chunk=chunk)


def fused_backend(device: torch.device | str, head: nn.Module, *, available: bool | None = None) -> str | None:
    """"liger" when the training loss can use Liger-Kernel's fused linear cross-entropy: a CUDA device, a plain
    `nn.Linear` head (not LoRA-wrapped), the package importable, and OAL_FUSED_CE not "0"; else None (chunked)."""
    if not env_flag(FUSED_ENV, True) or torch.device(device).type != "cuda" or type(head) is not nn.Linear:
        return None
    if available is None:
        available = importlib.util.find_spec("liger_kernel") is not None
    return "liger" if available else None


def _liger_loss(hidden: torch.Tensor, head: nn.Linear, labels: torch.Tensor) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    t = labels[:, 1:].reshape(-1).to(h.device)
    return liger_fused_linear_cross_entropy(h, head.weight, t, bias=head.bias, ignore_index=IGNORE_INDEX,
                                            reduction="mean")


def causal_lm_loss(model, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                   attention_mask: torch.Tensor | None = None, chunk: int | None = None,
                   fused: bool | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy (what `model(input_ids, labels=labels).loss` gives), for training.

    fused: None picks Liger-Kernel's fused kernel where `fused_backend` allows it, False never, True requires it."""
    decoder, head = lm_parts(model)
    labels = input_ids if labels is None else labels
    hidden = _hidden(decoder, input_ids, attention_mask)
    backend = None if fused is False else fused_backend(hidden.device, head)
    if fused and backend is None:
        raise ValueError("fused: the fused cross-entropy needs CUDA, a plain nn.Linear head and liger-kernel "
                         "(pip install 'oal-attention[fused-ce]')")
    if backend == "liger":
        return _liger_loss(hidden, head, labels)
    total, count = chunked_cross_entropy(hidden, head, labels, chunk=chunk)
    return (total / count).to(torch.float64 if hidden.dtype == torch.float64 else torch.float32)


class CausalLMLoss(nn.Module):
    """`causal_lm_loss` of the wrapped model as a module's forward, so that DDP (accelerate) wraps the whole loss
    computation (DDP only synchronises gradients of a forward that ran through it)."""

    def __init__(self, model: nn.Module, **kwargs):
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return causal_lm_loss(self.model, input_ids, labels, **self.kwargs)
