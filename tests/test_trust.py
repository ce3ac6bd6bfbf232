"""Run directories that cannot be turned against their owner (issue 28): nothing outside them is written, renamed or
deleted (symbolic links that leave them are refused), one writer at a time (the directory's lock), no number reaches
metrics.json or report.md except from a verified record, a setting is recorded only with the artefact it describes,
and a one-line error where a traceback was."""

from __future__ import annotations

import errno
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import test_integrity
import torch
from test_integrity import CFG, _cfg, assert_bad_input, cli, tree

from oal.errors import InputError
from oal.pipeline.runs import adapt_arm, run_seed
from oal.rundir.confine import confined, escaping_links, inside
from oal.rundir.files import atomic_dir, atomic_save_safetensors, atomic_write_json, clean_tmp, make_dirs, remove
from oal.rundir.lock import LOCK_FILE, own_dir

SRC = Path(__file__).resolve().parents[1] / "src"
# the tiny model, its corpus and a finished run of it (test_integrity's fixtures; this module makes its own run)
assets, full_run, run_copy = test_integrity.assets, test_integrity.full_run, test_integrity.run_copy


def _outside(tmp_path: Path) -> Path:
    """A folder outside the run directory with one file that must survive everything."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    return out


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _metrics(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text())


# ------------------------------------------------------------------------------------------- confinement (library)


def test_confined_writes_refuse_links_that_leave(tmp_path):
    run_dir, outside = tmp_path / "run", _outside(tmp_path)
    run_dir.mkdir()
    (run_dir / "link").symlink_to(outside, target_is_directory=True)
    (run_dir / "inner").mkdir()
    (run_dir / "inner_link").symlink_to(run_dir / "inner", target_is_directory=True)  # stays inside: allowed
    before = _snapshot(outside)
    with confined(run_dir):
        for write in (lambda: atomic_write_json(run_dir / "link" / "x.json", {}),
                      lambda: atomic_save_safetensors(run_dir / "link" / "sub" / "x.safetensors", {"t": torch.ones(1)}),
                      lambda: atomic_dir(run_dir / "link" / "ckpt").__enter__(),
                      lambda: make_dirs(run_dir / "link" / "figures"),
                      lambda: remove(run_dir / "link" / "keep.txt"),
                      lambda: atomic_write_json(tmp_path / "elsewhere.json", {}),  # not below the run directory
                      lambda: atomic_write_json(run_dir / ".." / "escape.json", {})):
            with pytest.raises(InputError) as exc:
                write()
            assert exc.value.param == "--out"
        atomic_write_json(run_dir / "inner_link" / "ok.json", {"a": 1})
        remove(run_dir / "link")  # the link itself goes; what it points to stays
    assert _snapshot(outside) == before and not (tmp_path / "elsewhere.json").exists()
    assert not (run_dir / "link").exists() and (run_dir / "inner" / "ok.json").is_file()
    assert "symbolic link" in str(pytest.raises(InputError, lambda: _write_in(run_dir, outside)).value)
    # unconfined (a library caller choosing its own paths): nothing is checked
    atomic_write_json(outside / "mine.json", {})
    assert (outside / "mine.json").is_file()


def _write_in(run_dir: Path, outside: Path):
    (run_dir / "figures").symlink_to(outside, target_is_directory=True)
    with confined(run_dir):
        atomic_write_json(run_dir / "figures" / "x.json", {})


def test_clean_tmp_and_escaping_links_never_follow_a_link(tmp_path):
    run_dir, outside = tmp_path / "run", _outside(tmp_path)
    (run_dir / "adapter").mkdir(parents=True)
    (outside / ".stale.abc.tmp").write_text("not ours")
    (run_dir / "adapter" / "oal").symlink_to(outside, target_is_directory=True)
    (run_dir / ".metrics.json.x1.tmp").write_text("half")
    with confined(run_dir):
        removed = clean_tmp(run_dir)
    assert removed == [run_dir / ".metrics.json.x1.tmp"] and (outside / ".stale.abc.tmp").is_file()
    assert escaping_links(run_dir) == [(run_dir / "adapter" / "oal", str(outside.resolve()))]
    with pytest.raises(InputError, match="symbolic links that leave it"):
        with own_dir(run_dir):
            pass
    assert inside(tmp_path / "x") == tmp_path / "x"  # outside any confined block


_SWAP = """
import sys
from oal.rundir.files import atomic_dir
with atomic_dir(sys.argv[1]) as tmp:
    (tmp / "who").write_text("the other process")
