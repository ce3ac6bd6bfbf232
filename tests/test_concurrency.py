"""Two oal processes on one thing at once, and processes killed part-way: what the next command finds.

Other processes are real subprocesses synchronised through a pipe, or are simulated by holding their lock; nothing
here waits on the clock.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _runs import LAYERS, random_methods
from _tiny import save_tiny_llama, tiny_model
from transformers import AutoTokenizer

import oal
from oal.artefact.export import save_converted
from oal.models.convert import convert
from oal.rundir.files import remove
from oal.rundir.lock import own_dir

# an export in another process: it fills its temporary folder, says where it is, then waits to be killed
_WRITER = """
import sys
from oal.rundir.lock import locked_atomic_dir
with locked_atomic_dir(sys.argv[1]) as tmp:
    (tmp / "model.safetensors").write_bytes(b"half")
    print(tmp, flush=True)
    sys.stdin.read()
"""


def _held_by_another(folder: Path) -> int:
    """An fd holding `folder`'s flock, as a running writer holds its temporary folder (flock is per open file, so
    this conflicts with the code under test as another process would)."""
    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


@pytest.fixture(scope="module")
def converted():
    model = tiny_model("qwen2", 300)
    cfg = model.config
    return convert(model, LAYERS, random_methods("oal", cfg.num_attention_heads, cfg.num_key_value_heads, 8, seed=3))


def _locked_atomic_dir(path):
    from oal.rundir.lock import locked_atomic_dir

    return locked_atomic_dir(path)


def test_export_removes_the_temporary_folders_a_killed_export_left(tmp_path, converted):
    to = tmp_path / "converted"
    killed = tmp_path / ".converted.k1ll3d_x.tmp"  # atomic_dir's name: 8 random characters
    killed.mkdir()
    (killed / "model.safetensors").write_bytes(b"half")
    running = tmp_path / ".converted.running0.tmp"
    running.mkdir()
    others = [tmp_path / ".other.abcdefgh.tmp", tmp_path / ".converted.notes.tmp"]  # not this export's to judge
    for p in others:
        p.mkdir()
    fd = _held_by_another(running)
    try:
        save_converted(converted, to)
    finally:
        os.close(fd)
    assert not killed.exists()
    assert running.is_dir() and all(p.is_dir() for p in others)
    oal.load(to)


def test_a_running_export_keeps_its_folder_and_a_killed_one_loses_it(tmp_path):
    to = tmp_path / "converted"
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(to)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        theirs = Path(proc.stdout.readline().strip())
        assert theirs.is_dir()
        with _locked_atomic_dir(to) as tmp:  # a second export to the same folder meanwhile
            (tmp / "config.json").write_text("{}")
        assert theirs.is_dir()  # still being written: kept
    finally:
        proc.kill()
        proc.wait()
    assert theirs.is_dir()  # SIGKILL: no cleanup ran in that process ...
    with _locked_atomic_dir(to) as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["converted"]  # ... the next export removed it


def test_an_export_does_not_pass_on_the_options_of_the_load_that_made_it(tmp_path, converted):
    """transformers saves the tokenizer's load arguments into tokenizer_config.json: `local_files_only: true`
    (offline mode) would follow the export to a machine that is online."""
    tok = AutoTokenizer.from_pretrained(save_tiny_llama(tmp_path / "base"), local_files_only=True)
    assert tok.init_kwargs.get("local_files_only") is True
    to = save_converted(converted, tmp_path / "converted", tok)
    saved = json.loads((to / "tokenizer_config.json").read_text())
    assert "local_files_only" not in saved and "is_local" not in saved
    assert saved["tokenizer_class"] == "ByT5Tokenizer"
    oal.load(to)  # the manifest names the tokenizer config as written
    assert AutoTokenizer.from_pretrained(to).vocab_size == tok.vocab_size
    from oal.artefact.folder_io import save_tokenizer

    save_tokenizer(tok, tmp_path / "softmax", None)  # what the softmax arm's export writes it with
    assert "local_files_only" not in json.loads((tmp_path / "softmax" / "tokenizer_config.json").read_text())


def test_a_run_directory_keeps_no_empty_checkpoints_folder(tmp_path):
    run = tmp_path / "run"
    with own_dir(run):
        ckpt = run / ".oal" / "checkpoints" / "oal"
        ckpt.mkdir(parents=True)
        remove(ckpt)  # as the adapt stage does once the adapter is saved
    assert (run / ".oal").is_dir() and not (run / ".oal" / "checkpoints").exists()
    with own_dir(run):  # an adaptation that stopped keeps its checkpoint, to resume from
        (run / ".oal" / "checkpoints" / "global").mkdir(parents=True)
    assert (run / ".oal" / "checkpoints" / "global").is_dir()
