"""An audit of the user's cache as a machine that misbehaves meets it (see docs/reliability/user-cache.md): no home
folder, a dequantised folder under another dtype's name, a kernel whose file goes away under a running process, a
full cache while the kernel links or before `oal tune-cpu` measures, weights another user cannot read, and the CPU
identity of machines whose /proc/cpuinfo has no model name (ARM). Each case: detected, rebuilt or refused with one
line, never a wrong artefact, never a traceback. The kernel is compiled once for the file (`built_kernel`)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oal.ops import cpu_kernel, oal_attention, tuning


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("OAL_NO_TUNE", raising=False)
    tuning.reload()
    yield tmp_path / "cache"
    tuning.reload()


# ----------------------------------------------------------------------------------------------- no home folder


@pytest.fixture
def homeless(monkeypatch):
    """What `env -i` or `docker run --user 54321` gives: no HOME and a user id without a passwd entry, where
    pathlib's home() raises RuntimeError."""
    for name in ("OAL_CACHE_DIR", "XDG_CACHE_HOME", "HOME", "OAL_NO_TUNE"):
        monkeypatch.delenv(name, raising=False)

    def no_home(cls=None):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", classmethod(no_home))
    monkeypatch.setattr(Path, "expanduser", lambda self: no_home() if str(self).startswith("~") else self)
    for name, value in (("_LIB", None), ("_TRIED", False), ("_STATUS", "")):  # this test's kernel load, undone after
        monkeypatch.setattr(cpu_kernel, name, value)
    tuning.reload()
    yield
    tuning.reload()


def test_without_a_home_folder_the_operator_runs_and_commands_say_one_line(homeless, caplog):
    """Every chunked CPU call raised RuntimeError 'Could not determine home directory.' (the tuning lookup asks for
    the cache's path), `oal fetch` printed a traceback and `oal analyze` blamed --model. Now the operator runs its
    fixed settings with one warning, and a command that must write the cache says one line naming OAL_CACHE_DIR."""
    from test_ops_tuning import _make
    from typer.testing import CliRunner

    from oal.cli import load_commands

    q, k, v, groups, factor = _make(300)
    with caplog.at_level(logging.WARNING, logger="oal"), torch.no_grad():
        for _ in range(2):
            got = oal_attention(q.float(), k.float(), v.float(), groups, factor.float(), backend="chunked")
    want = oal_attention(q, k, v, groups, factor, backend="reference")
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    assert tuning.source(torch.float32) == "fixed"
    said = [r.getMessage() for r in caplog.records if "OAL_CACHE_DIR" in r.getMessage()]
    assert sorted(m.split(";")[-1].strip() for m in said) == [  # once each: the settings, the kernel
        "the chunked operator runs its torch path", "the operator runs its fixed settings"], said
    for args in (["fetch", "smollm2-135m"], ["tune-cpu"]):
        res = CliRunner().invoke(load_commands(), args)
        lines = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
        assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.output, res.output
        assert "no folder for oal's cache" in lines[0] and "set OAL_CACHE_DIR" in lines[0]


# ----------------------------------------------------------------------------------------------- GGUF folders


def test_a_folder_under_another_dtypes_name_is_written_again(cache, tiny_gguf, caplog):
    """A float32 folder copied (or renamed) to the bfloat16 name was used as the bfloat16 model: its record names
    the GGUF's SHA256, which matched, and the dtype, which nobody checked."""
    from oal.models.gguf import GGUF_RECORD, materialize_gguf

    f32 = materialize_gguf(tiny_gguf, torch.float32)
    bf16 = f32.with_name(f32.name.replace("float32", "bfloat16"))
    shutil.copytree(f32, bf16)
    with caplog.at_level(logging.WARNING, logger="oal"):
        assert materialize_gguf(tiny_gguf, torch.bfloat16) == bf16
    assert json.loads((bf16 / "config.json").read_text())[GGUF_RECORD]["dtype"] == "bfloat16"
    warned = [r.getMessage() for r in caplog.records if "writing it again" in r.getMessage()]
    assert len(warned) == 1 and "dtype 'float32', not 'bfloat16'" in warned[0]


def test_a_dequantised_folder_is_readable_by_other_users(cache, tiny_gguf):
    """safetensors writes model.safetensors 0600: in a cache that one user filled (`oal fetch` by an admin into a
    shared OAL_CACHE_DIR) every other user found the weights unreadable, and tried to write the folder again."""
    from oal.models.gguf import materialize_gguf

    folder = materialize_gguf(tiny_gguf)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in folder.iterdir()}
    assert set(modes.values()) == {"0o644"}, modes


# ----------------------------------------------------------------------------------------------- the fused kernel


