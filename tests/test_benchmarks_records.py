"""What a benchmark writes: every JSON records what its numbers were measured with (the library's and torch's
versions, the commit of the checkout, the machine), every file is written to a temporary name and renamed into
place, and every run that writes a JSON writes its PNG beside it. Tiny sizes, no timing."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
# the modules that write a benchmark JSON of their own (budget collects run directories, which record theirs)
WRITERS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                 if not p.name.startswith("_") and p.stem != "budget") + ["_contention"]


def _has_environment(record: dict) -> None:
    env = record["environment"]
    assert env["versions"]["torch_build"] == torch.__version__ and "oal" in env["versions"]
    assert "commit" in env and env["machine"]["cpu"] and env["machine"]["cpu_count"] >= 1
    assert env["machine"]["threads"] == torch.get_num_threads()


def test_the_environment_names_versions_commit_and_machine(monkeypatch):
    from benchmarks._common import environment

    monkeypatch.setenv("COMMIT", "abc123")
    _has_environment({"environment": environment()})
    assert environment()["commit"] == "abc123"  # as scripts/gpu_check.sh: a copy without .git is told its commit
    monkeypatch.delenv("COMMIT")
    commit = environment()["commit"]
    assert commit is None or commit.split("+")[0].isalnum()


@pytest.mark.parametrize("name", WRITERS)
def test_every_benchmark_records_its_environment(name):
    """Each module that writes a benchmark JSON puts `_common.environment()` in it (the tiny runs below check the
    files of a few of them)."""
    assert "environment()" in (ROOT / "benchmarks" / f"{name}.py").read_text(), name


def test_window_and_methods_record_their_environment(tmp_path):
    from benchmarks import methods, window

    window.main(window.parse_args(["--lengths", "16", "--repeats", "1", "--out", str(tmp_path / "w.json")]))
    methods.main(methods.parse_args(["--lens", "16", "--repeats", "1", "--out", str(tmp_path / "m.json")]))
    for name in ("w", "m"):
        _has_environment(json.loads((tmp_path / f"{name}.json").read_text()))
        assert (tmp_path / f"{name}.png").stat().st_size > 0


def test_decode_writes_its_figure_atomically_and_records_its_environment(tmp_path, monkeypatch):
    """benchmarks.decode saved its PNG with fig.savefig straight to its final name (a run cut off there left half
    a file), and its JSON named the machine only by platform.processor()."""
    from benchmarks import decode
    from oal.rundir import files

    renamed = []
    real = files._replace
    monkeypatch.setattr(files, "_replace", lambda tmp, path: (renamed.append(Path(path).name), real(tmp, path))[1])
    monkeypatch.setattr(decode, "RESULTS", tmp_path)
    rows = [{"context": c, "ms_per_token": 1.0, "cache_bytes": 2**20, "cache_bytes_per_layer": {0: 2**20}}
            for c in (1024, 4096, 32768)]
    record = {"variants": {v: rows for v in ("softmax", "oal", "oal-all")}, "source": "stub",
              "speedup_vs_softmax": {v: {str(r["context"]): 1.0 for r in rows} for v in ("oal", "oal-all")}}
    monkeypatch.setattr(decode, "measure", lambda shape, contexts, tokens: record)
    decode.main(decode.parse_args(["--shape", "default", "--tokens", "1"]))
    assert sorted(renamed) == ["decode.json", "decode.png"]
    _has_environment(json.loads((tmp_path / "decode.json").read_text()))


def test_operator_sweep_writes_its_png_beside_the_json(tmp_path, monkeypatch):
    """`operator --sweep` wrote no PNG, though --help says every run writes one beside its JSON."""
    from benchmarks import operator

    row = {"dtype": "float32", "time_s": 0.5, "gemm_gflops": 10.0, "peak_mib": 1.0, "load_before": 0.1}
    monkeypatch.setattr(operator, "_child", lambda args: dict(row))
    out = tmp_path / "sweep.json"
    operator._sweep(256, 1, "cpu", ["float32"], out)
    assert out.with_suffix(".png").stat().st_size > 0
    _has_environment(json.loads(out.read_text()))


def test_capture_records_the_machine_it_ran_on_not_a_fixed_note(tmp_path, monkeypatch):
    """benchmarks.capture wrote "one run on a shared, busy 2-core CPU" into every JSON, whatever it ran on."""
    from benchmarks import capture

    class Stub:
        def to(self, *a):
            return self

        def eval(self):
            return self

    class Store:
        def load(self, role, layer):
            return {f: torch.zeros(1) for f in ("q", "k", "v", "out")}

    monkeypatch.setattr(capture.AutoModelForCausalLM, "from_config", lambda cfg: Stub())
    monkeypatch.setattr(capture, "capture_to_disk", lambda *a, **k: Store())
    monkeypatch.setattr(capture, "capture_layer_data",
                        lambda *a, **k: types.SimpleNamespace(**{f: torch.zeros(1) for f in ("q", "k", "v", "out")}))
    out = tmp_path / "capture.json"
    capture.main(capture.parse_args(["--seq-len", "4", "--blocks", "1", "--depths", "1", "--out", str(out)]))
    record = json.loads(out.read_text())
    assert "busy 2-core" not in json.dumps(record)
    _has_environment(record)


def test_retime_on_cuda_names_the_gpu_as_the_frontier_does(tmp_path, monkeypatch):
    """frontier_retime's `machine` left out the GPU that benchmarks.frontier records, so the figure of a re-timed
    CUDA frontier said "CPU, N threads"."""
    from benchmarks import frontier, frontier_retime

    src = tmp_path / "f.json"
    times = {"prefill_s": {"64": 1.0}, "decode_ms": {"64": 2.0}, "peak_mb": None}
    src.write_text(json.dumps({"model": "m", "window": 64, "sinks": 4, "provenance": {"state_dict_sha256": "s"},
                               "softmax": {"ppl": 1.0, "passkey": {"128": 1.0}, **times}, "rows": [],
                               "machine": {"threads": 1}, "steps": 1}))

    class Stub:
        def __init__(self, args, log):
            self.prov, self.model, self.text = {"state_dict_sha256": "s"}, None, None
            self.device = torch.device("cuda", 0)

    monkeypatch.setattr(frontier, "Frontier", Stub)
    monkeypatch.setattr(frontier, "timing", lambda *a: times)
    monkeypatch.setattr(frontier_retime, "build", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    out = frontier_retime.retime(frontier_retime.parse([str(src), "--repeats", "1", "--json",
                                                        str(tmp_path / "o.json")]), log=lambda *_: None)
    assert out["machine"]["gpu"] == "NVIDIA H200" and out["machine"]["device"] == "cuda:0"
    _has_environment(out)


def test_a_failed_timing_child_says_why():
    """operator and model time in children; a failure raised CalledProcessError and threw the child's stderr away."""
    import sys

    from benchmarks._common import child_json

    assert child_json([sys.executable, "-c", "print('progress'); print('{\"ms\": 1.5}')"], "ok") == {"ms": 1.5}
    with pytest.raises(RuntimeError, match=r"(?s)the child failed \(exit code 1\).*boom: out of memory"):
        child_json([sys.executable, "-c", "import sys; sys.exit('boom: out of memory')"], "the child")