print("swapped", flush=True)
"""


def test_two_writers_of_one_folder_swap_in_turn(tmp_path):
    """Two `oal export --to X` at once each moved X to the one `.X.old` name, and one failed with 'Directory not
    empty' (a helper lined the swaps up with a barrier): a swap holds its folder's lock, so the last one wins."""
    from oal.rundir.files import flock

    target = tmp_path / "X"
    with atomic_dir(target) as tmp:
        (tmp / "who").write_text("this process")
    with flock(tmp_path):  # as a swap of this process would hold it
        proc = subprocess.Popen([sys.executable, "-c", _SWAP, str(target)], stdout=subprocess.PIPE, text=True,
                                env={**os.environ, "PYTHONPATH": str(SRC)})
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=3)  # it waits for the lock
        assert (target / "who").read_text() == "this process"
    assert proc.stdout.readline().strip() == "swapped" and proc.wait(timeout=60) == 0
    assert (target / "who").read_text() == "the other process"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["X"]  # no .X.old, no temporary, no lock file


# ------------------------------------------------------------------------------------------- the lock


_HOLD = """
import sys, time
from oal.rundir.lock import own_dir
with own_dir(sys.argv[1]):
    print("held", flush=True)
    time.sleep(120)
"""


def _holder(path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(SRC)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_refuses_a_second_writer_and_dies_with_its_holder(tmp_path):
    d = tmp_path / "run"
    proc = _holder(d)
    try:
        with pytest.raises(InputError, match=rf"in use by another oal process \(pid {proc.pid}: .*python") as exc:
            with own_dir(d):
                pass
        assert exc.value.param == "--out"
    finally:
        proc.send_signal(signal.SIGKILL)  # a kill leaves no stale lock: the kernel drops it with the process
        proc.wait()
    with own_dir(d):
        with own_dir(d):  # nested in one process (`oal run` over its seeds, `oal adapt` over the pipeline)
            pass
    assert (d / LOCK_FILE).read_bytes() == b""


def test_commands_refuse_a_directory_in_use(assets, run_copy):
    before = tree(run_copy)
    proc = _holder(run_copy)
    try:
        model = ("--model", assets / "model", "--data", assets / "corpus.txt")
        for args in (("run", "--out", run_copy, *model, "--tasks", "none"),
                     ("adapt", "--out", run_copy, "--steps", "1", "--no-progress"),
                     ("evaluate", "--out", run_copy), ("evaluate", "--out", run_copy, "--passkey"),
                     ("select-layers", "--out", run_copy, "--k", "1", *model)):
            assert_bad_input(cli(*args), "--out", "in use by another oal process", f"pid {proc.pid}")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert tree(run_copy) == before


def test_a_read_only_run_is_named_before_any_work(run_copy, monkeypatch):
    """Resuming a run in a read-only folder failed on its first write, naming `.config.json.<random>.tmp`."""
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == run_copy and mode == os.W_OK
                        else real(p, mode))
    with pytest.raises(InputError, match="is not writable") as exc:
        with own_dir(run_copy):
            pass
    assert exc.value.param == "--out"


def test_the_stage_commands_and_linearize_refuse_a_folder_in_use(assets, run_copy, tmp_path):
    """Two calibrations into one folder deleted each other's capture files (one failed with a missing or changed
    capture file, and calibration.json listed only the last method), and `oal diagnose` wrote a run's report while
    `oal run` held it: every command that writes a folder now holds its lock."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import oal

    d = tmp_path / "stage"
    model = ("--model", assets / "model", "--data", assets / "corpus.txt")
    for folder, args in ((d, ("analyze", "--out", d, *model, "--layers", "1", "--no-figures")),
                         (d, ("calibrate", "--out", d, *model, "--methods", "global", "--layers", "1")),
                         (run_copy, ("diagnose", "--out", run_copy, "--model", assets / "model", "--parts", "table2",
                                     "--layers", "1"))):
        before = tree(folder) if folder.exists() else None
        proc = _holder(folder)
        try:
            assert_bad_input(cli(*args), "--out", "in use by another oal process", f"pid {proc.pid}")
            mdl, tok = AutoModelForCausalLM.from_pretrained(assets / "model"), AutoTokenizer.from_pretrained(
                assets / "model")
            with pytest.raises(InputError, match="in use by another oal process"):
                oal.linearize(mdl, tok, (assets / "corpus.txt").read_text(), layers=[1], method="global",
                              out_dir=folder, progress=False)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if before is not None:
            assert tree(folder) == before
    seed = d / "seed-1"  # a folder below a held one takes its own lock: another command may not write it meanwhile
    proc = _holder(seed)
    try:
        with own_dir(d), pytest.raises(InputError, match="in use by another oal process"):
            with own_dir(seed):
                pass
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


