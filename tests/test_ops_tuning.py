"""CPU settings tuned to the machine (`oal.ops.tuning`): the cache, the switches, and exactness under any setting."""

from __future__ import annotations

import json

import pytest
import torch

import oal.ops.chunked as chunked
from oal.ops import autotune, oal_attention, tuning, workers
from oal.ops.tuning import Settings

F64 = torch.float64
TINY = dict(hq=4, hkv=2, d=8, g=3)


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """Every test gets its own cache folder, tuning on, and forgets what an earlier test's lookups read."""
    monkeypatch.delenv("OAL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("OAL_NO_TUNE", raising=False)
    tuning.reload()
    yield tmp_path / "cache"
    tuning.reload()


def test_cache_lives_in_xdg_cache_home(cache_home):
    assert tuning.cache_path() == cache_home / "oal" / "cpu_tuning.json"


def test_tune_writes_the_cache_and_the_operator_reads_it(cache_home, monkeypatch):
    timed = []
    real = autotune._time
    monkeypatch.setattr(autotune, "_time", lambda s, *a: timed.append(s) or real(s, *a))
    res = autotune.tune([torch.float32], threads=2, n=200, repeats=1, shape=TINY, contention=False)["float32"]
    grid = len(set(timed))  # the pruned grid, each candidate once, then the grid's winner against the defaults
    best, default = Settings(**res["settings"]), chunked.fixed_settings(torch.float32)
    confirm = set(timed[grid:])  # empty when the defaults won the grid; the defaults may win the confirmation
    assert grid >= 6 and len(set(timed[:grid])) == grid
    assert not confirm or (default in confirm and len(confirm) == 2 and (best == default or best in confirm))
    files = sorted((cache_home / "oal").iterdir())  # renamed into place, no temporary left; the lock of its merges
    assert [f.name for f in files] == [".cpu_tuning.json.lock", "cpu_tuning.json"]
    entry = json.loads(files[1].read_text())["entries"][tuning.machine_key(torch.float32, 2)]
    assert entry["torch"] == torch.__version__ and entry["settings"] == res["settings"]
    assert entry["revision"] == tuning.OPERATOR_REVISION
    assert entry["default_time_s"] is not None and entry["tuning_s"] > 0 and entry["cpu"]["model"]
    assert tuning.settings_for(torch.float32, 2) == best
    assert tuning.settings_for(torch.float32, 3) is None and tuning.settings_for(torch.bfloat16, 2) is None
    timed.clear()
    cached = autotune.tune([torch.float32], threads=2, n=200, repeats=1, shape=TINY)["float32"]
    assert cached == entry | {"cached": True} and not timed  # reused, and said so


def test_an_entry_of_another_length_is_measured_again(monkeypatch):
    """`oal tune-cpu --length 4096` after a tuning at N=256 measured nothing and printed N=256's choice and "tuning
    took 10 s"; now it measures at 4096, and a reused entry is printed as cached."""
    from typer.testing import CliRunner

    from oal.cli import load_commands

    timed = []
    monkeypatch.setattr(autotune, "_time", lambda s, inputs, *a: timed.append(inputs[0].shape[2]) or 1.0 / s.chunk)
    first = autotune.tune([torch.float32], threads=2, n=200, repeats=1, shape=TINY)["float32"]
    timed.clear()
    again = autotune.tune([torch.float32], threads=2, n=256, repeats=1, shape=TINY)["float32"]
    assert timed and set(timed) == {256} and again["n"] == 256 and "cached" not in again
    stored = json.loads(tuning.cache_path().read_text())["entries"][tuning.machine_key(torch.float32, 2)]
    assert stored["n"] == 256 and "cached" not in stored and first["n"] == 200
    timed.clear()
    args = ["tune-cpu", "--dtypes", "float32", "--threads", "2", "--length", "256"]
    monkeypatch.setattr(tuning, "TUNE_SHAPE", TINY)
    monkeypatch.setattr(autotune, "TUNE_SHAPE", TINY)
    res = CliRunner().invoke(load_commands(), args)
    assert res.exit_code == 0, res.output
    assert not timed and "cached, measured" in res.output and "tuning took" not in res.output
    # `oal --quiet tune-cpu`: its progress lines (stderr) stay off, the chosen settings (stdout) stay
    from oal.ops import cpu_kernel

    monkeypatch.setattr(cpu_kernel, "describe", lambda: "the kernel, described")
    shown = CliRunner().invoke(load_commands(), args)
    quiet = CliRunner().invoke(load_commands(), ["--quiet", *args])
    assert "the kernel, described" in shown.stderr and "the kernel, described" not in quiet.stderr
    assert quiet.exit_code == 0 and "cached, measured" in quiet.stdout


def test_no_tune_switch_and_stale_torch_version(cache_home, monkeypatch):
    key = tuning.machine_key(torch.float32, 2)
    entry = {"settings": {"chunk": 16, "block_chunks": 3, "pipeline": False, "kv_groups": 0},
             "torch": torch.__version__, "revision": tuning.OPERATOR_REVISION}
    tuning._write(tuning.cache_path(), {key: entry | {"revision": 0}})
    assert tuning.settings_for(torch.float32, 2) is None  # another revision of the operator: stale
    tuning.reload()
    tuning._write(tuning.cache_path(), {key: entry})
    assert tuning.settings_for(torch.float32, 2) == Settings(16, 3, False, 0)
    assert tuning.source(torch.float32, 2) == "tuned"
    with tuning.forced(Settings(8, 2)):
        assert tuning.settings_for(torch.float32, 2) == Settings(8, 2) and tuning.source(torch.float32, 2) == "forced"
    monkeypatch.setenv("OAL_NO_TUNE", "1")
    assert tuning.settings_for(torch.float32, 2) is None and tuning.source(torch.float32, 2) == "fixed"
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert chunked.current_settings(torch.float32) == chunked.fixed_settings(torch.float32)
        monkeypatch.delenv("OAL_NO_TUNE")
        assert chunked.current_settings(torch.float32) == Settings(16, 3, False, 0)
    finally:
        torch.set_num_threads(saved)
    monkeypatch.setattr(torch, "__version__", "0.0-other")  # measured under another torch: not used, re-measured
    tuning.reload()  # as a new process would
    assert tuning.settings_for(torch.float32, 2) is None
    monkeypatch.setattr(autotune, "_time", lambda *a: 1.0)
    autotune.tune([torch.float32], threads=2, n=64, repeats=1, shape=TINY)
    assert json.loads(tuning.cache_path().read_text())["entries"][key]["torch"] == "0.0-other"


def test_a_failed_write_keeps_the_old_cache_and_leaves_no_temporary(cache_home, monkeypatch):
    path = tuning.cache_path()
    tuning._write(path, {"a": {"x": 1}})
    monkeypatch.setattr(tuning.json, "dump", lambda *a, **kw: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        tuning._write(path, {"b": {}})
    assert [f.name for f in path.parent.iterdir()] == [path.name]
    assert tuning._read(path) == {"a": {"x": 1}}


def test_a_corrupt_cache_is_ignored(cache_home):
    path = tuning.cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert tuning.settings_for(torch.float32, 2) is None


def _make(n, seed=0, requires_grad=False):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, n, d, generator=gen, dtype=F64) * 0.5 for h, d in ((4, 8), (2, 8), (2, 5)))
    groups = torch.randint(0, 3, (4, 8), generator=gen)
    factor = torch.randn(4, 4, 4, generator=gen, dtype=F64) * 0.5
    if requires_grad:
        for t in (q, k, v, factor):
            t.requires_grad_(True)
    return q, k, v, groups, factor


