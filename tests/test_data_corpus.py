"""Builtin / local corpora and token blocks."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import ByT5Tokenizer

import oal.data as data
from oal.data import Corpus, load_corpus, token_blocks
from oal.data.corpus import builtin_text, normalize_whitespace, sha256_text, split_text


@pytest.fixture(scope="module")
def builtin():
    return load_corpus("builtin")


@pytest.fixture(scope="module")
def byte_tok():
    return ByT5Tokenizer(extra_ids=0)


def test_builtin_is_deterministic_and_hashed(builtin):
    again = data.builtin_corpus()
    assert again.splits == builtin.splits
    assert builtin_text() == "\n\n".join(builtin.splits.values())  # recomputed from scratch
    assert builtin.fingerprint() == again.fingerprint()
    for s in ("train", "validation", "test"):
        assert builtin.sha256[s] == sha256_text(builtin.splits[s])
        assert len(builtin.splits[s]) > 10_000


def test_builtin_split_fractions_and_whitespace(builtin):
    sizes = {s: len(t) for s, t in builtin.splits.items()}
    total = sum(sizes.values())
    assert 0.88 < sizes["train"] / total < 0.92
    assert 0.03 < sizes["test"] / total < 0.07
    for text in builtin.splits.values():
        assert "\t" not in text and "\n\n\n" not in text
        assert all(line == line.rstrip() for line in text.split("\n"))


def test_split_text_cuts_at_paragraphs():
    text = "\n\n".join(f"para {i} " + "x" * (i % 7) for i in range(200))
    parts = split_text(text, (0.8, 0.1, 0.1))
    assert "\n\n".join(parts.values()) == text
    assert all(p.startswith("para") for p in parts.values())
    with pytest.raises(ValueError, match="fractions"):
        split_text(text, (0.5, 0.5, 0.5))


def test_normalize_whitespace():
    assert normalize_whitespace("a \t\r\n\n\n\nb  \n") == "a\n\nb"


def test_local_file_and_folder(tmp_path):
    f = tmp_path / "doc.txt"
    f.write_text("\n\n".join(f"line {i}" for i in range(100)))
    c = load_corpus(f)
    assert c.splits["train"].startswith("line 0") and c.splits["test"].endswith("line 99")
    d = tmp_path / "named"
    d.mkdir()
    for s in ("train", "validation", "test"):
        (d / f"{s}.txt").write_text(f"{s} text")
    c = load_corpus(d)
    assert c.splits == {"train": "train text", "validation": "validation text", "test": "test text"}
    with pytest.raises(ValueError, match="name_or_path"):
        load_corpus(tmp_path / "missing")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="no text files"):
        load_corpus(empty)


def test_corpus_needs_all_splits():
    with pytest.raises(ValueError, match="splits"):
        Corpus("x", {"train": "a"})


def test_token_blocks_no_special_tokens_tail_dropped(byte_tok):
    text = "abcdefghij</s>"  # special-token strings in raw text stay text
    blocks = token_blocks(byte_tok, text, 4)
    ids = [b + 3 for b in text.encode()]
    assert blocks.dtype == torch.long and blocks.shape == (3, 4)
    assert blocks.reshape(-1).tolist() == ids[:12]
    assert token_blocks(byte_tok, "abc", 4).shape == (0, 4)
    with pytest.raises(ValueError, match="block_len"):
        token_blocks(byte_tok, text, 0)


def test_byte_tokenizer_fast_path_matches_tokenizer():
    from oal.data.byte_tokenizer import byte_offset, byte_tokenizer

    tok = byte_tokenizer()
    text = "caf\u00e9 A\u030a </s><pad>\t\u4e2d\u6587 \U0001f600 end"  # NFC-changing, specials, CJK, emoji
    slow = list(tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
    assert byte_offset(tok) == 3
    assert data.encode(tok, text) == slow
    assert tok.decode(slow) == "caf\u00e9 \u00c5 </s><pad>\t\u4e2d\u6587 \U0001f600 end"
    assert byte_offset(ByT5Tokenizer(extra_ids=0)) is None  # other tokenizers take the general path


def test_warns_once_when_builtin_differs(tmp_path, monkeypatch, caplog, builtin):
    summary = tmp_path / "training_summary.json"
    summary.write_text(json.dumps({"corpus": {"fingerprint": "0" * 64, "python_version": "0.0"}}))
    monkeypatch.setattr(data, "_TRAINING_SUMMARY", summary)
    with caplog.at_level(logging.WARNING, logger="oal"):
        data._warn_if_builtin_differs(builtin)
    assert len(caplog.records) == 1 and "differs" in caplog.records[0].getMessage()
    assert builtin.meta["matches_default_model"] is False
    summary.write_text(json.dumps({"corpus": {"fingerprint": builtin.fingerprint()}}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="oal"):
        data._warn_if_builtin_differs(builtin)
    assert not caplog.records and builtin.meta["matches_default_model"] is True