def test_a_rerun_naming_the_same_files_by_other_paths_resumes(assets, run_copy, tmp_path, monkeypatch):
    """A resumed run was refused when --data named the same file by another path (config.data is stored as typed,
    its content by SHA256); content decides, and nothing is computed again."""
    monkeypatch.chdir(tmp_path)
    before = tree(run_copy)
    cfg = _cfg(assets, **CFG)
    cfg.data, cfg.model = os.path.relpath(cfg.data), os.path.relpath(cfg.model)  # relative, from elsewhere
    run_seed(cfg, run_copy, progress=False)
    after = tree(run_copy)
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert changed <= {"config.json", "metrics.json", "report.md", ".oal/stages.json"}  # the records, no result
    other = tmp_path / "other.txt"
    other.write_text((assets / "corpus.txt").read_text().replace("alpha", "omega"))
    cfg.data = str(other)
    with pytest.raises(InputError, match=r"another configuration \(data\.test: "):
        run_seed(cfg, run_copy, progress=False)


def test_force_deletes_every_result_of_a_run(run_copy):
    """`--force` left budget.json and regime.json of the earlier configuration, which the new report shows, and the
    per-question samples of `oal evaluate --zeroshot --log-samples` beside the new run's numbers."""
    from oal.pipeline.evaluate_zeroshot import SAMPLES_DIR
    from oal.rundir.claim import clear_run

    assert {"budget.json", "regime.json"} <= {p.name for p in run_copy.iterdir()}
    (run_copy / SAMPLES_DIR).mkdir()
    (run_copy / SAMPLES_DIR / "oal.json").write_text("{}")
    clear_run(run_copy)
    assert [p.name for p in run_copy.iterdir() if p.name != LOCK_FILE] == []


# ------------------------------------------------------------------------------------------- links in a run directory


