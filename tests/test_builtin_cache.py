"""The builtin corpus's layout in the user's cache (oal.data.builtin_cache): written once, read back only when its
record names the current inputs and the file's SHA256, built again with one warning otherwise. Inputs here are a few
small files and a stand-in layout (tests/test_data_corpus.py compares the cached builtin corpus with one built from
scratch)."""

from __future__ import annotations

import json
import logging
import sys

import pytest

import oal.data.builtin_cache as bc
import oal.data.corpus as corpus

LAYOUT = {"splits": {"train": "head\n\npretraining", "validation": "v", "test": "t"}, "pretrain_start": 6,
          "units": {"heldout_train": ["doc:a.py"], "validation": [], "test": [], "pretrain": ["code:a.py"]}}


@pytest.fixture
def inputs(tmp_path):
    """(root, files, code): three stdlib-like files and the code that reads them."""
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    files = [root / "a.py", root / "pkg" / "b.py", root / "topics.py"]
    for i, f in enumerate(files):
        f.write_text(f"'''doc {i}'''\nx = {i}\n")
    code = tmp_path / "corpus.py"
    code.write_text("def builtin_layout(): ...\n")
    return root, files, code


@pytest.fixture
def cached(inputs, tmp_path):
    """cached() -> the layout through the cache in tmp_path/cache; cached.builds counts the builds."""
    root, files, code = inputs

    def build():
        call.builds += 1
        return json.loads(json.dumps(LAYOUT))

    def call(folder=tmp_path / "cache"):
        return bc.cached_layout(build, code, files, root, corpus.SPLITS, folder)

    call.builds = 0
    call.key = bc.layout_key(code, files, root)
    call.entry = tmp_path / "cache" / f"builtin-{call.key}.layout.json"
    call.record = tmp_path / "cache" / f"builtin-{call.key}.json"
    return call


def test_written_once_then_read_back(cached, caplog):
    assert cached() == LAYOUT and cached.builds == 1
    assert json.loads(cached.record.read_text())["key"] == cached.key
    with caplog.at_level(logging.WARNING, logger="oal"):
        assert cached() == LAYOUT
    assert cached.builds == 1 and not caplog.records
    assert sorted(cached.entry.parent.iterdir()) == sorted([cached.entry, cached.record])  # no temporaries


def _edit_layout(layout, record):
    layout.write_text(layout.read_text().replace("pretraining", "PRETRAINING"))


def _other_key(layout, record):
    record.write_text(json.dumps(dict(json.loads(record.read_text()), key="fedcba9876543210")))


def _no_record(layout, record):
    record.unlink()


def _hand_written(layout, record):  # a file that matches its record but is not a layout
    layout.write_text('{"splits": {"train": "t"}}')
    record.write_text(json.dumps(dict(json.loads(record.read_text()), sha256=bc.sha256_file(layout))))


@pytest.mark.parametrize("tamper, why", [(_edit_layout, "its SHA256 is not the one recorded"),
                                         (_other_key, "its record names other inputs"),
                                         (_no_record, "no record of how it was built"),
                                         (_hand_written, "not a layout of the builtin corpus")])
def test_an_entry_that_does_not_verify_is_built_again(cached, caplog, tamper, why):
    cached()
    tamper(cached.entry, cached.record)
    with caplog.at_level(logging.WARNING, logger="oal"):
        assert cached() == LAYOUT
    assert cached.builds == 2
    (message,) = [r.getMessage() for r in caplog.records]  # one warning, naming the file and why
    assert message.startswith(f"{cached.entry}: {why}") and message.endswith("building the builtin corpus again")
    assert cached() == LAYOUT and cached.builds == 2  # written again, then read back


def test_changed_inputs_make_a_new_entry_that_replaces_the_old(cached, inputs, tmp_path):
    root, files, code = inputs
    cached()
    other = tmp_path / "cache" / "builtin-0000000000000000"  # another Python version's entry stays
    other.with_suffix(".layout.json").write_text("{}")
    other.with_suffix(".json").write_text(json.dumps({"python": "3.99.0", "key": "0" * 16, "sha256": "x"}))
    files[1].write_text("x = 'changed'\n")
    assert cached() == LAYOUT and cached.builds == 2
    new = bc.layout_key(code, files, root)
    assert new != cached.key
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted(
        [f"builtin-{new}.json", f"builtin-{new}.layout.json", other.name + ".json", other.name + ".layout.json"])


def test_a_cache_that_cannot_be_written_costs_only_time(cached, tmp_path, caplog):
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="oal"):
        assert cached(blocked / "corpus") == LAYOUT
    assert "could not cache the builtin corpus" in caplog.text


def test_inputs_without_a_key_are_built_and_not_cached(inputs, tmp_path):
    root, files, code = inputs
    layout = bc.cached_layout(lambda: LAYOUT, code, [*files, tmp_path / "outside.py"], root, corpus.SPLITS,
                              tmp_path / "cache")
    assert layout == LAYOUT and not (tmp_path / "cache").exists()


def test_the_key_follows_every_input(inputs, monkeypatch):
    """The Python version, the code, each file's bytes, name and place in the order change the key."""
    root, files, code = inputs
    key = bc.layout_key(code, files, root)
    assert key == bc.layout_key(code, list(files), root) and len(key) == 16
    changed = [bc.layout_key(code, files[:2], root), bc.layout_key(code, [files[1], files[0], files[2]], root)]
    files[2].rename(root / "renamed.py")
    changed.append(bc.layout_key(code, [*files[:2], root / "renamed.py"], root))
    (root / "renamed.py").rename(files[2])
    files[0].write_text("x = 1\n")
    changed.append(bc.layout_key(code, files, root))
    code.write_text("def builtin_layout(): return 1\n")
    changed.append(bc.layout_key(code, files, root))
    monkeypatch.setattr(sys, "version", sys.version + "+other")
    changed.append(bc.layout_key(code, files, root))
    assert len({key, *changed}) == 7


def test_the_builtin_corpus_names_every_file_it_reads():
    root, files = corpus.builtin_inputs()
    assert files[:-1] == corpus.stdlib_files()
    assert files[-1].name == "topics.py" and files[-1].parent.name == "pydoc_data"
    assert all(f.is_relative_to(root) for f in files)


def test_without_a_cache_folder_the_corpus_is_built_and_not_cached(inputs, monkeypatch):
    """With no home folder (and neither OAL_CACHE_DIR nor XDG_CACHE_HOME), `oal analyze` stopped with 'Invalid value
    for --data: no folder for oal's cache': the corpus needs no cache to be built."""
    from oal.rundir.user_cache import CacheWriteError

    def no_cache(*parts):
        raise CacheWriteError("no folder for oal's cache")

    monkeypatch.setattr(bc, "cache_root", no_cache)
    root, files, code = inputs
    assert bc.cached_layout(lambda: LAYOUT, code, files, root, corpus.SPLITS) == LAYOUT
