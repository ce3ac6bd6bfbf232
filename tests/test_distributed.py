"""Several processes, one result (issue 13): adaptation and calibration under `torchrun` on the CPU (gloo) equal one
process; only the main process writes; a killed launch resumes exactly.

Each launch runs tests/_dist_worker.py (or the `oal` CLI through it) in 2 processes, on a free port, with a Python
audit hook in every process that records its writes below the folder under test.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist_worker import adapt_inputs, calibration_inputs
from safetensors.torch import load_file
from test_pipeline import assets  # noqa: F401  (the fixture: tiny model and corpus of `oal run`)

from oal.adaptation.config import AdaptConfig
from oal.adaptation.train import adapt

WORKER = Path(__file__).with_name("_dist_worker.py")
SRC = Path(__file__).parents[1] / "src"
CFG = dict(steps=4, val_every=2, ckpt_every=1, warmup_frac=0.2, lr=5e-3, seed=3, lora_dropout=0.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LAUNCHERS = {  # -> the command line before the script, for 2 processes on a free port
    "torchrun": lambda port: ["torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                              "--master_port", str(port)],
    # accelerate's multi-GPU launcher is torchrun's; without a GPU its processes run on the CPU with gloo
    "accelerate": lambda port: ["accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                                "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                                "--main_process_port", str(port)],
}


def launch(tmp: Path, spec: dict, check: bool = True, launcher: str = "torchrun", audit: Path | None = None,
           ) -> tuple[subprocess.CompletedProcess, list]:
    """Run the worker in 2 processes (gloo, a free MASTER_PORT); returns the process and every rank's recorded
    writes below spec['watch'] (kept in `audit`, a new folder)."""
    audit = audit or tmp / f"audit-{_free_port()}"
    audit.mkdir()
    spec_path = audit / "spec.json"
    spec_path.write_text(json.dumps({**spec, "audit": str(audit)}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), str(WORKER.parent)]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", *LAUNCHERS[launcher](_free_port()), str(WORKER), str(spec_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    writes = [json.loads(p.read_text()) for p in sorted(audit.glob("rank*.json"))]
    return proc, writes


def files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def assert_close(got: dict, want: dict, rtol=1e-5, atol=1e-6):
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


def _values(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records]


def _one_process_adapt(cfg: dict, ckpt: Path | None = None):
    """The reference: adaptation in this process (one thread, as in the launched ones)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, train, val = adapt_inputs()
        peft_model, res = adapt(model, train, val, AdaptConfig(**cfg), ckpt_dir=ckpt, progress=False)
    finally:
        torch.set_num_threads(threads)
    return {n: p.detach() for n, p in peft_model.named_parameters() if p.requires_grad}, res


def _adapt_launch(tmp: Path, name: str, cfg: dict, **extra):
    out, ckpt = tmp / f"{name}-result", tmp / f"{name}-run" / "ckpt"
    out.mkdir()
    proc, writes = launch(tmp, {"mode": "adapt", "watch": str(ckpt.parent), "ckpt": str(ckpt), "result": str(out),
                                "cfg": cfg, **extra}, check="kill_after" not in extra)
    return out, ckpt, proc, writes


@pytest.fixture(scope="module")
def two_process_adapt(tmp_path_factory):
    """2 processes x batch 1, no dropout, checkpoints every update."""
    tmp = tmp_path_factory.mktemp("adapt2")
    return _adapt_launch(tmp, "two", {**CFG, "batch_size": 1})


# ----------------------------------------------------------------------------------------------- adaptation


def test_two_processes_equal_one_process_with_doubled_batch(two_process_adapt, tmp_path):
    out, ckpt, _, writes = two_process_adapt
    ranks = [load_file(str(out / f"rank{r}.safetensors")) for r in range(2)]
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for name in ranks[0]:  # DDP: every process holds the same tensors, bit for bit
        assert torch.equal(ranks[0][name], ranks[1][name]), name
    assert results[0] == results[1]
    assert results[0]["processes"] == 2 and results[0]["global_batch"] == 2

    want, ref = _one_process_adapt({**CFG, "batch_size": 2}, ckpt=tmp_path / "ckpt")
    assert ref.processes == 1 and ref.global_batch == 2
    assert_close(ranks[0], want)  # LoRA and the OAL factor
    assert any("oal_method.factor" in n for n in want) and any("lora_B" in n for n in want)
    got = results[0]
    assert [v["step"] for v in got["validation"]] == [v["step"] for v in ref.validation] == [2, 4]
    assert _values(got["validation"], "val_nll") == pytest.approx(_values(ref.validation, "val_nll"), rel=1e-6)
    assert _values(got["history"], "loss") == pytest.approx(_values(ref.history, "loss"), rel=1e-5)
    assert _values(got["history"], "lr") == _values(ref.history, "lr")
    assert got["best_step"] == ref.best_step

    # only the main process wrote, and it wrote what one process writes: no stray temporary or duplicate files
    assert writes[0] and not writes[1], writes[1][:5]
    assert files(ckpt) == files(tmp_path / "ckpt")
    assert not [f for f in files(ckpt.parent) if f.endswith(".tmp") or ".old" in f]