@pytest.mark.parametrize("link", [".oal/checkpoints", "figures", "adapter/oal"])
def test_links_that_leave_the_run_are_refused_before_anything_is_written(link, assets, run_copy, tmp_path):
    outside = _outside(tmp_path)
    if link == "adapter/oal":
        adapter = (run_copy / link / "adapter_model.safetensors").read_bytes()
        (outside / "adapter_model.safetensors").write_bytes(adapter)
    target = run_copy / link
    remove(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.symlink_to(outside, target_is_directory=True)
    before, outside_before = tree(run_copy), _snapshot(outside)
    assert_bad_input(cli("adapt", "--out", run_copy, "--steps", "1", "--no-progress"), "--out", link, "leave")
    with pytest.raises(InputError, match="symbolic links that leave it"):
        run_seed(_cfg(assets, **CFG), run_copy, progress=False)
    assert _snapshot(outside) == outside_before and tree(run_copy) == before


def test_acceptance_symlinked_checkpoints_and_edited_metrics(full_run, run_copy, tmp_path):
    """The issue's acceptance check: a symlinked .oal/checkpoints, then `oal adapt --steps 1`: the outside file
    survives and nothing is written there; perplexity.oal edited to 50, then `oal evaluate`: 50 is not republished."""
    outside = _outside(tmp_path)
    remove(run_copy / ".oal" / "checkpoints")  # the run leaves it empty
    (run_copy / ".oal" / "checkpoints").symlink_to(outside, target_is_directory=True)
    res = cli("adapt", "--out", run_copy, "--steps", "1", "--no-progress")
    assert res.exit_code == 2 and "checkpoints" in res.output
    assert _snapshot(outside) == {"keep.txt": b"precious"}
    (run_copy / ".oal" / "checkpoints").unlink()

    metrics = _metrics(run_copy)
    true_ppl = metrics["perplexity"]["oal"]
    metrics["perplexity"]["oal"] = 50
    (run_copy / "metrics.json").write_text(json.dumps(metrics, indent=2))
    res = cli("evaluate", "--out", run_copy, "--no-adapter", env={"COLUMNS": "1000"})  # log lines unwrapped
    assert res.exit_code == 0, res.output
    assert "metrics.json was changed since oal wrote it" in res.stderr
    assert _metrics(run_copy)["perplexity"]["oal"] == true_ppl == full_run[1]["perplexity"]["oal"]
    report = (run_copy / "report.md").read_text()
    assert "50.0000" not in report and f"{true_ppl:.4f}" in report


# ------------------------------------------------------------------------------------------- verified metrics


def test_metrics_are_rebuilt_from_verified_records(assets, full_run, run_copy):
    res = cli("evaluate", "--out", run_copy, "--blocks", "1")  # the adapted model: fidelity_adapted
    assert res.exit_code == 0, res.output
    adapted = _metrics(run_copy)["fidelity_adapted"]["oal"]
    assert adapted["n_blocks"] == 1 and math.isfinite(adapted["mse"])
    records = json.loads((run_copy / ".oal" / "evaluations.json").read_text())
    assert set(records) == {"fidelity_adapted:oal"} and "adapter/oal/adapter_model.safetensors" in \
        records["fidelity_adapted:oal"]["inputs"]
    # an edited record is not republished either: its SHA256 no longer verifies
    value = run_copy / records["fidelity_adapted:oal"]["outputs"][0]
    text = value.read_text()
    assert str(adapted["mse"]) in text
    value.write_text(text.replace(str(adapted["mse"]), "1e-9"))
    metrics = run_seed(_cfg(assets, **CFG), run_copy, progress=False)  # `oal run` resumes: nothing recomputed
    assert "fidelity_adapted" not in metrics and metrics["perplexity"] == full_run[1]["perplexity"]
    # a record whose files changed (the adapter retrained) is left out; the run's own numbers follow the adapter
    value.unlink()
    assert cli("evaluate", "--out", run_copy, "--blocks", "1").exit_code == 0
    assert "fidelity_adapted" in _metrics(run_copy)
    adapt_arm(run_copy, "oal", steps=2, progress=False)
    metrics = _metrics(run_copy)
    assert "fidelity_adapted" not in metrics and metrics["adapt"]["oal"]["steps"] == 2
    assert metrics["sha256"]["adapter/oal/adapter_model.safetensors"] != \
        full_run[1]["sha256"]["adapter/oal/adapter_model.safetensors"]


def test_a_failed_report_is_redone_without_calling_metrics_edited(run_copy, monkeypatch, caplog):
    """metrics.json is written before the report that reads it: a report that fails must leave a report to redo,
    not a metrics.json the next publish calls "changed since oal wrote it"."""
    from oal.pipeline.decoder import Run
    from oal.pipeline.publish import republish

    def broken(run_dir, console):
        raise OSError("disk went away")

    with monkeypatch.context() as m:
        m.setattr(Run, "report", staticmethod(broken))
        with pytest.raises(OSError):
            republish(run_copy)
    with caplog.at_level("WARNING", logger="oal"):
        republish(run_copy)
    assert "changed since oal wrote it" not in caplog.text
    # an edit made after that is still caught
    (run_copy / "metrics.json").write_text((run_copy / "metrics.json").read_text().replace("\n", "\n "))
    with caplog.at_level("WARNING", logger="oal"):
        republish(run_copy)
    assert "metrics.json was changed since oal wrote it" in caplog.text


def test_failed_adapt_records_no_setting(assets, run_copy, monkeypatch):
    config = (run_copy / "config.json").read_bytes()
    import oal.pipeline.decoder as decoder

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # a kill (Ctrl-C) in the middle of the adaptation

    monkeypatch.setattr(decoder, "adapt", killed)
    with pytest.raises(KeyboardInterrupt):
        adapt_arm(run_copy, "oal", steps=3, progress=False)
    assert (run_copy / "config.json").read_bytes() == config  # still the settings the adapter on disk has
    assert json.loads((run_copy / "adapter" / "oal" / "adapt.json").read_text())["steps"] == 4
    monkeypatch.undo()
    metrics = adapt_arm(run_copy, "oal", steps=3, progress=False)
    recorded = json.loads((run_copy / "config.json").read_text())["config"]["adapt_overrides"]
    assert recorded == {"oal": {"steps": 3}} and metrics["adapt"]["oal"]["steps"] == 3


# ------------------------------------------------------------------------------------------- full disk


def test_no_space_is_one_line_and_leaves_nothing_half_written(run_copy, tmp_path, monkeypatch):
    real_replace = os.replace

    def full(src, dst):
        if str(dst).endswith("metrics.json"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full)
    metrics = (run_copy / "metrics.json").read_bytes()
    res = cli("evaluate", "--out", run_copy, "--no-adapter")
    assert_bad_input(res, "metrics.json", "no space left on the device")
    assert (run_copy / "metrics.json").read_bytes() == metrics
    assert not [p for p in run_copy.rglob("*.tmp")]
    monkeypatch.undo()

    from safetensors import SafetensorError

    def rust_full(*args, **kwargs):  # how safetensors reports it (no errno, the OS error in the text)
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr("oal.rundir.files.save_file", rust_full)
    with pytest.raises(OSError, match=r"x.safetensors: no space left"):
        atomic_save_safetensors(tmp_path / "x.safetensors", {"t": torch.ones(2)})
    assert not [p for p in tmp_path.iterdir() if "x.safetensors" in p.name]  # nor its temporary file


def test_no_space_during_export_is_one_line(run_copy, tmp_path, monkeypatch):
    import transformers

    def full(self, *args, **kwargs):
        raise Exception("No space left on device (os error 28)")  # what the weights writer raised in the trial

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", full)
    res = cli("export", "--out", run_copy, "--method", "oal", "--to", tmp_path / "conv")
    assert_bad_input(res, "conv", "no space left on the device")
    assert not (tmp_path / "conv").exists() and not list(tmp_path.glob(".conv*"))


# ------------------------------------------------------------------------------------------- one-line errors


def test_one_line_errors_where_tracebacks_were(assets, run_copy, tmp_path):
    model = ("--model", assets / "model", "--data", assets / "corpus.txt")
    for value in ("-0.5", "nan", "1.5"):
        out = tmp_path / f"a{value}"
        assert_bad_input(cli("analyze", "--out", out, *model, "--layers", "1", "--heldout", "0",
                             "--tail-fraction", value), "--tail-fraction", "alpha in (0, 1]")
    assert_bad_input(cli("analyze", "--out", tmp_path / "s", *model, "--layers", "1", "--heldout", "0",
                         "--min-support", "nan"), "--min-support")
    assert_bad_input(cli("diagnose", "--out", tmp_path / "d", "--sequences", "0"), "--sequences")
    assert_bad_input(cli("demo", "--length", "100000000"), "--length", "GiB", "available")
    before = tree(run_copy)
    assert_bad_input(cli("run", "--out", run_copy, "--seeds", "99999999999999999999999"), "seeds", "2**32")
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(bytes(range(256)) * 4)
    assert_bad_input(cli("run", "--out", run_copy, "--task-file", f"piqa={binary}"), str(binary), "UTF-8")
    assert_bad_input(cli("evaluate", "--out", run_copy, "--zeroshot", "--passkey"), "--zeroshot", "--passkey")
    assert tree(run_copy) == before
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    for f in (assets / "model").iterdir():
        truncated.joinpath(f.name).write_bytes(f.read_bytes()[:1000] if f.suffix == ".safetensors"
                                                else f.read_bytes())
    assert_bad_input(cli("run", "--out", tmp_path / "t", "--model", truncated, "--data", assets / "corpus.txt"),
                     "--model", str(truncated), "damaged or truncated")


def test_wikitext_offline_is_one_line(assets, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")  # the GPU machine (and its twin) has none

    import huggingface_hub.constants as hc

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))  # read when called (the env only at import)
    res = cli("run", "--out", tmp_path / "w", "--model", assets / "model", "--data", "wikitext-2-raw-v1",
              env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "cache"),
                   "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert_bad_input(res, "--data", "wikitext-2-raw-v1", "is not in the Hugging Face cache", "hf download",
                     "--data-dir")


