"""The hashes that bind a run's artefacts to their inputs: equal content gives an equal hash, any change another."""

import json
from pathlib import Path

import torch

from oal.rundir.hashes import config_hash, record_hash, sha256_file, sha256_tree, tensor_hash


def test_tensor_hash_depends_on_the_values_not_the_object():
    """Equal tensors (another copy, a non-contiguous view of the same values) hash alike; one flipped byte not."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert tensor_hash(t) == tensor_hash(t.clone()) == tensor_hash(t.T.contiguous().T)
    changed = t.clone()
    changed.view(torch.uint8)[0, 5] ^= 1  # one bit of one byte
    assert tensor_hash(changed) != tensor_hash(t)


def test_tensor_hash_binds_dtype_and_shape():
    """The same bytes read as another dtype or shape are another tensor: zeros share bytes across both."""
    z = torch.zeros(2, 3, dtype=torch.float32)
    assert tensor_hash(z) != tensor_hash(torch.zeros(2, 3, dtype=torch.int32))
    assert tensor_hash(z) != tensor_hash(torch.zeros(3, 2, dtype=torch.float32))
    assert tensor_hash(z) != tensor_hash(torch.zeros(6, dtype=torch.float32))


def test_config_hash_ignores_key_order_only():
    """A configuration is a mapping: the order its keys were written in is no part of it, a value is."""
    a = {"eps": 1e-6, "model": {"name": "m", "layers": [1, 2]}, "seed": 0}
    b = {"seed": 0, "model": {"layers": [1, 2], "name": "m"}, "eps": 1e-6}
    assert config_hash(a) == config_hash(b)
    assert config_hash(a) != config_hash({**a, "seed": 1})
    assert config_hash(a) != config_hash({**a, "model": {"name": "m", "layers": [2, 1]}})


def test_record_hash_is_that_of_the_record_as_read_back():
    """A record and its JSON round trip (tuples read back as lists, paths and integer keys as strings) bind alike, in
    any key order; a changed value does not."""
    record = {"layers": (3, 1), "path": Path("k/a.safetensors"), "method": {"eps": 1e-6, "groups": 4}, 7: "x"}
    read = json.loads(json.dumps({"7": "x", "method": {"groups": 4, "eps": 1e-6}, "path": "k/a.safetensors",
                                  "layers": [3, 1]}))
    assert record_hash(record) == record_hash(read)
    assert record_hash(record) != record_hash({**record, "method": {"eps": 1e-5, "groups": 4}})
    assert record_hash(record) != record_hash({**record, "layers": (1, 3)})


def test_sha256_tree_hashes_every_file_but_temporaries(tmp_path):
    """Every file below a folder, keyed relative to the root; *.tmp files (an atomic write in flight) are left out,
    so one does not count as a changed output. A file hashes alone; a missing path gives {}."""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "a.json").write_text("{}")
    (out / "sub" / "b.bin").write_bytes(b"\x00\x01")
    want = {"out/a.json": sha256_file(out / "a.json"), "out/sub/b.bin": sha256_file(out / "sub" / "b.bin")}
    assert sha256_tree(tmp_path, "out") == want
    (out / "a.json.tmp").write_text("partial")
    (out / "sub" / "c.tmp").write_text("partial")
    assert sha256_tree(tmp_path, "out") == want
    assert sha256_tree(tmp_path, "out/a.json") == {"out/a.json": want["out/a.json"]}
    assert sha256_tree(tmp_path, "missing") == {}
    (out / "sub" / "b.bin").write_bytes(b"\x00\x02")
    assert sha256_tree(tmp_path, "out")["out/sub/b.bin"] != want["out/sub/b.bin"]
