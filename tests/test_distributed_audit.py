"""Launches that go wrong (issue 13's audit): processes given other settings, a process that never joins, an error
found on another machine. Each launch runs tests/_dist_worker.py in 2 processes on the CPU (gloo), as
tests/test_distributed.py does; a launch that would wait for its missing process is bounded by the subprocess
timeout and ended by its session."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from test_distributed import CFG, SRC, WORKER, _free_port, launch

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(WORKER.parent)]), "HF_HUB_OFFLINE": "1",
       "OMP_NUM_THREADS": "1"}


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("Error:")]


def test_processes_given_other_adaptation_settings_are_refused(tmp_path):
    """Process 1 with another learning rate: each process stepped with its own while DDP averaged the gradients, so
    the launch ended (exit 0) with processes holding different adapters and the main one saving its own. Now every
    process refuses before the first update, naming the setting, and nothing is written."""
    ckpt, out = tmp_path / "run" / "ckpt", tmp_path / "result"
    out.mkdir()
    proc, writes = launch(tmp_path, {"mode": "adapt", "watch": str(ckpt.parent), "ckpt": str(ckpt),
                                     "result": str(out), "cfg": CFG, "cfg_by_rank": {"1": {"lr": 1e-3}}}, check=False)
    assert proc.returncode != 0
    assert "the processes of this launch differ in lr (process 0: 0.005, process 1: 0.001)" in proc.stderr
    assert not list(out.iterdir()) and not ckpt.exists() and writes == []


def _machine(tmp: Path, spec: dict, node: int, port: int) -> subprocess.Popen:
    """One 'machine' of a 2-machine launch: torchrun with --nnodes 2 --node_rank `node`, one process."""
    tmp.mkdir()
    spec_path = tmp / "spec.json"
    spec_path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
           "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), str(WORKER),
           str(spec_path)]
    return subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _two_machines(tmp_path: Path, spec: dict) -> list[tuple[str, str]]:
    """(stdout, stderr) of each machine of a 2-machine launch of `spec`; both are ended if they outlive the
    subprocess timeout (a process waiting for one that has gone)."""
    port = _free_port()
    machines = [_machine(tmp_path / f"m{node}", spec, node, port) for node in (0, 1)]
    try:
        return [m.communicate(timeout=180) for m in machines]
    finally:
        for m in machines:
            if m.poll() is None:
                os.killpg(m.pid, signal.SIGKILL)
                m.wait()


def test_a_process_that_dies_mid_adaptation_stops_the_others_with_one_line(tmp_path):
    """Process 1 (on another machine: no torchrun agent ends the main process for it) dies after update 1; the main
    process, in DDP's gradient exchange of update 2, stops with a ConnectionError that says what happened (the CLI's
    one line) instead of gloo's RuntimeError (a traceback of every survivor)."""
    ckpt, out = tmp_path / "run" / "ckpt", tmp_path / "result"
    out.mkdir()
    outputs = _two_machines(tmp_path, {"mode": "adapt", "watch": str(ckpt.parent), "ckpt": str(ckpt),
                                       "result": str(out), "audit": str(tmp_path), "cfg": CFG, "kill_after": 1,
                                       "kill_rank": 1})
    assert "ConnectionError: launch: lost contact with another process of this launch" in outputs[0][1]
    assert not list(out.iterdir())


def test_a_process_stopped_on_another_machine_says_why_and_the_others_stop(tmp_path):
    """Two machines; the second is given a bad option. Its process stopped before the launch's processes met and
    printed nothing (only the main process printed errors alike on every process), while the main process waited
    for it for the launch's 6-hour timeout. Now the first process of each machine prints such an error, and a
    process that does not meet the others within the join timeout stops with one line."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = ["adapt", "--out", str(run_dir), "--method", "oal", "--no-progress"]
    spec = {"mode": "cli", "watch": str(run_dir), "audit": str(tmp_path), "join_timeout_s": 3, "args": args,
            "args_by_rank": {"1": [*args, "--steps", "0"]}}
    outputs = _two_machines(tmp_path, spec)
    main, other = (_errors(out + err) for out, err in outputs)
    assert len(other) == 1 and other[0].startswith("Error: (process 1) Invalid value for '--steps'"), other
    assert len(main) == 1 and "process 0 of 2 did not meet the others at 127.0.0.1" in main[0], main
    assert f"{SRC}{os.sep}oal" not in "".join(out + err for out, err in outputs)  # no traceback from oal
    assert not list(run_dir.iterdir())
