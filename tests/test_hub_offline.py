"""The hub path as a user meets it without the hub: models and data sets in a Hugging Face cache (HF_HUB_CACHE) built
here as huggingface_hub lays it out (blobs named by SHA256, snapshots/<commit>/ of symlinks, refs/main), and the
online path with only the network call replaced."""

from __future__ import annotations

import hashlib
import os
import shutil

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from oal.data import wikitext, zeroshot
from oal.data.byte_tokenizer import byte_tokenizer
from oal.data.wikitext import REVISION, load_wikitext
from oal.models import registry
from oal.models.folders import ModelUnavailableError


def _parquet():
    """(pyarrow, pyarrow.parquet), or a skip: datasets brings pyarrow, and the GPU machine has no datasets."""
    pytest.importorskip("pyarrow")
    import pyarrow
    import pyarrow.parquet

    return pyarrow, pyarrow.parquet

QWEN = "Qwen/Qwen2.5-0.5B"
PIN = registry.HUB_MODELS[QWEN]["revision"]
OTHER = "a" * 40


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty HF hub cache (and datasets cache, where datasets is installed) under tmp_path, offline."""
    import huggingface_hub.constants as hc

    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    try:
        import datasets
    except ImportError:  # the GPU machine: only the model tests run there (the data ones skip on pyarrow)
        return cache
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf" / "datasets")
    return cache


def put_snapshot(cache, repo_id, revision, src, repo_type="model", files=None, ref="main"):
    """Copy files of `src` into the cache as huggingface_hub does: blobs by SHA256, snapshot symlinks, refs/<ref>."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / revision
    for rel in files or [p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file()]:
        data = (src / rel).read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, (snap / rel).parent), snap / rel)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(revision)
    return snap


# ----------------------------------------------------------------------------------------------- models