# every layout the tuner may pick: chunk sizes, block lengths, pipelined (automatic or per-KV-head split) or serial
@pytest.mark.parametrize("settings", [Settings(32, 16), Settings(16, 1), Settings(128, 2), Settings(7, 3, True, 2),
                                      Settings(32, 2, False), Settings(64, 1, True, 1)])
def test_any_tuned_setting_matches_reference_fp64(settings, monkeypatch):
    monkeypatch.setattr(chunked, "NAN_SCRATCH", True)
    monkeypatch.setattr(chunked, "DENSE_MAX", 0)
    runs = []
    real = workers.Workers.run
    monkeypatch.setattr(workers.Workers, "run", lambda self, *a, **kw: runs.append(1) or real(self, *a, **kw))
    saved = torch.get_num_threads()
    torch.set_num_threads(2)  # the pipeline runs with more than one thread
    try:
        init = oal_attention(*_make(37, seed=1), output_final_state=True)[1]
        q, k, v, groups, factor = _make(301, requires_grad=True)
        ref, ref_state = oal_attention(q, k, v, groups, factor, backend="reference", initial_state=init,
                                       output_final_state=True)
        w = torch.randn_like(ref)
        want = torch.autograd.grad((ref * w).sum(), (q, k, v, factor))
        with tuning.forced(settings):
            with torch.no_grad():  # the inference path: scratch buffers, the pipeline
                out, state = oal_attention(q, k, v, groups, factor, initial_state=init, output_final_state=True)
            got_out = oal_attention(q, k, v, groups, factor, initial_state=init)  # autograd: checkpointed blocks
            got = torch.autograd.grad((got_out * w).sum(), (q, k, v, factor))
    finally:
        torch.set_num_threads(saved)
    assert bool(runs) == (settings.pipeline and settings.chunk * settings.block_chunks < 301)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(state, ref_state, rtol=1e-10, atol=1e-9)
    torch.testing.assert_close(got_out, ref, rtol=0, atol=1e-10)
    for name, a, b in zip(("dq", "dk", "dv", "dfactor"), got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=name)


