"""The data a user brings to `--data` / `oal.linearize(texts=...)`: local text, JSON-lines and parquet files and
folders, and the edge cases of real files (BOM, no blank lines, overlapping splits, ...)."""

from __future__ import annotations

import json
import logging

import pytest

from oal.data import default_plan, encode, load_corpus, plan_blocks
from oal.data.byte_tokenizer import byte_tokenizer
from oal.data.corpus import split_text

PARAS = [f"Paragraph {i} says something about the topic at hand." for i in range(60)]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _parquet(path, columns):
    pa = pytest.importorskip("pyarrow")  # datasets brings it; the GPU machine has no datasets
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def test_utf8_bom_never_reaches_the_model(tmp_path, tok):
    f = tmp_path / "bom.txt"
    f.write_bytes(b"\xef\xbb\xbf" + "\r\n\r\n".join(PARAS).encode())
    c = load_corpus(f)
    assert c.splits == load_corpus(_write(tmp_path / "clean.txt", "\n\n".join(PARAS))).splits
    named = tmp_path / "named"
    named.mkdir()
    for s in ("train", "validation", "test"):
        (named / f"{s}.txt").write_bytes(b"\xef\xbb\xbf" + f"{s} line one\r\nline two".encode())
    c = load_corpus(named)
    assert c.splits["train"] == "train line one\nline two"
    assert all("\ufeff" not in t and "\r" not in t for t in c.splits.values())
    assert encode(tok, c.splits["test"])[0] == ord("t") + 3


def _write(path, text):
    path.write_text(text, encoding="utf-8")
    return path


def test_text_without_blank_lines_still_has_validation_and_test(tmp_path):
    lines = [f"sentence number {i} is here." for i in range(2000)]
    c = load_corpus(_write(tmp_path / "lines.txt", "\n".join(lines)))
    assert all(c.splits[s] for s in ("train", "validation", "test"))
    assert all(t.startswith("sentence") and t.endswith(".") for t in c.splits.values())  # cut at line breaks
    assert "\n".join(c.splits.values()) == "\n".join(lines)
    # one huge line: cut at spaces; a trailing paragraph longer than 10% of the text no longer empties test
    words = " ".join(f"w{i}" for i in range(5000))
    parts = split_text(words)
    assert all(parts.values()) and " ".join(parts.values()) == words
    tail = split_text("\n\n".join(PARAS) + "\n\n" + "x " * 2000)
    assert tail["validation"] and tail["test"]


def test_jsonl_file_reads_the_text_field(tmp_path):
    rows = [{"text": p, "id": i} for i, p in enumerate(PARAS)]
    c = load_corpus(_jsonl(tmp_path / "docs.jsonl", rows))
    assert "{" not in c.splits["train"] and c.splits["train"].startswith("Paragraph 0 says")
    assert "\n\n".join(c.splits.values()) == "\n\n".join(PARAS)
    blank = tmp_path / "blank_lines.jsonl"
    blank.write_text("\n" + json.dumps({"text": PARAS[0]}) + "\n\n" + json.dumps({"text": PARAS[1]}) + "\n")
    assert load_corpus(blank).splits["train"].startswith(PARAS[0])
    with pytest.raises(ValueError, match=r"line 2.*'text'"):
        load_corpus(_jsonl(tmp_path / "missing.jsonl", [{"text": "a"}, {"body": "b"}]))
    with pytest.raises(ValueError, match=r"line 1.*string"):
        load_corpus(_jsonl(tmp_path / "nonstr.jsonl", [{"text": 3}]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2.*JSON"):
        load_corpus(bad)
    with pytest.raises(ValueError, match="empty train split"):
        load_corpus(_write(tmp_path / "empty.jsonl", ""))


def test_parquet_file_reads_the_text_column(tmp_path):
    c = load_corpus(_parquet(tmp_path / "docs.parquet", {"text": PARAS, "n": list(range(len(PARAS)))}))
    assert "\n\n".join(c.splits.values()) == "\n\n".join(PARAS)
    with pytest.raises(ValueError, match=r"no 'text' column.*body"):
        load_corpus(_parquet(tmp_path / "other.parquet", {"body": PARAS}))
    with pytest.raises(ValueError, match="row 1"):
        load_corpus(_parquet(tmp_path / "nulls.parquet", {"text": ["a", None]}))


def test_folder_of_mixed_files(tmp_path):
    d = tmp_path / "mixed dir ü"
    d.mkdir()
    _write(d / "a.txt", "\n\n".join(PARAS[:20]))
    _jsonl(d / "b.jsonl", [{"text": p} for p in PARAS[20:40]])
    _parquet(d / "c.parquet", {"text": PARAS[40:]})
    (d / "d.bin").write_bytes(b"\x00\x01")
    c = load_corpus(d)
    assert c.meta["files"] == ["a.txt", "b.jsonl", "c.parquet"]
    assert "\n\n".join(c.splits.values()) == "\n\n".join(PARAS)
    named = tmp_path / "named"
    named.mkdir()
    _jsonl(named / "train.jsonl", [{"text": p} for p in PARAS[:50]])
    _write(named / "validation.txt", PARAS[50])
    _parquet(named / "test.parquet", {"text": PARAS[51:]})
    c = load_corpus(named)
    assert c.splits["validation"] == PARAS[50] and c.splits["test"] == "\n\n".join(PARAS[51:])
    assert c.meta["files"] == ["train.jsonl", "validation.txt", "test.parquet"]


def test_overlapping_splits_warn(tmp_path, caplog):
    d = tmp_path / "leak"
    d.mkdir()
    _write(d / "train.txt", "\n\n".join(PARAS))
    _write(d / "validation.txt", "\n\n".join(PARAS[:5]))
    _write(d / "test.txt", "\n\n".join(PARAS[5:10] + ["A test paragraph that is nowhere in the train split."]))
    with caplog.at_level(logging.WARNING, logger="oal"):
        load_corpus(d)
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "5 of the 6 paragraphs of test" in msg and "5 of the 5 paragraphs of validation" in msg
    assert "leakage" in msg
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="oal"):
        load_corpus(_write(tmp_path / "fine.txt", "\n\n".join(PARAS)))
    assert not caplog.records


def test_blocks_are_the_split_tokens_and_hashes_follow_the_data(tmp_path, tok):
    f = _write(tmp_path / "doc.txt", "\n\n".join(PARAS * 10))
    a, b = load_corpus(f), load_corpus(f)
    assert a.sha256 == b.sha256 and a.splits == b.splits  # deterministic
    plan = default_plan()
    with pytest.raises(ValueError, match=r"split 'train' .* has \d+ tokens.*need at least 79872"):
        plan_blocks(a, tok, plan)
    _write(f, "\n\n".join(PARAS * 10) + "\n\nOne more paragraph.")
    assert load_corpus(f).sha256["test"] != a.sha256["test"]


def test_folder_with_two_of_three_split_files_is_refused(tmp_path):
    _write(tmp_path / "train.txt", "\n\n".join(PARAS))
    _write(tmp_path / "test.txt", "\n\n".join(PARAS[:3]))
    with pytest.raises(ValueError, match=r"none for \['validation'\].*validation.txt"):
        load_corpus(tmp_path)