@pytest.fixture
def tiny_qwen(tmp_path, monkeypatch):
    """A tiny Qwen2 folder, and the registry's Qwen pin pointed at its shape and weight hash."""
    src = tmp_path / "tiny"
    cfg = Qwen2Config(vocab_size=259, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(src)
    byte_tokenizer().save_pretrained(src)
    w = src / "model.safetensors"
    spec = {**registry.HUB_MODELS[QWEN],
            "base_config": {"model_type": "qwen2", "num_hidden_layers": 3, "hidden_size": 64,
                            "eos_token_id": cfg.eos_token_id},
            "weights": {"model.safetensors": (w.stat().st_size, hashlib.sha256(w.read_bytes()).hexdigest())}}
    monkeypatch.setitem(registry.HUB_MODELS, QWEN, spec)
    return src


def test_pinned_model_loads_from_the_cache_at_its_revision(hub, tiny_qwen):
    put_snapshot(hub, QWEN, PIN, tiny_qwen, ref=None)
    put_snapshot(hub, QWEN, OTHER, tiny_qwen)  # refs/main points elsewhere: the pin is still what loads
    _, _, prov = registry.load_model(QWEN)
    assert prov["source"] == "hub" and prov["identified_as"] == QWEN and prov["revision"] == PIN
    assert prov["path"].endswith(f"snapshots/{PIN}")
    assert prov["sha256"]["model.safetensors"] == registry.HUB_MODELS[QWEN]["weights"]["model.safetensors"][1]


def test_another_cached_revision_names_the_pin_and_the_hf_command(hub, tiny_qwen):
    put_snapshot(hub, QWEN, OTHER, tiny_qwen)
    with pytest.raises(ModelUnavailableError) as err:
        registry.load_model(QWEN)
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and f"holds revision {OTHER}" in msg
    assert f"`hf download {QWEN} --revision {PIN} --include '*.json' --include '*.safetensors'" in msg


def test_gated_model_absent_says_how_to_get_access(hub):
    with pytest.raises(ModelUnavailableError, match=r"license.*gated.*hf auth login.*hf download "
                                                    r"meta-llama/Llama-3.2-1B --revision 4e20de36"):
        registry.load_model("meta-llama/Llama-3.2-1B")


def test_snapshot_without_its_weight_file_names_it(hub, tiny_qwen):
    put_snapshot(hub, QWEN, PIN, tiny_qwen, files=["config.json", "tokenizer.json", "tokenizer_config.json"])
    with pytest.raises(ValueError, match=r"lacks model\.safetensors, an incomplete download; .*hf download"):
        registry.load_model(QWEN)


def test_snapshot_with_pickle_weights_or_other_weights_is_refused(hub, tiny_qwen):
    snap = put_snapshot(hub, QWEN, PIN, tiny_qwen, files=["config.json", "tokenizer.json", "tokenizer_config.json"])
    (snap / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ValueError, match=r"pickle weights only \(pytorch_model\.bin\)"):
        registry.load_model(QWEN)
    (snap / "pytorch_model.bin").unlink()
    torch.manual_seed(1)
    Qwen2ForCausalLM(Qwen2Config.from_pretrained(tiny_qwen)).save_pretrained(snap)  # same shape, other weights
    with pytest.raises(ValueError, match=r"model\.safetensors\.sha256"):
        registry.load_model(QWEN)


def test_unpinned_hub_id_needs_a_revision_and_records_the_commit(hub, tiny_qwen):
    put_snapshot(hub, "org/other-model", OTHER, tiny_qwen)
    with pytest.raises(ValueError, match="download another hub model to a folder"):
        registry.load_model("org/other-model")
    _, _, prov = registry.load_model("org/other-model", revision="main")
    assert prov["revision"] == OTHER  # the commit main resolved to, not the branch name


def test_online_download_asks_for_the_pin_and_safetensors_only(hub, tiny_qwen, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(put_snapshot(hub, repo_id, kw["revision"], tiny_qwen))

    monkeypatch.setattr(registry, "hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    registry.load_model(QWEN)
    (repo_id, kw), = calls
    assert repo_id == QWEN and kw["revision"] == PIN and kw["local_files_only"] is False
    assert "*.safetensors" in kw["allow_patterns"] and not any("bin" in p or "pt" in p for p in kw["allow_patterns"])

    def failing(repo_id, **kw):
        raise OSError("401 Client Error.\n\nCannot access gated repo for url https://huggingface.co/...")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(ModelUnavailableError) as err:
        registry.load_model("meta-llama/Llama-3.2-1B")
    assert len(str(err.value).splitlines()) == 1 and "download failed (OSError: 401 Client Error.)" in str(err.value)


# ----------------------------------------------------------------------------------------------- WikiText

TEXT = {"train": [" = A = \n", " alpha beta . \n", ""] * 4, "validation": [" valid . \n"], "test": [" test . \n"]}


@pytest.fixture
def wt_src(tmp_path):
    """Both WikiText configs in the hub repository's layout (wikitext-103 train in two shards)."""
    src = tmp_path / "wt"
    for cfg in wikitext.CONFIGS:
        for split, rows in TEXT.items():
            shards = [rows[:6], rows[6:]] if (cfg.startswith("wikitext-103") and split == "train") else [rows]
            for i, part in enumerate(shards):
                f = src / cfg / f"{split}-{i:05d}-of-{len(shards):05d}.parquet"
                f.parent.mkdir(parents=True, exist_ok=True)
                pa, pq = _parquet()
                pq.write_table(pa.table({"text": part}), f)
    return src


def test_wikitext_reads_the_hf_cache_at_the_pin_and_records_file_hashes(hub, wt_src):
    snap = put_snapshot(hub, wikitext.DATASET_ID, REVISION, wt_src, repo_type="dataset")
    for cfg in wikitext.CONFIGS:
        corpus = load_wikitext(cfg)
        assert corpus.splits["train"] == "\n\n".join(TEXT["train"])
        assert corpus.meta["source"] == "hub" and corpus.meta["revision"] == REVISION
        f = f"{cfg}/test-00000-of-00001.parquet"
        assert corpus.meta["files_sha256"][f] == hashlib.sha256((snap / f).read_bytes()).hexdigest()


def test_wikitext_missing_shard_or_damaged_blob_is_named(hub, wt_src):
    snap = put_snapshot(hub, wikitext.DATASET_ID, REVISION, wt_src, repo_type="dataset")
    (snap / "wikitext-103-raw-v1" / "train-00001-of-00002.parquet").unlink()
    with pytest.raises(ValueError, match=r"lacks shard\(s\) \[1\] of 2 of train.*hf download Salesforce/wikitext"):
        load_wikitext("wikitext-103-raw-v1")
    with pytest.raises(ValueError, match=r"lacks shard\(s\) \[1\] of 2"):  # a local copy is checked the same way
        wikitext.write_manifest(snap.parent / REVISION, ["wikitext-103-raw-v1"])
    blob = (snap / "wikitext-2-raw-v1" / "test-00000-of-00001.parquet").resolve()
    blob.write_bytes(blob.read_bytes() + b"x")
    with pytest.raises(ValueError, match=r"test-00000-of-00001\.parquet is damaged"):
        load_wikitext("wikitext-2-raw-v1")


def test_wikitext_other_revision_is_refused_naming_the_pin(hub, wt_src):
    put_snapshot(hub, wikitext.DATASET_ID, OTHER, wt_src, repo_type="dataset")
    with pytest.raises(ValueError) as err:
        load_wikitext("wikitext-2-raw-v1")
    msg = str(err.value)
    assert len(msg.splitlines()) == 1 and f"holds revision {OTHER}" in msg and "--data-dir" in msg
    assert (f"`hf download Salesforce/wikitext --repo-type dataset --revision {REVISION} "
            "--include 'wikitext-2-raw-v1/*.parquet'") in msg


def _datasets_cache(hub, wt_src, revision):
    """What an online `load_dataset("Salesforce/wikitext", "wikitext-2-raw-v1", revision=...)` leaves in datasets'
    own cache (<namespace>___<name>/<config>/0.0.0/<commit>/: arrow files and dataset_info.json)."""
    import json

    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet

    files = {s: [str(wt_src / "wikitext-2-raw-v1" / f"{s}-00000-of-00001.parquet")] for s in TEXT}
    builder = Parquet(cache_dir=str(hub.parent / "build"), dataset_name="wikitext", hash=revision, data_files=files)
    builder.download_and_prepare()
    out = datasets.config.HF_DATASETS_CACHE / "Salesforce___wikitext" / "wikitext-2-raw-v1" / "0.0.0" / revision
    shutil.copytree(builder.cache_dir, out)
    info = json.loads((out / "dataset_info.json").read_text())
    (out / "dataset_info.json").write_text(json.dumps({**info, "config_name": "wikitext-2-raw-v1"}))


def test_datasets_cache_is_used_only_at_the_pin(hub, wt_src):
    _datasets_cache(hub, wt_src, OTHER)  # offline, datasets would hand this one out for any revision
    with pytest.raises(ValueError, match=f"datasets cache holds revision {OTHER}, not the pinned {REVISION}"):
        load_wikitext("wikitext-2-raw-v1")
    shutil.rmtree(hub.parent / "datasets")
    _datasets_cache(hub, wt_src, REVISION)
    corpus = load_wikitext("wikitext-2-raw-v1")
    assert corpus.splits["test"] == "\n\n".join(TEXT["test"]) and corpus.meta["source"] == "datasets-cache"


def test_wikitext_online_downloads_the_pinned_parquet_files_only(hub, wt_src, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_snapshot_download(repo_id, **kw):
        calls.append((repo_id, kw))
        return str(put_snapshot(hub, repo_id, kw["revision"], wt_src, repo_type="dataset"))

    monkeypatch.setattr(wikitext, "hub_reachable", lambda: True)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    load_wikitext("wikitext-103-raw-v1")
    assert calls == [("Salesforce/wikitext", {"repo_type": "dataset", "revision": REVISION, "local_files_only": False,
                                              "allow_patterns": ["wikitext-103-raw-v1/*.parquet"]})]


def test_data_dir_errors_name_the_option_and_the_layout(tmp_path, wt_src):
    with pytest.raises(ValueError, match=r"\(--data-dir\) has no manifest\.json.*<config>/<split>-0000i-of-0000n"):
        load_wikitext("wikitext-2-raw-v1", wt_src)
    shutil.rmtree(wt_src / "wikitext-2-raw-v1")
    wikitext.write_manifest(wt_src)
    with pytest.raises(ValueError, match=r"config 'wikitext-2-raw-v1' not listed .*put wikitext-2-raw-v1/ in"):
        load_wikitext("wikitext-2-raw-v1", wt_src)


def test_hub_probe_goes_where_the_client_goes_through_a_proxy(monkeypatch):
    seen = []

    def connect(address, timeout):
        seen.append(address)
        raise OSError("refused")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    monkeypatch.setattr(wikitext.socket, "create_connection", connect)
    assert wikitext.hub_reachable(timeout=1) is False
    assert seen == [("proxy.example", 3128)]


# ----------------------------------------------------------------------------------------------- zero-shot


def _task_file(tmp_path, task, rows):
    spec = zeroshot.SOURCES[task]
    f = tmp_path / "zs" / spec.file
    f.parent.mkdir(parents=True, exist_ok=True)
    pa, pq = _parquet()
    pq.write_table(pa.Table.from_pylist(rows), f)
    return f.parent.parent if "/" in spec.file else f.parent


def test_zeroshot_from_the_cache_checked_against_the_blob_and_revision(hub, tmp_path):
    spec = zeroshot.SOURCES["piqa"]
    src = _task_file(tmp_path, "piqa", [{"goal": "g", "sol1": "a", "sol2": "b", "label": 0}] * spec.rows)
    put_snapshot(hub, spec.dataset_id, OTHER, src, repo_type="dataset")
    with pytest.raises(zeroshot.DataUnavailable, match=f"the cache holds {OTHER[:8]}"):
        zeroshot.fetch_task("piqa")
    snap = put_snapshot(hub, spec.dataset_id, spec.revision, src, repo_type="dataset")
    got = zeroshot.fetch_task("piqa", limit=3)
    assert got.provenance["source"] == "hub" and got.provenance["rows"] == spec.rows and len(got.rows) == 3
    blob = (snap / spec.file).resolve()  # PIQA has no published hash: the cache's own name for the file checks it
    blob.write_bytes(blob.read_bytes() + b"x")
    with pytest.raises(ValueError, match="SHA256 mismatch.*its cache blob name"):
        zeroshot.fetch_task("piqa")


def test_zeroshot_dir_without_a_task_names_the_file_and_tasks(tmp_path):
    spec = zeroshot.SOURCES["piqa"]
    d = tmp_path / "zsdir"
    f = d / "piqa" / spec.file
    f.parent.mkdir(parents=True)
    pa, pq = _parquet()
    pq.write_table(pa.Table.from_pylist([{"goal": "g", "sol1": "a", "sol2": "b", "label": 0}] * spec.rows), f)
    with pytest.raises(ValueError, match=r"\(--zeroshot-dir\) has no manifest\.json"):
        zeroshot.fetch_task("piqa", data_dir=d)
    zeroshot.write_manifest(d)
    with pytest.raises(ValueError, match=r"'arc_easy' not listed.*holds \['piqa'\].*ARC-Easy/test-00000-of-00001"
                                         r"\.parquet.*--tasks"):
        zeroshot.fetch_task("arc_easy", data_dir=d)
