"""The builtin corpus's layout in the user's cache (oal.data.builtin_cache): written once, read back only when its
record names the current inputs and the file's SHA256, built again with one warning otherwise. The layout itself is
stood in for by a small dict here (tests/test_data_corpus.py compares the cached corpus with one built from scratch)."""

from __future__ import annotations

import json
import logging

import pytest

import oal.data.builtin_cache as bc
import oal.data.corpus as corpus

LAYOUT = {"splits": {"train": "head\n\npretraining", "validation": "v", "test": "t"}, "pretrain_start": 6,
          "units": {"heldout_train": ["doc:a.py"], "validation": [], "test": [], "pretrain": ["code:a.py"]}}


@pytest.fixture
def built(monkeypatch):
    """Counts the layout's builds; the key is fixed (computing it reads the whole standard library)."""
    calls = []

    def build():
        calls.append(1)
        return json.loads(json.dumps(LAYOUT))

    monkeypatch.setattr(corpus, "builtin_layout", build)
    monkeypatch.setattr(bc, "layout_key", lambda: "0123456789abcdef")
    return calls


def _entry(folder):
    return folder / "builtin-0123456789abcdef.layout.json", folder / "builtin-0123456789abcdef.json"


def test_written_once_then_read_back(tmp_path, built, caplog):
    assert bc.cached_builtin_layout(tmp_path) == LAYOUT and len(built) == 1
    layout, record = _entry(tmp_path)
    assert json.loads(record.read_text())["key"] == "0123456789abcdef"
    with caplog.at_level(logging.WARNING, logger="oal"):
        assert bc.cached_builtin_layout(tmp_path) == LAYOUT
    assert len(built) == 1 and not caplog.records
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([layout.name, record.name])  # no temporaries left


def _edit_layout(layout, record):
    layout.write_text(layout.read_text().replace("pretraining", "PRETRAINING"))


def _other_key(layout, record):
    record.write_text(json.dumps(dict(json.loads(record.read_text()), key="fedcba9876543210")))


def _no_record(layout, record):
    record.unlink()


def _hand_written(layout, record):  # a file that matches its record but is not a layout
    layout.write_text('{"splits": 1}')
    record.write_text(json.dumps(dict(json.loads(record.read_text()), sha256=bc.sha256_file(layout))))


@pytest.mark.parametrize("tamper, why", [(_edit_layout, "its SHA256 is not the one recorded"),
                                         (_other_key, "its record names other inputs"),
                                         (_no_record, "no record of how it was built"),
                                         (_hand_written, "not a layout of the builtin corpus")])
def test_an_entry_that_does_not_verify_is_built_again(tmp_path, built, caplog, tamper, why):
    bc.cached_builtin_layout(tmp_path)
    tamper(*_entry(tmp_path))
    with caplog.at_level(logging.WARNING, logger="oal"):
        assert bc.cached_builtin_layout(tmp_path) == LAYOUT
    assert len(built) == 2
    (message,) = [r.getMessage() for r in caplog.records]  # one warning, naming the file and why
    assert message.startswith(f"{_entry(tmp_path)[0]}: {why}") and message.endswith("building the builtin corpus again")
    assert bc.cached_builtin_layout(tmp_path) == LAYOUT and len(built) == 2  # written again, read back


def test_a_cache_that_cannot_be_written_costs_only_time(tmp_path, built, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="oal"):
        assert bc.cached_builtin_layout(blocked / "corpus") == LAYOUT
    assert "could not cache the builtin corpus" in caplog.text


def test_the_key_follows_every_input(monkeypatch, tmp_path):
    """The Python version, the corpus code and each file read (its bytes and its name) change the key."""
    files = corpus.stdlib_files()[:3]
    monkeypatch.setattr(corpus, "stdlib_files", lambda: files)
    key = bc.layout_key()
    assert key == bc.layout_key() and len(key) == 16
    monkeypatch.setattr(corpus, "stdlib_files", lambda: files[:2])
    assert bc.layout_key() != key
    monkeypatch.setattr(corpus, "stdlib_files", lambda: [files[1], files[0], files[2]])
    assert bc.layout_key() != key  # the order of the files is part of the layout
    monkeypatch.setattr(corpus, "stdlib_files", lambda: files)
    monkeypatch.setattr(bc.sys, "version", bc.sys.version + "+other")
    assert bc.layout_key() != key
    monkeypatch.setattr(bc.sys, "version", bc.sys.version[: -len("+other")])
    code = tmp_path / "corpus.py"
    code.write_text(bc.Path(corpus.__file__).read_text() + "\n# another algorithm\n")
    monkeypatch.setattr(corpus, "__file__", str(code))
    assert bc.layout_key() != key
    monkeypatch.undo()
    monkeypatch.setattr(corpus, "stdlib_files", lambda: files)
    monkeypatch.setattr(bc, "sha256_file", lambda p: "0" * 64)
    assert bc.layout_key() != key  # the files' contents
