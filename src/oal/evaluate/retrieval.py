"""Which layers retrieve: the softmax attention that a passkey question puts on the needle, per layer and head.

Perplexity-based layer selection (fidelity, the swap probe) does not see long-range recall: a layer whose heads copy
a key from far back can be replaced by a sliding window at almost no perplexity cost, and the copy is then lost
(SmolLM2-135M, `benchmarks.frontier`: 15 layers ranked by fidelity, PPL 1.08x softmax's, passkey 0 from 1.00).
`needle_attention` measures it directly: on passkey prompts (`oal.evaluate.passkey.make_prompt`), the softmax
weight that the question's last token gives to the needle's tokens, in every layer and query head. A layer whose
largest head puts a large share there is a retrieval layer: keep it on softmax (`retrieval_last`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from oal.evaluate.passkey import PASSKEY, make_prompt, prompt_pieces

__all__ = ["needle_attention", "retrieval_last"]


def _needle_span(tokenizer, length: int, depth: float, seed: int) -> tuple[list[int], slice]:
    """(prompt ids, the needle's token positions) of the passkey prompt `make_prompt` builds."""
    p = make_prompt(tokenizer, length, depth, seed=seed)
    intro, needle, _ = prompt_pieces(tokenizer, p.answer, PASSKEY)
    for start in range(len(intro), len(p.input_ids) - len(needle) + 1):  # the needle sits after whole filler units
        if p.input_ids[start : start + len(needle)] == needle:
            return p.input_ids, slice(start, start + len(needle))
    raise ValueError("tokenizer: the needle's tokens are not found as a run in the prompt")


@torch.no_grad()
def needle_attention(model, tokenizer, *, length: int = 2048, depths: Sequence[float] = (0.1, 0.5, 0.9),
                     seed: int = 1) -> dict[int, list[float]]:
    """{layer: [mean over prompts of the softmax weight on the needle, per query head]} for every layer, from the
    question's last token (where the answer is written next): sum_{j in needle} softmax(q_i . k_j * scale).
    The default seed 1 draws other keys than `oal evaluate --passkey` (seed 0), so a selection made with it is not
    fitted to the evaluation's prompts (their filler and template are the same)."""
    from oal.models.capture import capture

    n_layers = model.config.num_hidden_layers
    sums: dict[int, torch.Tensor] = {}
    device = next(model.parameters()).device
    for depth in depths:
        ids, span = _needle_span(tokenizer, length, depth, seed)

        def keep(c, span=span):
            q = c.q[0, :, -1].float()  # [Hq, d]
            k = c.k[0].float().repeat_interleave(c.q.shape[1] // c.k.shape[1], 0)  # [Hq, N, d]
            w = torch.softmax(torch.einsum("hd,hnd->hn", q, k) * c.scaling, dim=-1)
            sums[c.layer] = sums.get(c.layer, 0) + w[:, span].sum(-1).cpu()

        capture(model, torch.tensor([ids], device=device), list(range(n_layers)), keep)
    return {i: (s / len(depths)).tolist() for i, s in sorted(sums.items())}


def retrieval_last(order: Sequence[int], mass: Mapping[int, Sequence[float]], threshold: float) -> list[int]:
    """`order` (layers best first by another criterion) with every layer whose largest head puts at least
    `threshold` of its weight on the needle moved to the end, keeping the order within both parts."""
    retrieving = [i for i in order if max(mass[i]) >= threshold]
    return [i for i in order if i not in retrieving] + retrieving
