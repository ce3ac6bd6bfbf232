"""Reproducibility and resume equivalence: a killed calibration or adaptation, resumed, writes what an
uninterrupted one writes (timing fields aside), and the same inputs give the same bytes whatever the thread count
where the result is a discrete decision."""

from __future__ import annotations

import json

import pytest
import torch
from _dist_worker import calibration_inputs
from _runs import timeless
from safetensors.torch import load_file

from oal.calibration import resume


class _Kill(BaseException):
    pass


def test_calibration_killed_after_its_last_layer_records_the_same_capture(tmp_path, monkeypatch):
    """A calibration killed once every layer was checkpointed (before calibration.json was written) resumed from
    the checkpoints alone and wrote calibration.json without its capture record: the resumed run's file differed
    from an uninterrupted run's."""
    model, blocks, layers, methods, kw = calibration_inputs()
    resume.calibrate_directory(tmp_path / "ref", model, blocks, layers, methods, **kw)
    want = timeless(tmp_path / "ref" / "calibration.json")
    assert want["capture"]["layers"] == len(layers)

    write = resume.write_calibration

    def killed(*args, **kwargs):
        raise _Kill

    monkeypatch.setattr(resume, "write_calibration", killed)
    with pytest.raises(_Kill):
        resume.calibrate_directory(tmp_path / "run", model, blocks, layers, methods, **kw)
    monkeypatch.setattr(resume, "write_calibration", write)
    captured = []
    monkeypatch.setattr(resume.OnePassCapture, "__call__", lambda self, layer: captured.append(layer))
    resume.calibrate_directory(tmp_path / "run", model, blocks, layers, methods, **kw)
    assert captured == []  # every layer came from its checkpoint
    assert timeless(tmp_path / "run" / "calibration.json") == want
    for rel in ("kernels.safetensors", "kernels/global/kernels.safetensors"):
        a, b = (load_file(str(tmp_path / d / rel)) for d in ("ref", "run"))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), rel


def test_grouping_and_layer_ranking_do_not_depend_on_the_thread_count():
    """Discrete decisions (App. B cuts, the layers `auto:K` converts) are the same on one and two threads."""
    from oal.analysis.grouping import stable_gap_groups
    from oal.pipeline.selection import rank_layers

    gen = torch.Generator().manual_seed(0)
    chi = torch.rand(3, 4, 24, 32, generator=gen, dtype=torch.float64) ** 4
    threads = torch.get_num_threads()
    got = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got.append(stable_gap_groups(chi, n_bootstrap=200, seed=0))
    finally:
        torch.set_num_threads(threads)
    for field in ("groups", "ratios", "support", "selected"):
        assert torch.equal(getattr(got[0], field), getattr(got[1], field)), field
    assert rank_layers({3: 0.5, 1: 0.25, 2: 0.5, 0: 0.25}) == [0, 1, 2, 3]  # exact ties: the lower layer first


# ----------------------------------------------------------------------------------------------- oal run, SIGKILL

_CHILD = """
import json, sys, torch
torch.set_num_threads(1)
from oal.pipeline.config import RunConfig
from oal.pipeline.runs import run_seed
run_seed(RunConfig.from_dict(json.loads(sys.argv[1])), sys.argv[2], progress=False)
"""
# timing fields (seconds, finish times), and the records that hash files holding them
_TIMING = {"elapsed_s", "seconds", "finished", "timing_s"}


def _stripped(obj):
    if isinstance(obj, dict):
        return {k: _stripped(v) for k, v in obj.items() if k not in _TIMING}
    if isinstance(obj, list):
        return [_stripped(v) for v in obj]
    return obj


def _results(run) -> dict:
    """Every tensor file's bytes and every JSON result (timing aside) of a finished run directory."""
    out = {}
    for p in sorted(run.rglob("*")):
        rel = str(p.relative_to(run))
        if p.suffix == ".safetensors":
            out[rel] = p.read_bytes()
        elif p.suffix == ".json" and p.name not in ("stages.json", "metrics.json", "config.json"):
            out[rel] = _stripped(json.loads(p.read_text()))
    return out


def test_a_run_killed_mid_adaptation_resumes_to_the_same_artefacts(tmp_path):
    """SIGKILL of `oal run` (a separate process) after an adaptation checkpoint, then the same command: every
    tensor (kernels, adapters) is bitwise the uninterrupted run's, and so is every JSON result but its timings."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from test_pipeline import _cfg, make_assets

    from oal.pipeline.runs import run_seed

    assets = make_assets(tmp_path / "assets", paragraphs=200)
    cfg = _cfg(assets, methods=["global", "softmax"], layers=[0, 1, 2],
               adapt={"steps": 8, "val_every": 4, "ckpt_every": 2})
    state = tmp_path / "run" / ".oal" / "checkpoints" / "global" / "state.json"
    args = [sys.executable, "-c", _CHILD, json.dumps(cfg.to_dict()), str(tmp_path / "run")]
    child = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while child.poll() is None and not state.is_file() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert child.poll() is None, "the run ended before its first adaptation checkpoint"
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert json.loads(state.read_text())["step"] < 8
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_seed(cfg, tmp_path / "run", progress=False)
        run_seed(cfg, tmp_path / "ref", progress=False)
    finally:
        torch.set_num_threads(threads)
    got, want = _results(tmp_path / "run"), _results(tmp_path / "ref")
    assert set(got) == set(want) and "adapter/global/adapter_model.safetensors" in want
    assert [k for k in want if got[k] != want[k]] == []
