"""The tool commands as a user meets them: `oal demo`'s table, `oal diagnose` on a run directory, `oal tune-cpu`."""

from __future__ import annotations

import re

import pytest
import torch
from typer.testing import CliRunner

from oal.cli import load_commands


@pytest.fixture
def fake_operator(monkeypatch):
    """`oal demo` over a stand-in operator and clock: each backend's first call costs 1000 s (its set-up: the CPU
    kernel's build, the workers, Triton's compile), every later call 1 ms. Returns the calls (backend, N)."""
    import oal.cli.demo as demo

    clock, calls = [0.0], []

    def operator(q, k, v, groups, factor, *, backend):
        clock[0] += 1e-3 if any(b == backend for b, _ in calls) else 1000.0
        calls.append((backend, q.shape[2]))
        return torch.zeros(*q.shape[:3], v.shape[-1], dtype=q.dtype)

    monkeypatch.setattr(demo, "oal_attention", operator)
    monkeypatch.setattr(demo.time, "perf_counter", lambda: clock[0])
    return calls


def _times(output: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r"│\s+(\w+) │\s+([\d.]+) │", output)}


def test_demo_times_exclude_each_backends_first_call(fake_operator):
    """The time column measured the first call of each backend, its one-time set-up included (chunked 552 ms, the
    token loop 144 ms at N=300 on 2 cores: the fast path looked slower than the token loop)."""
    res = CliRunner().invoke(load_commands(), ["demo", "--length", "100", "--head-dim", "8"])
    assert res.exit_code == 0, res.output
    times = _times(res.output)
    assert set(times) == {"reference", "chunked", "recurrent"}
    assert all(t == pytest.approx(1.0) for t in times.values()), times  # 1 ms each, not the 1000 s set-up
    assert ("chunked", 100) in fake_operator and ("recurrent", 100) in fake_operator


def test_demo_says_which_backends_it_left_out(fake_operator):
    """Beyond N=4096 the token loop was dropped from the table without a word."""
    res = CliRunner().invoke(load_commands(), ["demo", "--length", "5000", "--head-dim", "2", "--heads", "1",
                                               "--kv-heads", "1", "--n-groups", "1"])
    assert res.exit_code == 0, res.output
    assert "recurrent" not in _times(res.output) and "recurrent not run" in res.output
    assert all(b != "recurrent" for b, _ in fake_operator)


def test_diagnose_on_a_run_directory_calibrates_with_the_runs_settings(tmp_path, monkeypatch):
    """The docs promise the run's calibration settings on an `oal run` directory; Table 2 and Fig. 2(b) took the
    quick default (200 updates, seed 0) where the run used 400 and seed 42, so Table 2's OAL row was not the run's
    kernels. --paper still asks for App. B's protocol, --seed for another seed."""
    import oal.diagnostics.run_inputs as run_inputs
    import oal.diagnostics.runner as runner

    run = {"model": "default", "calib": {"max_steps": 7, "val_every": 3, "patience": 5}, "grouping": {}, "seed": 42,
           "layers": [1, 2], "path": str(tmp_path / "config.json")}
    seen = []
    monkeypatch.setattr(run_inputs, "read_run", lambda out: run)
    monkeypatch.setattr(run_inputs, "run_blocks", lambda r, tok: {"fidelity": torch.zeros(1, 4, dtype=torch.long)})
    monkeypatch.setattr(runner, "diagnose", lambda *a, **kw: seen.append(kw))
    app, out = load_commands(), str(tmp_path / "run")
    for extra in ([], ["--seed", "3"], ["--paper"]):
        res = CliRunner().invoke(app, ["diagnose", "--out", out, "--parts", "table2", *extra])
        assert res.exit_code == 0, res.output
    runs, seeded, paper = (kw["calib_cfg"] for kw in seen)
    assert (runs.max_steps, runs.val_every, runs.patience, runs.seed) == (7, 3, 5, 42)
    assert (seeded.max_steps, seeded.seed) == (7, 3)
    assert paper.max_steps == 1000 and seen[0]["offset"].cfg.max_steps == 7  # the offset part as before


def test_diagnose_on_a_layer_selection_run_takes_its_chosen_layers(tmp_path, monkeypatch):
    """`oal diagnose --out DIR` on an `oal select-layers` (or `--layers auto:K`) directory, whose config.json records
    the selection {"by", "k", "candidates"} instead of layers, failed with "Error: invalid literal for int() with
    base 10: 'by'"; it now takes the layers selection.json chose (the preset's range before the choice)."""
    import json

    import oal.diagnostics.run_inputs as run_inputs
    import oal.diagnostics.runner as runner

    run_dir = tmp_path / "sel"
    run_dir.mkdir()
    selection = {"by": "probe", "k": 2, "candidates": [0, 1, 2, 3, 4, 5]}
    (run_dir / "config.json").write_text(json.dumps({"config": {"model": "default"}, "split_plan": {},
                                                     "converted_layers": selection}))
    seen = []
    monkeypatch.setattr(run_inputs, "run_blocks", lambda r, tok: {"fidelity": torch.zeros(1, 4, dtype=torch.long)})
    monkeypatch.setattr(runner, "diagnose", lambda model, blocks, layers, *a, **kw: seen.append(layers))
    app = load_commands()
    for chosen in (None, [5, 3]):
        if chosen is not None:
            (run_dir / "selection.json").write_text(json.dumps({**selection, "chosen": chosen}))
        res = CliRunner().invoke(app, ["diagnose", "--out", str(run_dir), "--parts", "table2"])
        assert res.exit_code == 0, res.output
    assert seen == [[1, 2, 3, 4], [5, 3]]  # the preset's range, then the choice
    assert run_inputs.read_run(run_dir)["layers"] == [5, 3]