@pytest.mark.slow
def test_killed_launch_resumes_from_the_main_process_checkpoint(tmp_path):
    """Dropout on (each process draws its own masks: their RNG states are checkpointed too), 2 micro-batches per
    update; the main process dies after update 3, the relaunch resumes and ends where an uninterrupted launch ends."""
    cfg = {**CFG, "steps": 5, "ckpt_every": 3, "val_every": 5, "lora_dropout": 0.1, "grad_accum": 2}
    ref_out, _, _, _ = _adapt_launch(tmp_path, "ref", cfg)
    out, ckpt, proc, _ = _adapt_launch(tmp_path, "killed", cfg, kill_after=3)
    assert proc.returncode != 0 and not (out / "rank0.json").exists()
    assert json.loads((ckpt / "state.json").read_text())["step"] == 3
    resumed = out.parent / "resumed-result"
    resumed.mkdir()
    launch(tmp_path, {"mode": "adapt", "watch": str(ckpt.parent), "ckpt": str(ckpt), "result": str(resumed),
                      "cfg": cfg})
    want, got = load_file(str(ref_out / "rank0.safetensors")), load_file(str(resumed / "rank0.safetensors"))
    for name in want:
        assert torch.equal(got[name], want[name]), name
    a, b = (json.loads((d / "rank0.json").read_text()) for d in (ref_out, resumed))
    assert a["history"] == b["history"] and a["validation"] == b["validation"]


def test_grad_accum_equals_the_bigger_batch():
    """accelerate's accumulation divides each micro-batch loss by grad_accum: 2 x 1 blocks = 1 x 2 blocks."""
    want, ref = _one_process_adapt({**CFG, "batch_size": 2})
    got, res = _one_process_adapt({**CFG, "grad_accum": 2})
    assert res.global_batch == ref.global_batch == 2
    assert_close(got, want)
    assert _values(res.validation, "val_nll") == pytest.approx(_values(ref.validation, "val_nll"), rel=1e-6)


# ----------------------------------------------------------------------------------------------- calibration


def test_two_process_calibration_equals_one_process_exactly(tmp_path):
    from oal.calibration.resume import calibrate_directory

    model, blocks, layers, methods, kw = calibration_inputs()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        calibrate_directory(tmp_path / "one", model, blocks, layers, methods, **kw)
    finally:
        torch.set_num_threads(threads)
    _, writes = launch(tmp_path, {"mode": "calibrate", "watch": str(tmp_path / "two"), "out": str(tmp_path / "two")})
    assert writes[0] and not writes[1], writes[1][:5]
    assert files(tmp_path / "two") == files(tmp_path / "one")  # capture and layer checkpoints removed, no stray file
    for rel in ("kernels.safetensors", "kernels/global/kernels.safetensors"):
        a, b = load_file(str(tmp_path / "one" / rel)), load_file(str(tmp_path / "two" / rel))
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), rel
    a, b = (json.loads((tmp_path / d / "calibration.json").read_text()) for d in ("one", "two"))
    for record in (a, b):
        record.pop("capture")
        for per_layer in record["methods"].values():
            for summary in per_layer.values():
                summary.pop("elapsed_s", None)
    assert a == b


# ----------------------------------------------------------------------------------------------- oal run, oal adapt

ADAPT = {"steps": 4, "val_every": 2, "ckpt_every": 1, "lora_dropout": 0.0}
METHODS = ["oal", "softmax"]
LAYERS = [0, 1, 2]  # all three: calibration shares them out (2 + 1)


@pytest.fixture(scope="module")
def one_process_run(request, tmp_path_factory):
    """`oal run` on test_pipeline's tiny model (OAL and softmax arms) in one process, with batch 2."""
    from test_pipeline import _cfg

    from oal.pipeline.runs import run

    model_and_corpus = request.getfixturevalue("assets")
    out = tmp_path_factory.mktemp("one") / "run"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        metrics = run(_cfg(model_and_corpus, adapt={**ADAPT, "batch_size": 2}, methods=METHODS, layers=LAYERS),
                      out, progress=False)
    finally:
        torch.set_num_threads(threads)
    return model_and_corpus, out, metrics


