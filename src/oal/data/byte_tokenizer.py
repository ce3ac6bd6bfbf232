"""The byte-level tokenizer of the embedded model, as a Qwen2Tokenizer so `AutoTokenizer` loads it offline.

transformers maps a `qwen2` model folder to `Qwen2Tokenizer` whatever tokenizer_config.json says, so the byte
tokenizer is a Qwen2 (byte-level BPE) tokenizer with no merges: ids 0-2 are <pad>, </s>, <unk>; byte b is id b + 3.
Qwen2Tokenizer applies NFC normalisation first; `encode` below reproduces that exactly on its fast path.
"""

from __future__ import annotations

from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

BYTE_OFFSET = 3
SPECIALS = ("<pad>", "</s>", "<unk>")
MARKER = "oal_byte_offset"  # stored in tokenizer_config.json; enables the fast path in oal.data.encode


def byte_tokenizer() -> Qwen2Tokenizer:
    b2u = bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({b2u[b]: b + BYTE_OFFSET for b in range(256)})
    tok = Qwen2Tokenizer(vocab=vocab, merges=[], unk_token="<unk>", eos_token="</s>", pad_token="<pad>",
                         **{MARKER: BYTE_OFFSET})
    return tok


def byte_offset(tokenizer) -> int | None:
    """BYTE_OFFSET when `tokenizer` is the byte tokenizer (marker present and vocab as built here), else None."""
    off = getattr(tokenizer, "init_kwargs", {}).get(MARKER)
    if off != BYTE_OFFSET or len(tokenizer) != 256 + BYTE_OFFSET:
        return None
    vocab = tokenizer.get_vocab()
    if any(vocab.get(s) != i for i, s in enumerate(SPECIALS)):
        return None
    return off
