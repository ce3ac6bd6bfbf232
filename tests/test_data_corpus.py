"""Builtin / local corpora and token blocks."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from transformers import ByT5Tokenizer

import oal.data as data
import oal.data.sources as sources
from oal.data import Corpus, load_corpus, token_blocks
from oal.data.corpus import (
    MIN_REPEAT,
    _docstrings_and_code,
    builtin_layout,
    normalize_whitespace,
    sha256_text,
    split_text,
    stdlib_files,
)


@pytest.fixture(scope="module")
def builtin():
    return load_corpus("builtin")


@pytest.fixture(scope="module")
def byte_tok():
    return ByT5Tokenizer(extra_ids=0)


def test_builtin_is_deterministic_and_hashed(builtin):
    again = data.builtin_corpus()
    assert again.splits == builtin.splits
    lay = builtin_layout()  # recomputed from scratch
    assert lay["splits"] == builtin.splits and lay["pretrain_start"] == builtin.meta["pretrain_start_char"]
    assert builtin.fingerprint() == again.fingerprint()
    for s in ("train", "validation", "test"):
        assert builtin.sha256[s] == sha256_text(builtin.splits[s])
        assert len(builtin.splits[s]) > 50_000
    assert builtin.meta["licence"] == "PSF-2.0"


def test_builtin_heldout_prose_is_disjoint_from_pretraining(builtin):
    """Grouping/calibration/adaptation (the head of train), validation and test are whole prose units that the
    pretraining text (the rest of train) does not contain: no docstring or topic paragraph appears in both."""
    lay = builtin_layout()
    units = lay["units"]
    held = units["heldout_train"] + units["validation"] + units["test"]
    assert not set(held) & set(units["pretrain"])
    assert all(u.startswith(("topic:", "doc:")) for u in held)  # prose only; code is pretraining text
    assert any(u.startswith("code:") for u in units["pretrain"])
    start = builtin.meta["pretrain_start_char"]
    pretrain = builtin.splits["train"][start:]
    assert sha256_text(pretrain) == builtin.meta["pretrain_sha256"]

    def paragraphs(text):
        return {p for p in text.split("\n\n") if len(p) >= MIN_REPEAT}

    parts = [paragraphs(t) for t in (builtin.splits["train"][:start], builtin.splits["validation"],
                                     builtin.splits["test"], pretrain)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not parts[i] & parts[j], (i, j)
    assert len(builtin.splits["validation"]) < start and len(builtin.splits["test"]) < start < len(pretrain)


def test_builtin_whitespace_and_files(builtin):
    for text in builtin.splits.values():
        assert "\t" not in text and "\n\n\n" not in text
        assert all(line == line.rstrip() for line in text.split("\n"))
    names = {f.name for f in stdlib_files()}
    assert "argparse.py" in names and "site.py" not in names
    assert not any(part in {"test", "tests", "idlelib", "encodings"} for f in stdlib_files() for part in f.parts[-3:-1])


def test_docstrings_removed_from_code():
    src = 'def f(x):\n    """Doc line.\n\n    More."""\n    return x  # keep me\n\nclass C:\n    "one-liner"\n'
    docs, code = _docstrings_and_code(src)
    assert docs == ["Doc line.\n\nMore.", "one-liner"]
    assert "Doc line" not in code and "one-liner" not in code and "return x  # keep me" in code


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
    monkeypatch.setattr(sources, "_TRAINING_SUMMARY", summary)
    with caplog.at_level(logging.WARNING, logger="oal"):
        sources._warn_if_builtin_differs(builtin)
    assert len(caplog.records) == 1 and "differs" in caplog.records[0].getMessage()
    assert builtin.meta["matches_default_model"] is False
    summary.write_text(json.dumps({"corpus": {"fingerprint": builtin.fingerprint()}}))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="oal"):
        sources._warn_if_builtin_differs(builtin)
    assert not caplog.records and builtin.meta["matches_default_model"] is True
