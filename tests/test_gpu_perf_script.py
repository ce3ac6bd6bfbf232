"""scripts/gpu_perf.sh, the next GPU session's one call, run on the CPU at tiny sizes (DEVICE=cpu): every part runs,
its outcome is in summary.txt, and what comes back fits the device tool's limit of 8 files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]

# Python reads sitecustomize from the script's PYTHONPATH (it keeps the caller's) at every start: the parts that run
# Triton's interpreter get the suite's own shortcut (tests/triton_interpreter.py, which conftest.py installs in the
# test processes), a third of their time. The script exports TRITON_INTERPRET=1 before any part when DEVICE=cpu.
SITECUSTOMIZE = f"""import os
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.path.insert(0, {str(ROOT / "tests")!r})
    from triton_interpreter import install

    install()
"""


@pytest.fixture(scope="module")
def interpreter_shortcut(tmp_path_factory):
    """PYTHONPATH for the script: a folder holding only SITECUSTOMIZE (never $OUT, whose files are counted)."""
    folder = tmp_path_factory.mktemp("site")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return str(folder)


@pytest.mark.slow
def test_dry_run_runs_every_part(tmp_path, interpreter_shortcut):
    # every part's limit generous: the GPU session's defaults (25 s for the direct launches) are sized for a GPU, and
    # on a loaded 2-core CPU the interpreter took longer (a flaky failure, 2026-12-06)
    env = dict(os.environ, OUT=str(tmp_path), DEVICE="cpu", PYTHON=sys.executable, ENV_S="120", TESTS_S="600",
               DIRECT_S="600", BENCH_S="900", GEN_S="600", HOST_S="300", PROF_S="300", PYTHONPATH=interpreter_shortcut)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_perf.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=3600)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    for name in ("env", "tests", "direct", "bench", "generate", "host", "profile"):
        assert f"{name}: ok" in summary, summary
    assert "bf16: skipped (needs CUDA)" in summary
    assert "files tagged: cpu" in summary  # never filed as the H200's
    files = sorted(p.name for p in tmp_path.iterdir())
    assert len(files) <= 8, files
    with tarfile.open(tmp_path / "figures.tar") as tar:
        assert sorted(Path(n).name for n in tar.getnames()) == ["decode_host_cpu.png", "generate_cpu.png",
                                                                "gpu_cpu.png"]
    host = json.loads((tmp_path / "decode_host_cpu.json").read_text())
    assert host["stand_in"] and [r["method"] for r in host["rows"]] == ["oal", "swa"]
    assert host["prefill"]["oal_us"] > 0 and host["prefill"]["sdpa_us"] is None  # SDPA's on CUDA only
    gpu = json.loads((tmp_path / "gpu_cpu.json").read_text())
    assert [r["n"] for r in gpu["rows"]] == [32] and isinstance(gpu["rows"][0]["oal_fwd_ms"], float)
    gen = json.loads((tmp_path / "generate_cpu.json").read_text())
    assert {r["method"] for r in gen["rows"]} == {"softmax", "oal", "oal-swa"}
    prof = (tmp_path / "profile.txt").read_text()
    assert "OAL forward, N=64" in prof and "OAL forward + backward, N=64" in prof


def test_a_call_cut_off_at_its_limit_returns_its_figures_packed(tmp_path, interpreter_shortcut):
    """The device tool returns at most 8 files, also from a call it kills at its limit: each part's figure goes into
    figures.tar as the part ends, not at the script's end. Killed (SIGKILL, the whole group) while `profile` runs,
    the host part's figure is in the archive and no PNG stands loose; an earlier run's archive is not added to.
    (host and profile: the two cheapest parts where one writes a figure and the next runs; the dry run above runs
    generate, whose figure is packed the same way.)"""
    stale = tmp_path / "old.png"
    stale.write_bytes(b"an earlier run's figure")
    with tarfile.open(tmp_path / "figures.tar", "w") as tar:
        tar.add(stale, arcname="./old.png")
    stale.unlink()
    zero = {f"{name}_S": "0" for name in ("TESTS", "DIRECT", "BENCH", "GEN")}
    env = dict(os.environ, OUT=str(tmp_path), DEVICE="cpu", PYTHON=sys.executable, HOST_S="600", PROF_S="600",
               PYTHONPATH=interpreter_shortcut, **zero)
    proc = subprocess.Popen(["bash", str(ROOT / "scripts" / "gpu_perf.sh")], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    summary = tmp_path / "summary.txt"
    try:
        deadline = time.monotonic() + 600
        while "host:" not in (summary.read_text() if summary.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline, "the script ended before its host part"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    text = summary.read_text()
    assert "host: ok" in text and "profile:" not in text, text  # cut off inside the profile part
    assert not list(tmp_path.glob("*.png"))
    with tarfile.open(tmp_path / "figures.tar") as tar:
        assert [Path(n).name for n in tar.getnames()] == ["decode_host_cpu.png"]


def test_a_part_with_limit_zero_is_skipped(tmp_path):
    """`timeout 0` means no limit at all: a part given 0 seconds must not run (the prepared calls give 0 to the
    parts they leave out)."""
    zero = {f"{name}_S": "0" for name in ("TESTS", "DIRECT", "BENCH", "GEN", "HOST", "PROF")}
    env = dict(os.environ, OUT=str(tmp_path), DEVICE="cpu", PYTHON=sys.executable, **zero)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_perf.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    for name in ("tests", "direct", "bench", "generate", "host", "profile"):
        assert f"{name}: skipped (limit 0)" in summary, summary
    assert not (tmp_path / "gpu_cpu.json").exists()