def test_a_pinned_model_missing_offline_is_a_model_error(tmp_path, monkeypatch):
    """`oal run` printed the message unlabelled, as if no option were at fault; `oal analyze` named --model."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(tmp_path / "hub"))
    res = cli("run", "--out", tmp_path / "w", "--model", "Qwen/Qwen2.5-0.5B", env={"HF_HUB_OFFLINE": "1"})
    assert_bad_input(res, "Invalid value for '--model'", "not in the Hugging Face cache", "hf download")
    assert not (tmp_path / "w" / "config.json").exists()


def test_blocks_beyond_the_plan_are_clamped_with_a_warning_and_logs_go_to_stderr(run_copy):
    proc = subprocess.run([sys.executable, "-m", "oal", "evaluate", "--out", str(run_copy), "--no-adapter",
                           "--blocks", "100000"], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = " ".join(proc.stderr.split())
    assert "--blocks 100000: the split plan has only 2 fidelity blocks; using all 2" in err
    assert "using oal with its calibrated kernels only" in err  # an INFO log line: on stderr ...
    assert "using oal" not in proc.stdout and "WARNING" not in proc.stdout  # ... never among the results
    assert "frozen-attention fidelity" in proc.stdout
    assert _metrics(run_copy)["fidelity"]["oal"]["n_blocks"] == 2


def test_initial_state_with_a_negative_denominator_is_refused():
    from oal.ops import oal_attention
    from oal.ops.kernel import taylor_factor

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 7, 4, generator=gen, dtype=torch.float64) for h in (2, 1, 1))
    groups, factor = torch.zeros(2, 4, dtype=torch.long), taylor_factor(2, 1).double()
    _, state = oal_attention(q, k, v, groups, factor, output_final_state=True)
    oal_attention(q, k, v, groups, factor, initial_state=state)  # a real state passes
    bad = state.clone()
    bad[..., -1] = -bad[..., -1]
    for backend in ("reference", "recurrent", "chunked"):
        with pytest.raises(ValueError, match=r"initial_state: its denominator column .* got count -7"):
            oal_attention(q, k, v, groups, factor, initial_state=bad, backend=backend)


_CHILD = """
import logging
from oal.cli.app import setup_logging
from oal.launch import ranks
setup_logging(logging.INFO)
print(ranks("cpu").size)
"""
_PARENT = """
import os, subprocess, sys
sys.exit(subprocess.run([sys.executable, "-c", os.environ["CHILD"]]).returncode)
"""


def test_one_process_accelerate_launch_of_one_is_fine():
    """`accelerate launch --cpu --num_processes 1` runs its one-process launcher (ACCELERATE_USE_CPU set, no
    WORLD_SIZE): the child reads the launcher's command line, and one process asked for one is not refused. The
    parent here stands in for accelerate with the same arguments on its command line."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.update(PYTHONPATH=str(SRC), ACCELERATE_USE_CPU="True", CHILD=_CHILD)
    proc = subprocess.run([sys.executable, "-c", _PARENT, "launch", "--cpu", "--num_processes", "1", "-m", "oal"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "1", proc.stderr


def test_real_accelerate_cpu_launch_of_two_is_refused(tmp_path):
    """`accelerate launch --cpu --num_processes 2` would run one process: refused, with the torchrun line."""
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.update(PYTHONPATH=str(SRC))
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", str(script)],
                          capture_output=True, text=True, env=env, timeout=300)
    err = " ".join(proc.stderr.split())
    assert proc.returncode != 0 and proc.stdout.split() == [], (proc.stdout, err[-2000:])
    assert "starts 1 process, not 2" in err and "torchrun --nproc_per_node 2" in err
