"""Tiny random BERT / RoBERTa encoders (hidden 32, 4 heads, 3 layers) and a tiny WordPiece tokenizer for tests."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast, RobertaConfig, RobertaModel

ENCODERS = {"bert": (BertConfig, BertModel), "roberta": (RobertaConfig, RobertaModel)}
VOCAB = 64
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def tiny_encoder_config(family: str, attn: str | None = None, **overrides):
    cfg_cls, _ = ENCODERS[family]
    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
              max_position_embeddings=80, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
              pad_token_id=0)  # the tokenizer's [PAD] (RoBERTa derives position ids from it)
    cfg = cfg_cls(**{**kw, **overrides})
    if attn is not None:
        cfg._attn_implementation = attn
    return cfg


def tiny_encoder(family: str, attn: str | None = None, seed: int = 0, **overrides):
    """A seeded 3-layer encoder of `family` in eval mode; `attn` picks HF's attention backend.

    The query/key weights are scaled up so that attention is far from uniform (random BERT init gives almost
    flat softmax rows, which any kernel matches)."""
    _, model_cls = ENCODERS[family]
    torch.manual_seed(seed)
    model = model_cls(tiny_encoder_config(family, attn, **overrides)).eval()
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(12.0)
            layer.attention.self.key.weight.mul_(12.0)
    return model


def wordpiece_tokenizer(words: list[str], max_len: int = 64) -> PreTrainedTokenizerFast:
    """A BERT-style tokenizer: [CLS] ... [SEP], lower-casing, WordPiece over `words` and single letters."""
    letters = sorted({c for w in words for c in w})
    vocab = {t: i for i, t in enumerate(SPECIALS + letters + [f"##{c}" for c in letters] + sorted(set(words)))}
    tk = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tk.normalizer = normalizers.BertNormalizer(lowercase=True)
    tk.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tk.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
                                                      special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=max_len)


def save_tiny_encoder(path, words: list[str], family: str = "bert", seed: int = 0):
    """A tiny encoder + WordPiece tokenizer in HF format (a folder `oal run --model PATH` reads)."""
    tok = wordpiece_tokenizer(words)
    model = tiny_encoder(family, seed=seed, vocab_size=len(tok))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def save_word_corpus(path, words: list[str], paragraphs: int = 900, longest: int = 50):
    """A corpus of `paragraphs` random sentences of 8 to `longest` of `words` (seed 0), blank-line separated."""
    import random

    rng = random.Random(0)
    path.write_text("\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(8, longest))) + "."
                                 for _ in range(paragraphs)))
    return path