needs_compiler = pytest.mark.skipif(cpu_kernel._compiler() is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def built_kernel(tmp_path_factory) -> Path:
    """The kernel, compiled once for this file."""
    return cpu_kernel.build(tmp_path_factory.mktemp("built") / "kernels")


@pytest.fixture
def fresh_load(monkeypatch):
    """This test's load of the kernel, undone after it."""
    monkeypatch.delenv("OAL_CPU_KERNEL", raising=False)
    for name, value in (("_LIB", None), ("_TRIED", False), ("_STATUS", ""), ("_SHA", "")):
        monkeypatch.setattr(cpu_kernel, name, value, raising=False)


@needs_compiler
def test_a_run_records_the_kernel_it_loaded_after_its_file_is_gone(built_kernel, cache, fresh_load):
    """The setup record hashed the library's path when it was written, not the library loaded: a cache cleared
    under a long run (`rm -rf ~/.cache/oal` between the seeds of `oal run --seeds`) failed the next setup with
    'No such file or directory'."""
    from oal.pipeline.base import operator_record
    from oal.rundir.hashes import sha256_file

    (cache / "kernels").mkdir(parents=True)
    for p in (built_kernel, built_kernel.with_suffix(".json")):
        shutil.copy2(p, cache / "kernels" / p.name)
    assert cpu_kernel.available()
    shutil.rmtree(cache)
    record = operator_record("float32", torch.device("cpu"))["cpu_kernel"]
    assert record["runs"] and record["sha256"] == sha256_file(built_kernel)


def _fake_compiler(tmp_path: Path, stderr: str) -> Path:
    """A compiler that fails as g++ does when the cache's disk is full at the link."""
    script = tmp_path / "fake-c++"
    script.write_text('#!/bin/sh\nif [ "$1" = "--version" ]; then echo "fake-c++ 1.0"; exit 0; fi\n'
                      f"printf '%s' '{stderr}' >&2\nexit 1\n")
    script.chmod(0o755)
    return script


def test_a_full_cache_at_the_link_is_named_not_collect2(tmp_path, monkeypatch):
    """With the kernels folder on a full disk the warning read 'c++ failed on readout.cpp: collect2: error: ld
    returned 1 exit status' (what g++ printed last); the linker's line before it says why, and the folder is named."""
    full = "/usr/bin/ld: final link failed: No space left on device\ncollect2: error: ld returned 1 exit status\n"
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path, full)))
    folder = tmp_path / "kernels"
    with pytest.raises(RuntimeError) as info:
        cpu_kernel.build(folder)
    assert "final link failed: No space left on device" in str(info.value) and str(folder) in str(info.value)
    assert list(folder.iterdir()) == []  # nothing half-written
    errors = "readout.cpp:12:3: error: x was not declared in this scope\n"  # a compile error stays the one named
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path, errors)))
    with pytest.raises(RuntimeError, match="error: x was not declared"):
        cpu_kernel.build(folder)


_GRAVITON2 = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp ssbs
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x3
CPU part\t: 0xd0c
CPU revision\t: 1
"""
_GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm jscvt fcma lrcpc dcpop \
sha3 sm3 sm4 asimddp sha512 sve asimdfhm dit uscat ilrcpc flagm ssbs paca pacg dcpodp svei8mm svebf16 i8mm bf16 dgh rng
CPU implementer\t: 0x41
CPU architecture: 8
CPU variant\t: 0x1
CPU part\t: 0xd40
CPU revision\t: 1
"""


def test_arm_cpus_get_kernels_of_their_own(tmp_path, monkeypatch):
    """ARM's /proc/cpuinfo has no 'model name' or 'flags': the build key fell back to platform.processor()
    ('aarch64' on both), so a Graviton3 build (-march=native: SVE) in a home folder shared with Graviton2 nodes was
    loaded there, to die of SIGILL. The key now holds the CPU part and features; x86 keys are as before."""
    import io

    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path, "")))
    keys = []
    for text in (_GRAVITON2, _GRAVITON3, _GRAVITON3):
        monkeypatch.setattr(cpu_kernel, "open", lambda path, *a, text=text, **k: io.StringIO(text), raising=False)
        keys.append(cpu_kernel._key(cpu_kernel._compiler()))
    assert keys[0] != keys[1] and keys[1] == keys[2]


# ----------------------------------------------------------------------------------------------- tuning entries


_TUNE_WITHOUT_ROOM = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, as a full disk's
resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))
from typer.testing import CliRunner
from oal.cli import load_commands
from oal.ops import autotune
def measured(*args, **kwargs):
    print("MEASURED")
    sys.exit(3)
autotune.tune = measured
res = CliRunner().invoke(load_commands(), ["tune-cpu", "--dtypes", "float32"])
print(res.output)
sys.exit(res.exit_code)
"""


def test_tune_cpu_refuses_a_cache_without_room_before_measuring(cache):
    """`oal tune-cpu` on a full disk measured for minutes, then failed to store what it measured: its check before
    measuring made an empty file, which a full disk still makes. It now writes a few KB first (here a file size
    limit stands in for the full disk: the same failed write, with EFBIG)."""
    env = {**os.environ, "OAL_CACHE_DIR": str(cache), "OAL_CPU_KERNEL": "0"}
    res = subprocess.run([sys.executable, "-c", _TUNE_WITHOUT_ROOM], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 2 and "MEASURED" not in res.stdout, res.stdout + res.stderr
    assert "Error: cannot write the tuning entries into the cache folder" in res.stdout
    assert [p.name for p in cache.iterdir()] == []  # the probe leaves nothing
