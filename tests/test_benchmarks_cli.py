"""Every benchmark is a tool with the command line's manners (issue 48): --help says what it writes, a bad argument
is one line `Error: ...` and exit code 2 before any work, --out / --json are checked first and respected, progress
goes to stderr and results to stdout."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))


def tool(name: str, *args, timeout: int = 300) -> subprocess.CompletedProcess:
    """`python -m benchmarks.NAME ARGS` from the repository root (a generous timeout: this is no timing; past it the
    tool and any child it started are stopped, and the test fails)."""
    cmd = [sys.executable, "-m", f"benchmarks.{name}", *map(str, args)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{' '.join(cmd[2:])} still ran after {timeout} s: it did not refuse its arguments first")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def assert_refused(res: subprocess.CompletedProcess, *needles: str) -> None:
    """Exit code 2, one line `Error: ...` naming what was wrong, no traceback, nothing on stdout."""
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and lines[0].startswith("Error: "), res.stderr
    assert all(n in lines[0] for n in needles), lines[0]
    assert res.stdout == ""


@pytest.mark.parametrize("name", BENCHMARKS)
def test_help_names_the_outputs_and_a_bad_argument_is_one_line(name):
    res = tool(name, "--help")
    assert res.returncode == 0 and "Outputs: " in res.stdout, res.stderr
    outputs = res.stdout.split("Outputs: ", 1)[1]
    assert "stdout" in outputs or ".json" in outputs, outputs  # says where results go
    assert_refused(tool(name, "--no-such-option", "1"))


@pytest.mark.parametrize("name", BENCHMARKS)
def test_a_bad_argument_is_refused_before_torch_is_imported(name):
    """Within a second, as the issue asks, without timing anything: the arguments are parsed before the heavy
    imports, so a tool run where torch cannot be imported still refuses a bad argument with one line."""
    code = ("import runpy, sys; sys.modules['torch'] = None; "
            f"sys.argv = ['{name}', '--no-such-option', '1']; "
            f"runpy.run_module('benchmarks.{name}', run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert_refused(res)


@pytest.mark.parametrize("name, args, needles", [
    ("operator", ["--lengths", "abc"], ["--lengths", "'abc'"]),  # was refused only after tuning
    ("operator", ["--repeats", "0"], ["--repeats"]),  # was a traceback
    ("operator", ["--out", "{tmp}"], ["--out", "is a folder"]),  # ran to the end, then a traceback
    ("operator", ["--out", "{tmp}/file.txt/x.json"], ["--out", "not a folder"]),
    ("operator", ["--compare", "{tmp}/a.json", "{tmp}/b.json"], ["--compare", "no such file"]),  # a traceback
    ("operator", ["--settings", "0x2"], ["--settings"]),
    ("operator", ["--clock", "cpu"], ["--clock cpu", "--threads 1"]),
    ("settings_ab", ["--settings", "64x2", "--out", "{tmp}"], ["--out", "is a folder"]),
    ("frontier", ["--lengths", "0"], ["--lengths"]),  # were checked only after minutes of work
    ("frontier", ["--depths", "5"], ["--depths"]),
    ("frontier", ["--window", "-3"], ["--window"]),
    ("frontier", ["--json", "{tmp}"], ["--json", "is a folder"]),
    ("frontier", ["--work", "{tmp}/file.txt"], ["--work", "not a folder"]),
    ("frontier", ["--select-by", "speed"], ["--select-by"]),
    ("recall", ["--json", "{tmp}"], ["--json", "is a folder"]),
    ("recall", ["--threads", "100000"], ["--threads"]),
    ("model", ["--models", "gpt5"], ["--models"]),
    ("memory", ["--seq-len", "1"], ["--seq-len"]),
    ("cost_model", ["--gpus", "H300"], ["--gpus"]),
    ("encoder", ["{tmp}"], ["not a run directory"]),
    ("calibration", ["--heads", "14", "--kv-heads", "3"], ["--kv-heads"]),
    ("capture", ["--depths", "2,40"], ["--depths"]),
    ("grouping", ["--bootstrap", "0"], ["--bootstrap"]),
    ("methods", ["--lens", "0"], ["--lens"]),
    ("window", ["--max-len", "0"], ["--max-len"]),
])
def test_the_trial_s_bad_arguments_are_refused_before_any_work(tmp_path, name, args, needles):
    (tmp_path / "file.txt").write_text("x")
    assert_refused(tool(name, *(a.format(tmp=tmp_path) for a in args)), *needles)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt"]  # nothing written


def test_a_missing_model_is_one_line_and_leaves_no_work_folder(tmp_path):
    """`frontier --model missing` gave a traceback and left an empty work folder behind."""
    res = tool("frontier", "--model", tmp_path / "missing", "--work", tmp_path / "work", "--json",
               tmp_path / "out.json", "--steps", "1")
    assert_refused(res, "missing")
    assert not (tmp_path / "work").exists() and not (tmp_path / "out.json").exists()


def test_compare_refuses_a_file_of_another_kind(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    (tmp_path / "b.json").write_text("not json")
    assert_refused(tool("operator", "--compare", tmp_path / "a.json", tmp_path / "a.json"), "a.json",
                   "not a run of benchmarks.operator")
    assert_refused(tool("operator", "--compare", tmp_path / "b.json", tmp_path / "a.json"), "b.json", "not JSON")


def test_operator_sweep_writes_where_out_says(tmp_path, monkeypatch):
    """`operator --sweep --out X` ignored X and wrote inside the package."""
    from benchmarks import operator

    row = {"dtype": "float32", "time_s": 0.5, "gemm_gflops": 10.0, "peak_mib": 1.0, "load_before": 0.1}
    monkeypatch.setattr(operator, "_child", lambda args: dict(row))
    args = operator.parse_args(["--sweep", "256", "--dtypes", "float32", "--out", str(tmp_path / "sweep.json")])
    operator._sweep(args.sweep, args.repeats, "cpu", args.dtypes, args.out)
    written = json.loads((tmp_path / "sweep.json").read_text())
    assert written["n"] == 256 and len(written["rows"]) == 12
    assert operator.parse_args(["--sweep", "256"]).out.name == "operator_sweep.json"
    assert operator.parse_args(["--contention"]).out.name == "operator_contention.json"


def test_recall_progress_goes_to_stderr(tmp_path, monkeypatch, capsys):
    """benchmarks.recall printed its progress on stdout, where its tables go."""
    from benchmarks import recall

    def run(cfg, log):
        log("training the softmax model on MQAR")
        return {"void": True, "seconds": 1.0, "cpu_seconds": 1.0}

    monkeypatch.setattr(recall, "run", run)
    monkeypatch.setattr(recall, "setup", lambda kind, seed, **kwargs: None)
    assert recall.main(["--json", str(tmp_path / "r.json")]) == 1  # void: exit code 1, as documented
    out, err = capsys.readouterr()
    assert "training the softmax model" in err and "training" not in out
    assert json.loads((tmp_path / "r.json").read_text())["void"]


def test_decode_host_restores_the_direct_launch_variable(monkeypatch):
    """benchmarks.decode_host sets OAL_TRITON_DIRECT_LAUNCH for the plans its timed calls make, and only there
    (`_common.direct_launch`, as decode_host calls it: "0" when off); benchmarks.gpu leaves it as it is when off."""
    from benchmarks._common import direct_launch

    monkeypatch.setenv("OAL_TRITON_DIRECT_LAUNCH", "0")
    with direct_launch(True, otherwise="0"):
        assert os.environ["OAL_TRITON_DIRECT_LAUNCH"] == "1"
    assert os.environ["OAL_TRITON_DIRECT_LAUNCH"] == "0"
    monkeypatch.delenv("OAL_TRITON_DIRECT_LAUNCH")
    with direct_launch(False, otherwise="0"):
        assert os.environ["OAL_TRITON_DIRECT_LAUNCH"] == "0"
    assert "OAL_TRITON_DIRECT_LAUNCH" not in os.environ
    with direct_launch(False):
        assert "OAL_TRITON_DIRECT_LAUNCH" not in os.environ


@pytest.mark.parametrize("name, tag", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("NVIDIA GH200 480GB", "gh200"), ("NVIDIA A100-SXM4-80GB", "a100"),
                                       ("NVIDIA L4", "l4"), ("NVIDIA L40S", "l40s"), ("cpu", "cpu"),
                                       ("Tesla V100-SXM2-16GB", "tesla_v100_sxm2_16gb")])
def test_the_gpu_scripts_tag_their_files_with_the_card_they_ran_on(name, tag):
    """The acceptance names the H200; an H100's numbers must not land in gpu_h200.json (GH200 is not an H200)."""
    from benchmarks._common import device_tag

    assert device_tag(name) == tag


def test_the_tag_script_answers_cpu_without_cuda_and_obeys_gpu_tag():
    script = ROOT / "scripts" / "device_tag.py"
    run = partial(subprocess.run, [sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert run(env=dict(os.environ, DEVICE="cpu")).stdout.strip() == "cpu"
    assert run(env=dict(os.environ, GPU_TAG="NVIDIA H100 PCIe")).stdout.strip() == "h100"