def test_tune_cpu_command(cache_home, monkeypatch):
    from typer.testing import CliRunner

    from oal.cli import load_commands

    monkeypatch.setattr(autotune, "_time", lambda s, *a: 1.0 / s.chunk)  # no timing: longer chunks "win"
    runner = CliRunner()
    res = runner.invoke(load_commands(), ["tune-cpu", "--dtypes", "float32", "--threads", "2", "--length", "256"])
    assert res.exit_code == 0, res.output
    assert "float32: chunk 256" in res.output and str(tuning.cache_path()) in res.output  # one step past the grid
    assert tuning.settings_for(torch.float32, 2).chunk == 256
    bad = runner.invoke(load_commands(), ["tune-cpu", "--dtypes", "float16"])
    assert bad.exit_code == 2 and "--dtypes" in bad.output


def test_tune_searches_chunk_and_block_again_when_the_layout_moves(monkeypatch):
    # a machine where torch's threads (serial) beat the workers, and serial wants chunks of 64 in blocks of 128
    # (this Xeon's shape of answer); under the pipeline the best block is 1024, so a one-pass search would keep it
    def cost(s):
        tokens = s.chunk * s.block_chunks
        if s.pipeline:
            return 2.0 + abs(tokens - 1024) / 1e4 + abs(s.chunk - 32) / 1e3
        return 1.0 + abs(tokens - 128) / 1e4 + abs(s.chunk - 64) / 1e3

    monkeypatch.setattr(autotune, "_time", lambda s, *a: cost(s))
    res = autotune.tune([torch.float32], threads=2, n=200, repeats=1, shape=TINY, contention=False)["float32"]
    assert Settings(**res["settings"]) == Settings(64, 2, pipeline=False)
    # where the layout stays, there is no second pass: only the first pass's grid is timed
    monkeypatch.setattr(autotune, "_time", lambda s, *a: (0.5 if s.pipeline else 1.0) + abs(s.chunk - 32) / 1e3)
    res = autotune.tune([torch.float32], threads=2, n=200, repeats=1, shape=TINY, force=True)["float32"]
    default = chunked.fixed_settings(torch.float32)
    assert len(res["candidates"]) == len(autotune.CHUNKS) + len(autotune.BLOCK_TOKENS) + 3 - 2  # shared cells
    assert Settings(**res["settings"]).pipeline and Settings(**res["settings"]).chunk == default.chunk