def _tensors(path: Path) -> dict:
    return {f"{p.name}:{k}": v for p in sorted(path.glob("*.safetensors")) for k, v in load_file(str(p)).items()}


@pytest.mark.slow
def test_oal_run_in_two_processes(one_process_run, tmp_path):
    """The whole pipeline launched twice: calibration is bit-identical, adaptation (batch 1 x 2 processes) equals
    batch 2 in one process, the other stages ran once, and only the main process wrote."""
    model_and_corpus, ref, want = one_process_run
    out = tmp_path / "run"
    _, writes = launch(tmp_path, {"mode": "run", "watch": str(out), "out": str(out), "assets": str(model_and_corpus),
                                  "adapt": {**ADAPT, "batch_size": 1}, "methods": METHODS, "layers": LAYERS})
    assert writes[0] and not writes[1], writes[1][:5]
    assert files(out) == files(ref)
    for rel in ("groups.json", "kernels.safetensors", ".oal/fidelity.json", ".oal/perplexity_no_adapt_oal.json"):
        assert (out / rel).read_bytes() == (ref / rel).read_bytes(), rel
    for method in METHODS:
        assert_close(_tensors(out / "adapter" / method), _tensors(ref / "adapter" / method))
    got = json.loads((out / "metrics.json").read_text())
    assert got["perplexity"] == pytest.approx(want["perplexity"], rel=1e-5)
    assert got["converted_layers"] == LAYERS
    capture = json.loads((out / "calibration.json").read_text())["capture"]
    assert [p["layers"] for p in capture["processes"]] == [2, 1]  # layers 0, 2 and 1 were captured and fitted apart
    assert (got["adapt"]["oal"]["processes"], got["adapt"]["oal"]["global_batch"]) == (2, 2)
    assert (want["adapt"]["oal"]["processes"], want["adapt"]["oal"]["global_batch"]) == (1, 2)
    stages = json.loads((out / ".oal" / "stages.json").read_text())
    assert set(stages) == set(json.loads((ref / ".oal" / "stages.json").read_text()))


CLI_ADAPT = ["adapt", "--method", "oal", "--steps", "3", "--lora-dropout", "0", "--no-progress"]


@pytest.fixture(scope="module")
def doubled_batch_adapt(one_process_run, tmp_path_factory):
    """`oal adapt --batch-size 2` in this process, on a copy of the finished one-process run."""
    import shutil

    from typer.testing import CliRunner

    from oal.cli import load_commands

    _, ref, _ = one_process_run
    out = tmp_path_factory.mktemp("doubled") / "run"
    shutil.copytree(ref, out)
    res = CliRunner().invoke(load_commands(), [*CLI_ADAPT, "--out", str(out), "--batch-size", "2"])
    assert res.exit_code == 0, res.output
    return out


def _copy(run_dir: Path, to: Path) -> Path:
    import shutil

    shutil.copytree(run_dir, to)
    return to


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_oal_adapt_in_two_processes_matches_doubled_batch(one_process_run, doubled_batch_adapt, tmp_path, launcher):
    """The acceptance check of issue 13 at test size: `torchrun --nproc_per_node 2 oal adapt --batch-size 1` (or
    `accelerate launch`) and `oal adapt --batch-size 2` on copies of a finished run give the same adapter; both record
    their settings, and the arm they did not touch (trained by one process) keeps its results."""
    _, ref, _ = one_process_run
    a, b = _copy(ref, tmp_path / "a"), doubled_batch_adapt
    proc, writes = launch(tmp_path, {"mode": "cli", "watch": str(a), "args": [*CLI_ADAPT, "--out", str(a),
                                                                              "--batch-size", "1"]},
                          launcher=launcher)
    assert "test PPL after adaptation" in proc.stdout and proc.stdout.count("test PPL") == 1  # one process reports
    assert writes[0] and not writes[1], writes[1][:5]
    assert_close(_tensors(a / "adapter" / "oal"), _tensors(b / "adapter" / "oal"))
    assert files(a) == files(b)
    for run_dir, batch, processes in ((a, 1, 2), (b, 2, 1)):
        config = json.loads((run_dir / "config.json").read_text())["config"]
        assert config["adapt_overrides"]["oal"] == {"steps": 3, "batch_size": batch, "lora_dropout": 0.0}
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert metrics["adapt"]["oal"] == {**metrics["adapt"]["oal"], "steps": 3, "processes": processes,
                                           "global_batch": 2}
        assert (run_dir / "report.md").stat().st_mtime > (ref / "report.md").stat().st_mtime
    pa, pb = (json.loads((d / "metrics.json").read_text())["perplexity"] for d in (a, b))
    assert pa["oal"] == pytest.approx(pb["oal"], rel=1e-5)
    assert pa["softmax"] == pb["softmax"] == json.loads((ref / "metrics.json").read_text())["perplexity"]["softmax"]
    assert (a / "adapter" / "softmax" / "adapt.json").read_bytes() == (ref / "adapter" / "softmax" / "adapt.json"
                                                                        ).read_bytes()


