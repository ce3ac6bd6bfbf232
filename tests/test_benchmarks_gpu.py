"""benchmarks.gpu without a GPU: its arguments, the JSON rows the issue asks for, the goals, and which SDPA backend a
profiler trace shows (on canned event names: the real ones come from the GPU run)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks import gpu


@pytest.fixture(autouse=True)
def _triton_interpret_as_it_was():
    """gpu.main(--device cpu) sets TRITON_INTERPRET for its process; in this test process it must not outlive the
    test (on a CUDA test run, later files' kernels would be defined under the interpreter)."""
    before = os.environ.get("TRITON_INTERPRET")
    yield
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before

# event names as torch.profiler reports them for one SDPA call (operator, then kernels), per backend
TRACES = {
    "cudnn": ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_cudnn_attention",
              "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0"],
    "flash": ["aten::scaled_dot_product_attention", "aten::_scaled_dot_product_flash_attention",
              "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false>>"],
    "efficient": ["aten::_efficient_attention_forward", "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEff)"],
    "math": ["aten::_scaled_dot_product_attention_math", "aten::_softmax", "ampere_bf16_s16816gemm_bf16_128x64"],
}


@pytest.mark.parametrize("backend", TRACES)
def test_the_backend_is_read_off_the_trace(backend):
    assert gpu.sdpa_backend(TRACES[backend]) == backend


def test_cudnn_kernels_named_flash_are_cudnn_and_kernels_alone_suffice():
    # cuDNN's kernel names contain "flash": cuDNN wins; without the operator names the kernel names decide
    assert gpu.sdpa_backend(TRACES["cudnn"][2:]) == "cudnn"
    assert gpu.sdpa_backend(TRACES["flash"][2:]) == "flash"
    assert gpu.sdpa_backend(["ampere_sgemm_128x64_nn"]) == "unknown"


def _measured(n, values):
    return {(m, n, mode): {"ms": ms, "peak_mib": 10.0} for (m, mode), ms in values.items()}


def test_rows_have_the_issue_schema_and_nulls_where_not_measured():
    measured = _measured(16384, {("oal", "fwd"): 3.0, ("sdpa", "fwd"): 4.0, ("oal", "fwdbwd"): 9.0,
                                 ("sdpa", "fwdbwd"): 12.0, ("sdpa_flash", "fwd"): 6.0})
    measured |= _measured(2048, {("oal", "fwd"): 0.25, ("sdpa", "fwd"): 0.05})
    rows = [gpu.row_of(n, measured) for n in (2048, 16384)]
    assert rows[1]["oal_fwd_ms"] == 3.0 and rows[1]["sdpa_flash_fwd_ms"] == 6.0 and rows[1]["sdpa_cudnn_fwd_ms"] is None
    assert rows[0]["oal_fwdbwd_ms"] is None
    assert gpu.schema_errors({"rows": rows}) == []
    bad = [dict(rows[0], n=2048.0), {k: v for k, v in rows[1].items() if k != "sdpa_fwd_ms"}]
    assert gpu.schema_errors({"rows": bad}) == ["rows[0].n: expected an int",
                                                "rows[1].sdpa_fwd_ms: expected a float (null where not measured)"]
    goals = gpu.goals(rows)
    assert goals["forward >= default SDPA from 16k"] is True and goals["forward at 2k under 0.3 ms"] is True
    assert goals["forward >= 3x default SDPA at 64k"] is None  # not measured


@pytest.mark.parametrize("argv,message", [
    (["--lengths", "2k"], "--lengths: expected an integer, got '2k'"),
    (["--lengths", "0,1024"], "--lengths: expected an integer in [1, 1048576], got 0"),
    (["--lengths", ","], "--lengths: expected a comma-separated list"),
    (["--repeats", "0"], "--repeats: expected an integer >= 1"),
    (["--methods", "oal,flash"], "--methods: unknown ['flash']"),
    (["--warmup", "-1"], "--warmup: expected an integer >= 0"),
])
def test_bad_arguments_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        gpu.parse_args([*argv, "--device", "cpu"])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_cuda_is_asked_for_where_there_is_none(monkeypatch):
    """Checked in main, after the arguments (which need no torch): run_tool makes it one line and exit code 2."""
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--device: cuda is not available here"):
        gpu.main(["--lengths", "64"])