def test_a_serial_winner_must_also_hold_beside_a_busy_process(monkeypatch):
    """Serial (torch's threads) 20% faster quiet but 50% slower beside a busy process: the pipeline is kept; with
    contention=False, or where serial also holds when loaded, serial is."""
    quiet = lambda s, *a: 1.0 if not s.pipeline else 1.2  # noqa: E731
    monkeypatch.setattr(autotune, "_time", quiet)
    monkeypatch.setattr(autotune, "_time_loaded", lambda s, *a: 3.0 if not s.pipeline else 1.8)
    res = autotune.tune([torch.float32], threads=2, n=200, repeats=1, shape=TINY)["float32"]
    assert Settings(**res["settings"]).pipeline
    assert {c["pipeline"] for c in res["loaded"]} == {True, False}  # both were timed loaded, and recorded
    res = autotune.tune([torch.float32], threads=2, n=200, repeats=1, shape=TINY, force=True, contention=False)
    assert not Settings(**res["float32"]["settings"]).pipeline and res["float32"]["loaded"] == []
    monkeypatch.setattr(autotune, "_time_loaded", lambda s, *a: 1.5 if not s.pipeline else 1.8)
    res = autotune.tune([torch.float32], threads=2, n=200, repeats=1, shape=TINY, force=True)["float32"]
    assert not Settings(**res["settings"]).pipeline


def test_busy_process_spins_and_stops():
    with autotune.busy_process() as proc:
        assert proc.poll() is None  # running
    assert proc.poll() is not None


def test_busy_process_stops_when_its_tuner_is_killed():
    """`oal tune-cpu` killed by SIGTERM (or -9) runs no `finally`: its spinning child went on for ever."""
    import os
    import signal
    import subprocess
    import sys
    import time

    tuner = subprocess.Popen([sys.executable, "-c", "import time\nfrom oal.ops import autotune\n"
                              "with autotune.busy_process() as p:\n    print(p.pid, flush=True)\n    time.sleep(600)"],
                             stdout=subprocess.PIPE, text=True)
    child = int(tuner.stdout.readline())
    tuner.send_signal(signal.SIGTERM)
    tuner.wait()

    def alive() -> bool:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return False
        with open(f"/proc/{child}/stat") as f:  # reaped by init soon after it exits: a zombie counts as stopped
            return f.read().split(")")[-1].split()[0] != "Z"

    deadline = time.monotonic() + 60
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    stopped = not alive()
    if not stopped:
        os.kill(child, signal.SIGKILL)
    assert stopped


def test_a_run_records_the_operator_settings_it_ran_with(monkeypatch):
    """A tuning entry changes the chunking, hence the rounding (about 1e-7) of every number: a run's stage log
    records the settings, their source and the fused kernel's library by name and SHA256, with no local path."""
    from oal.ops import cpu_kernel
    from oal.pipeline.base import operator_record

    monkeypatch.setenv("OAL_NO_TUNE", "1")
    rec = operator_record("float32", torch.device("cpu"))
    assert rec["chunked"]["source"] == "fixed" and rec["threads"] == torch.get_num_threads()
    with tuning.forced(tuning.Settings(16, 3, pipeline=False)):
        rec = operator_record("float32", torch.device("cpu"))
    assert rec["chunked"] == {"chunk": 16, "block_chunks": 3, "pipeline": False, "kv_groups": 0, "source": "forced"}
    assert rec["cpu_kernel"]["runs"] == cpu_kernel.available()
    if cpu_kernel.available():
        assert rec["cpu_kernel"]["library"].startswith("readout-") and len(rec["cpu_kernel"]["sha256"]) == 64
    assert "/" not in json.dumps(rec)  # no local path
    assert operator_record("float32", torch.device("meta")) == {}  # not on a GPU (nor any other device)
