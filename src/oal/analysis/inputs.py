"""The analysis inputs of a data plan: grouping prompts, held-out prompts and one long sequence (App. A.3, B)."""

from __future__ import annotations

import math

import torch


def _stream(corpus, tokenizer, blockset, data_dir, n_tokens: float = math.inf):
    """The corpus of `blockset` and its split's token ids, at least the first `n_tokens` of them."""
    from oal.data import load_corpus
    from oal.data.splits import encode_prefix

    c = corpus if blockset.corpus is None else load_corpus(blockset.corpus, data_dir=data_dir)
    return c, encode_prefix(tokenizer, c.splits[blockset.split], n_tokens)


def analysis_inputs(corpus, tokenizer, plan, *, n_heldout: int = 40, long_len: int | None = None,
                    max_len: int | None = None, data_dir=None) -> dict:
    """Token tensors for `analyze` from a SplitPlan.

    prompts: the plan's grouping blocks [P, L] (App. B calibration prompts);
    heldout: the first `n_heldout` blocks of length L of the same corpus's validation split (App. A.3 held-out
    inputs; None when 0 or the split is too short);
    long_sequence: `long_len` tokens (default: the fidelity block length, capped at `max_len`) starting at the plan's
    first fidelity block, for the sequence-length table (Table 4).
    meta: where each came from.
    """
    from oal.data import token_blocks

    grp = plan.grouping
    reach = math.inf if grp.through_end else (max(grp.indices) + 1) * grp.block_len
    gcorpus, stream = _stream(corpus, tokenizer, grp, data_dir, reach)
    idx = grp.resolve(len(stream) // grp.block_len)
    prompts = torch.tensor([stream[i * grp.block_len : (i + 1) * grp.block_len] for i in idx], dtype=torch.long)
    heldout = None
    if n_heldout > 0:
        heldout = token_blocks(tokenizer, gcorpus.splits["validation"], grp.block_len)[:n_heldout]
        heldout = heldout if heldout.shape[0] > 0 else None
    fid = plan.fidelity
    n_long = long_len or (fid.block_len if max_len is None else min(fid.block_len, max_len))
    start = min(fid.indices) * fid.block_len
    _, fstream = _stream(corpus, tokenizer, fid, data_dir, start + n_long)
    long_sequence = torch.tensor(fstream[start : start + n_long], dtype=torch.long)
    if long_sequence.numel() < n_long:
        raise ValueError(f"long_len: split {fid.split!r} has only {long_sequence.numel()} tokens from token {start}")
    meta = dict(
        corpus=gcorpus.name, sha256=gcorpus.sha256,
        grouping=dict(split=grp.split, block_len=grp.block_len, indices=idx, corpus=grp.corpus),
        heldout=dict(split="validation", block_len=grp.block_len, n=0 if heldout is None else heldout.shape[0]),
        long_sequence=dict(split=fid.split, corpus=fid.corpus, start_token=start, n_tokens=n_long),
    )
    return dict(prompts=prompts, heldout=heldout, long_sequence=long_sequence, meta=meta)