def test_oal_direct_is_timed_only_where_a_plan_launches(monkeypatch):
    """oal_direct differs from oal only on a kept prefill plan: forward, at most routes.PARALLEL_MAX tokens. Its
    calls run with OAL_TRITON_DIRECT_LAUNCH=1, and the variable is as it was afterwards."""
    from oal.ops.triton import launch, routes

    args = gpu.parse_args(["--device", "cpu"])
    assert gpu.skip_reason("oal_direct", routes.PARALLEL_MAX, args) is None
    assert gpu.skip_reason("oal_direct", routes.PARALLEL_MAX, args, backward=True)
    assert gpu.skip_reason("oal_direct", routes.PARALLEL_MAX + 1, args)
    monkeypatch.delenv(launch.ENV, raising=False)
    seen = []
    monkeypatch.setattr("oal.ops.oal_attention", lambda *a, **kw: seen.append(launch.enabled()))
    gpu.attention("oal_direct")(None, None, None, None, None)
    gpu.attention("oal")(None, None, None, None, None)
    assert seen == [True, False] and launch.ENV not in os.environ


def test_oal_chunked_prev_times_the_chunked_kernels_as_before(monkeypatch):
    """oal_chunked_prev is oal with the chunked kernels as before 2026-12-05 (per-chunk states in fp32, the
    normaliser summed in registers, fp32 feature products, the forward at 64-token chunks), timed only where the
    chunked route runs; the library's settings are back afterwards."""
    from oal.ops.triton import function, routes

    args = gpu.parse_args(["--device", "cpu"])
    assert gpu.skip_reason("oal_chunked_prev", routes.PARALLEL_MAX, args)
    assert gpu.skip_reason("oal_chunked_prev", routes.PARALLEL_MAX + 1, args) is None
    assert gpu.skip_reason("oal_chunked_prev", routes.PARALLEL_MAX + 1, args, backward=True) is None
    q, factor = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16), torch.zeros(2, 4, 16)
    seen = []

    def record(*args, **kwargs):
        cfg = function.config(q, factor, 64)
        seen.append((cfg.state_dtype, function._norm_dot(cfg), function.HALF_PRODUCTS, function.FWD_CHUNKS,
                     kwargs["backend"]))

    monkeypatch.setattr("oal.ops.oal_attention", record)
    gpu.attention("oal_chunked_prev")(None, None, None, None, None)
    gpu.attention("oal")(None, None, None, None, None)
    assert seen == [(torch.float32, False, False, False, "auto"), (torch.bfloat16, True, True, True, "auto")]
    assert function.HALF_STATES == torch.bfloat16 and function.NORM_DOTS and function.HALF_PRODUCTS
    assert function.FWD_CHUNKS


def test_a_method_that_raises_is_noted_and_the_others_are_kept(monkeypatch, tmp_path):
    """Any exception of one method at one length (a kernel's IndexError, Triton's compilation errors, which are not
    RuntimeErrors) is noted in `skipped`, and every other method's timing is still measured and written: a GPU run
    has minutes, not a second try. The sanity check's failure too."""
    real = gpu.measure

    def measure(method, n, backward, args):
        if method == "oal":
            raise IndexError("tuple index out of range")
        return real(method, n, backward, args)

    monkeypatch.setattr(gpu, "measure", measure)
    monkeypatch.setattr(gpu, "sanity", lambda device, n: (_ for _ in ()).throw(KeyError("no such route")))
    out = tmp_path / "gpu.json"
    gpu.main(["--device", "cpu", "--lengths", "32", "--methods", "oal,oal_chunked", "--repeats", "1", "--warmup",
              "0", "--no-backward", "--out", str(out)])
    res = json.loads(out.read_text())
    assert res["skipped"]["oal fwd 32"] == "IndexError: tuple index out of range"
    assert res["sanity"] == res["skipped"]["sanity"] == "KeyError: 'no such route'"
    assert res["rows"][0]["oal_fwd_ms"] is None and res["rows"][0]["oal_chunked_fwd_ms"] > 0


def test_decode_host_notes_a_method_that_raises_and_measures_the_rest(monkeypatch, tmp_path):
    """decode_host: one method's exception is noted in `failed` (and fails the command), the next method and the
    prefill part are still measured and written."""
    from benchmarks import decode_host

    real = decode_host.measure

    def measure(method, args, device, direct=False):
        if method == "oal":
            raise IndexError("tuple index out of range")
        return real(method, args, device, direct)

    monkeypatch.setattr(decode_host, "measure", measure)
    out = tmp_path / "host.json"
    args = decode_host.parse_args(["--device", "cpu", "--methods", "oal,swa", "--steps", "5", "--warmup", "1",
                                   "--prompt", "8", "--out", str(out)])
    assert decode_host.main(args) == 1
    res = json.loads(out.read_text())
    assert res["failed"] == {"oal": "IndexError: tuple index out of range"}
    assert [r["method"] for r in res["rows"]] == ["swa"] and res["prefill"]["oal_us"] > 0