@pytest.mark.slow
def test_killed_oal_adapt_launch_resumes_on_every_process(one_process_run, doubled_batch_adapt, tmp_path):
    """`torchrun ... oal adapt` whose main process dies after update 2 of 3; the same command again: both processes
    resume from the main process's checkpoint (they run update 3 only), and the adapter equals one process's with the
    doubled batch, as an uninterrupted launch's does."""
    _, ref, _ = one_process_run
    run_dir = _copy(ref, tmp_path / "run")
    spec = {"mode": "cli", "watch": str(run_dir), "args": [*CLI_ADAPT, "--out", str(run_dir), "--batch-size", "1"]}
    proc, writes = launch(tmp_path, {**spec, "kill_after": 2}, check=False, audit=tmp_path / "killed")
    # killed: no process got to the end (the other one may stop in order, having lost the main one: it wrote nothing)
    assert proc.returncode != 0 and not any(writes)
    assert json.loads((run_dir / ".oal" / "checkpoints" / "oal" / "state.json").read_text())["step"] == 2
    stages = [json.loads((d / ".oal" / "stages.json").read_text()) for d in (run_dir, ref)]
    assert stages[0]["adapt:oal"] == stages[1]["adapt:oal"]  # still the finished run's entry: not marked done
    _, writes = launch(tmp_path, spec, audit=tmp_path / "resumed")
    assert writes[0] and not writes[1], writes[1][:5]
    steps = [json.loads((tmp_path / "resumed" / f"steps-rank{r}.json").read_text()) for r in range(2)]
    assert steps == [[3], [3]]
    assert_close(_tensors(run_dir / "adapter" / "oal"), _tensors(doubled_batch_adapt / "adapter" / "oal"))
    assert files(run_dir) == files(doubled_batch_adapt)  # the checkpoint is gone once the adapter is written
    got, want = (json.loads((d / "adapter" / "oal" / "adapt.json").read_text()) for d in (run_dir, doubled_batch_adapt))
    assert _values(got["validation"], "val_nll") == pytest.approx(_values(want["validation"], "val_nll"), rel=1e-6)


