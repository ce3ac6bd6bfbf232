"""WikiText from a local copy in the hub's on-disk layout, verified by its manifest; offline hub fails fast."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import ByT5Tokenizer

from oal.data import BlockSet, Corpus, SplitPlan, load_corpus, plan_blocks
from oal.data.wikitext import REVISION, load_wikitext, verify_manifest, write_manifest

ENTRIES = {
    "train": ["", " = Title = \n", "", " First paragraph about things . \n", " Second one . \n"] * 6,
    "validation": ["", " = Valid = \n", " Some validation text . \n"],
    "test": ["", " = Test = \n", " Held-out words . \n", ""],
}


def _write(path, texts):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"text": texts}), path)


@pytest.fixture
def wt_dir(tmp_path):
    """wikitext-2-raw-v1 with one shard per split; wikitext-103-raw-v1 with two train shards."""
    for s, texts in ENTRIES.items():
        _write(tmp_path / "wikitext-2-raw-v1" / f"{s}-00000-of-00001.parquet", texts)
    half = len(ENTRIES["train"]) // 2
    _write(tmp_path / "wikitext-103-raw-v1" / "train-00000-of-00002.parquet", ENTRIES["train"][:half])
    _write(tmp_path / "wikitext-103-raw-v1" / "train-00001-of-00002.parquet", ENTRIES["train"][half:] + ["tail"])
    for s in ("validation", "test"):
        _write(tmp_path / "wikitext-103-raw-v1" / f"{s}-00000-of-00001.parquet", ENTRIES[s])
    write_manifest(tmp_path)
    return tmp_path


def test_local_copy_joins_entries_in_order(wt_dir):
    c = load_wikitext("wikitext-2-raw-v1", wt_dir)
    for s, texts in ENTRIES.items():
        assert c.splits[s] == "\n\n".join(texts)
    assert c.meta["revision"] == REVISION and c.meta["dataset_id"] == "Salesforce/wikitext"
    assert set(c.meta["files_sha256"]) == {f"wikitext-2-raw-v1/{s}-00000-of-00001.parquet" for s in ENTRIES}
    big = load_corpus("wikitext-103-raw-v1", data_dir=wt_dir)
    assert big.splits["train"] == "\n\n".join(ENTRIES["train"] + ["tail"])  # shards in order


def test_sha_mismatch_is_an_error(wt_dir):
    _write(wt_dir / "wikitext-2-raw-v1" / "test-00000-of-00001.parquet", ["tampered"])
    with pytest.raises(ValueError, match="SHA256 mismatch.*test-00000"):
        load_wikitext("wikitext-2-raw-v1", wt_dir)
    load_wikitext("wikitext-103-raw-v1", wt_dir)  # the other config is untouched and still verifies


def test_wrong_revision_dataset_or_config(wt_dir):
    manifest = json.loads((wt_dir / "manifest.json").read_text())
    with pytest.raises(ValueError, match="revision"):
        load_wikitext("wikitext-2-raw-v1", wt_dir, revision="0" * 40)
    (wt_dir / "manifest.json").write_text(json.dumps({**manifest, "configs": ["wikitext-103-raw-v1"]}))
    with pytest.raises(ValueError, match="config 'wikitext-2-raw-v1' not listed"):
        verify_manifest(wt_dir, "wikitext-2-raw-v1")
    (wt_dir / "manifest.json").write_text(json.dumps({**manifest, "dataset_id": "someone/else"}))
    with pytest.raises(ValueError, match="dataset_id"):
        verify_manifest(wt_dir, "wikitext-2-raw-v1")
    with pytest.raises(ValueError, match="config"):
        load_wikitext("wikitext-3", wt_dir)


def test_unlisted_file_and_missing_manifest(wt_dir, tmp_path_factory):
    _write(wt_dir / "wikitext-2-raw-v1" / "train-00001-of-00001.parquet", ["extra"])
    with pytest.raises(ValueError, match="not listed"):
        load_wikitext("wikitext-2-raw-v1", wt_dir)
    bare = tmp_path_factory.mktemp("bare")
    with pytest.raises(ValueError, match="manifest.json"):
        load_wikitext("wikitext-2-raw-v1", bare)


def test_folder_with_single_config_manifest(tmp_path):
    for s, texts in ENTRIES.items():
        _write(tmp_path / "wikitext-2-raw-v1" / f"{s}-00000-of-00001.parquet", texts)
    write_manifest(tmp_path, ["wikitext-2-raw-v1"])
    assert load_corpus(tmp_path).name == "wikitext-2-raw-v1"


def test_offline_hub_fails_fast_with_clear_message(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    import huggingface_hub.constants as hc  # the parquet files are looked up in the hub cache first

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ValueError, match="data_dir"):
        load_wikitext("wikitext-2-raw-v1")


def test_plan_blocks_loads_named_corpora(wt_dir):
    tok = ByT5Tokenizer(extra_ids=0)
    run = Corpus("run", {"train": "r" * 48 + "0123456789abcdef" + "z" * 10, "validation": "v", "test": "t"})
    plan = SplitPlan(
        grouping=BlockSet("train", 8, [0, 1], corpus="wikitext-2-raw-v1"),
        calib_train=BlockSet("train", 16, [1], corpus="wikitext-2-raw-v1"),
        calib_val=BlockSet("train", 16, [2], corpus="wikitext-2-raw-v1"),
        fidelity=BlockSet("train", 16, [3]),
        adapt_train=BlockSet("train", 16, [0], corpus="wikitext-103-raw-v1"),
        val=BlockSet("validation", 16, [0], corpus="wikitext-2-raw-v1"),
        test=BlockSet("test", 16, [0], corpus="wikitext-2-raw-v1", through_end=True),
    )
    blocks = plan_blocks(run, tok, plan, data_dir=str(wt_dir))
    wt2_train = "\n\n".join(ENTRIES["train"]).encode()
    assert blocks["grouping"].reshape(-1).tolist() == [b + 3 for b in wt2_train[:16]]
    assert blocks["calib_train"][0].tolist() == [b + 3 for b in wt2_train[16:32]]
    assert blocks["fidelity"][0].tolist() == [b + 3 for b in b"0123456789abcdef"]
    n_test = len("\n\n".join(ENTRIES["test"]).encode()) // 16
    assert blocks["test"].shape == (n_test, 16)


def test_hub_probe_gives_up_on_a_hanging_resolver(monkeypatch):
    import threading

    from oal.data import wikitext

    release = threading.Event()
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def hanging_connect(*args, **kwargs):
        release.wait(30)
        raise OSError("resolver gave up")

    monkeypatch.setattr(wikitext.socket, "create_connection", hanging_connect)
    try:
        assert wikitext.hub_reachable(timeout=0.2) is False
    finally:
        release.set()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert wikitext.hub_reachable() is False