def test_fwdbwd_trains_the_factor_only_for_oal_factor(monkeypatch):
    """The oal methods' forward + backward take the gradients of q, k and v with the factor frozen (the bf16
    kernels, compared with SDPA's q, k, v gradients); oal_factor trains the factor too (joint adaptation, which
    oal_attention runs on fp32 kernels) and is asked for by name only."""
    args = gpu.parse_args(["--device", "cpu", "--repeats", "1", "--warmup", "0"])
    assert "oal_factor" not in args.methods and "oal_factor" in gpu.METHODS
    assert gpu.skip_reason("oal_factor", 64, args) and gpu.skip_reason("oal_factor", 64, args, backward=True) is None
    seen = []
    real = gpu.attention

    def attention(method):
        fn = real(method)

        def call(q, k, v, groups, factor):
            seen.append((method, factor.requires_grad))
            return fn(q, k, v, groups, factor)

        return call

    monkeypatch.setattr(gpu, "attention", attention)
    for method in ("oal", "oal_chunked", "oal_factor"):
        gpu.measure(method, 32, True, args)
    assert set(seen) == {("oal", False), ("oal_chunked", False), ("oal_factor", True)}


def test_sanity_checks_the_bf16_kernels_and_the_trained_factor():
    """The sanity check's errors against the fp32 torch path, under the interpreter: out, dq, dk, dv of the bf16
    kernels at the bf16 level, and the trained factor's gradient (fp32 kernels) well within 1% (Eq. 7)."""
    res = gpu.sanity("cpu", 48)["rel_err_vs_chunked_fp32"]
    for route in ("oal_parallel", "oal_chunked"):
        errs = res[route]
        assert max(errs[name] for name in ("out", "dq", "dk", "dv")) < 3e-2, (route, errs)
        assert errs["dfactor"] < 1e-3, (route, errs)


def test_the_cpu_smoke_test_runs_the_kernels_under_the_interpreter_it_names(tmp_path):
    """`benchmarks.gpu --device cpu` is documented as a smoke test under Triton's interpreter, but it left
    TRITON_INTERPRET to the caller: run as documented, its sanity check and the forced-Triton rows failed with
    "backend: 'triton' runs on CUDA tensors (or on CPU with TRITON_INTERPRET=1)"."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "gpu.json"
    res = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--lengths", "16", "--repeats",
                          "1", "--warmup", "0", "--sanity-n", "16", "--methods", "oal_chunked", "--no-backward",
                          "--out", str(out)], capture_output=True, text=True, env=env, timeout=600,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
    record = json.loads(out.read_text())
    assert record["skipped"] == {} and isinstance(record["sanity"], dict), record["skipped"]
    assert record["rows"][0]["oal_chunked_fwd_ms"] > 0


def test_progress_goes_to_stderr_and_the_table_to_stdout(monkeypatch, tmp_path, capsys):
    """benchmarks.gpu printed each measurement's progress line on stdout, among its results."""
    monkeypatch.setattr(gpu, "measure", lambda method, n, backward, args: {"ms": 1.0, "ms_all": [1.0], "host_ms": 0.5,
                                                                          "peak_mib": None})
    monkeypatch.setattr(gpu, "default_backend", lambda n, device: {"n": n, "backend": "math", "kernels": []})
    gpu.main(["--device", "cpu", "--lengths", "32", "--methods", "oal,sdpa", "--sanity-n", "0", "--repeats", "1",
              "--no-backward", "--out", str(tmp_path / "gpu.json")])
    out, err = capsys.readouterr()
    assert "N=     32" in err and "N=     32" not in out
    assert "goal:" in out and "sdpa/OAL" in out and "wrote" in err


def test_writes_between_methods_say_they_are_partial(monkeypatch, tmp_path):
    """scripts/gpu_*.sh stop a part with SIGINT, then SIGKILL 15 s later: a JSON written between methods, left by
    the kill, said "interrupted": false as a finished run does. Only the last write is `complete`."""
    import oal.rundir.files as files

    writes, real = [], files.atomic_write_json
    monkeypatch.setattr(files, "atomic_write_json", lambda path, obj: writes.append(json.loads(json.dumps(obj)))
                        or real(path, obj))
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # main sets it for the CPU smoke test: undone after this one
    gpu.main(["--device", "cpu", "--lengths", "32", "--methods", "oal,oal_chunked", "--repeats", "1", "--warmup",
              "0", "--no-backward", "--sanity-n", "0", "--out", str(tmp_path / "gpu.json")])
    assert len(writes) >= 3 and [w["complete"] for w in writes] == [False] * (len(writes) - 1) + [True]
    assert json.loads((tmp_path / "gpu.json").read_text())["complete"] is True
