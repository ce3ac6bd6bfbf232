"""Tokenise text into non-overlapping fixed-length blocks (paper App. F.3)."""

from __future__ import annotations

import unicodedata

import torch

from oal.data.byte_tokenizer import byte_offset


def encode(tokenizer, text: str) -> list[int]:
    """Token ids of raw text: no BOS/EOS, no chat template; special-token strings in the text stay plain text."""
    off = byte_offset(tokenizer)
    if off is not None:
        # Fast path for the embedded byte tokenizer: NFC then UTF-8 bytes + offset (what the tokenizer computes;
        # tests/test_data_corpus.py checks both paths agree). The slow path takes ~8 s per MB.
        return [b + off for b in unicodedata.normalize("NFC", text).encode("utf-8")]
    enc = tokenizer(text, add_special_tokens=False, split_special_tokens=True, verbose=False)
    return list(enc["input_ids"])


def token_blocks(tokenizer, text: str, block_len: int) -> torch.Tensor:
    """LongTensor [n_blocks, block_len]: the token stream cut into non-overlapping blocks, incomplete tail dropped."""
    if not isinstance(block_len, int) or block_len < 1:
        raise ValueError(f"block_len: expected a positive int, got {block_len!r}")
    ids = encode(tokenizer, text)
    n_blocks = len(ids) // block_len
    return torch.tensor(ids[: n_blocks * block_len], dtype=torch.long).reshape(n_blocks, block_len)