def test_a_bad_input_stops_every_process_with_one_line(one_process_run, tmp_path):
    """The main process finds the error (here: an arm without kernels); every process stops with it, one says it."""
    import shutil

    _, ref, _ = one_process_run
    shutil.copytree(ref, tmp_path / "run")
    before = {f: (tmp_path / "run" / f).read_bytes() for f in files(tmp_path / "run")}
    proc, writes = launch(tmp_path, {"mode": "cli", "watch": str(tmp_path / "run"),
                                     "args": ["adapt", "--out", str(tmp_path / "run"), "--method", "performer"]},
                          check=False)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("Error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "no calibrated kernels" in errors[0], errors
    assert f"{SRC}{os.sep}oal" not in proc.stdout + proc.stderr  # no traceback from oal (torchrun reports its own)
    assert writes == [[], []]
    assert {f: (tmp_path / "run" / f).read_bytes() for f in files(tmp_path / "run")} == before


def test_a_one_process_command_under_a_launch_stops_every_process_with_one_line(one_process_run, tmp_path):
    """`oal evaluate` runs in one process: under torchrun its processes raced for the run directory's lock, and the
    one refused (often not the main one) stopped the launch without a word. Now every process refuses it at once,
    one says why, and nothing is written."""
    import shutil

    _, ref, _ = one_process_run
    shutil.copytree(ref, tmp_path / "run")
    before = {f: (tmp_path / "run" / f).read_bytes() for f in files(tmp_path / "run")}
    proc, writes = launch(tmp_path, {"mode": "cli", "watch": str(tmp_path / "run"),
                                     "args": ["evaluate", "--out", str(tmp_path / "run"), "--no-progress"]},
                          check=False)
    errors = [line for line in (proc.stdout + proc.stderr).splitlines() if line.startswith("Error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "one process" in errors[0], errors
    assert "in use by another oal process" not in proc.stdout + proc.stderr
    assert writes == [[], []]
    assert {f: (tmp_path / "run" / f).read_bytes() for f in files(tmp_path / "run")} == before


# ----------------------------------------------------------------------------------------------- in one process


def test_sharded_engines_are_refused_before_anything_starts(monkeypatch):
    from oal.launch import Ranks

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(ValueError, match="ACCELERATE_USE_FSDP"):
        Ranks("cpu")


def test_input_errors_travel_whole_between_processes():
    """`Ranks.on_main` pickles the main process's error for the others: the CLI option it names survives."""
    import pickle

    from oal.errors import InputError, SelectionSizeError

    err = pickle.loads(pickle.dumps(InputError("no such arm", "--method")))
    assert (err.param, err.message, str(err)) == ("--method", "no such arm", "method: no such arm")
    big = pickle.loads(pickle.dumps(SelectionSizeError(9, 4)))
    assert (type(big), big.k, big.limit, big.param, str(big)) == (
        SelectionSizeError, 9, 4, "--layers", "layers: expected auto:K with K <= 4 (the candidate layers), got auto:9")


def test_the_process_group_is_destroyed_at_exit(monkeypatch):
    """A launched process that exits with its gloo group alive can abort in gloo's threads ("terminate called
    without an active exception", SIGABRT; seen once in CI after a finished 2-process `oal adapt`): oal's process
    state registers the group's destruction at exit, once however often it is asked for."""
    from oal import launch

    registered = []
    monkeypatch.setattr(launch, "_CLOSING", [])
    monkeypatch.setattr(launch.atexit, "register", lambda fn: registered.append(fn) or fn)
    state = launch._state(cpu=True)
    launch._state(cpu=True)
    assert len(registered) == 1 and registered[0] == state.destroy_process_group


def test_a_one_process_command_is_refused_under_a_launch(monkeypatch, tmp_path):
    """`own_dir` without the launch's group (`oal evaluate`, `analyze`, `diagnose`) under a launch of several
    processes: refused on every process before anything is locked or created (each would take the lock for itself)."""
    from oal.errors import InputError
    from oal.rundir.lock import own_dir

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(InputError, match="one process"):
        with own_dir(tmp_path / "run"):
            pass
    assert not (tmp_path / "run").exists()


def test_another_process_reports_only_an_error_of_its_own(monkeypatch):
    """The CLI printed errors on the main process only, so a failure of rank 1 alone (its scratch disk full) was
    shown by no process: the launch died with torchrun's summary. Errors alike on every process (raised before the
    group formed, or re-raised from the main process by Ranks.on_main) stay the main process's to print."""
    import oal.launch as launch

    exc = OSError("no space left on device")
    monkeypatch.setenv("RANK", "0")
    assert launch.reports_error(exc)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(launch, "_RANKS", {})
    assert not launch.reports_error(exc)  # parsing and checks before the group: every process raises the same
    monkeypatch.setattr(launch, "_RANKS", {"this": object()})
    assert launch.reports_error(exc)
    exc.oal_from_main = True  # what on_main sets on the other processes
    assert not launch.reports_error(exc)


def test_a_capture_left_by_a_process_that_died_is_removed(monkeypatch, tmp_path):
    """torchrun ends the other processes of a failed launch with SIGTERM, which runs no cleanup: each left its
    scratch capture in the temp folder. Another process's capture goes to a locked `user_cache.work_dir` folder,
    and the next one removes those whose lock is free (a pid would misjudge PID namespaces sharing /tmp); a live
    owner's stays, and `remove` takes this process's own away."""
    import tempfile

    from oal.calibration.resume import OnePassCapture, scratch_parent

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    parent = scratch_parent()
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)")
    left, live, other = (parent / f".capture.{name}.tmp" for name in ("left", "live", "other"))
    for folder in (left, live, other):
        (folder / "capture").mkdir(parents=True)
    (left / ".lock").write_text("")  # its owner ended: nobody holds it
    (live / ".lock").write_text("")
    owner = subprocess.Popen([sys.executable, "-c", hold, str(live / ".lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert owner.stdout.readline().strip() == "held"
        capture = OnePassCapture(None, {}, [0], tmp_path / "run" / "capture", "key")
        capture.prepare([0], scratch=True)
        assert not left.exists() and live.exists() and other.exists()  # a young folder without a lock stays
        assert capture.root.parent.parent == parent and capture.root.parent not in (live, other)
    finally:
        owner.kill()
        owner.wait()
    capture.remove()
    assert not capture.root.parent.exists()
