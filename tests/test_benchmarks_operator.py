"""benchmarks.operator's acceptance table (issue 36): a run with the fixed defaults beside a tuned one."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.operator import compare, gemm_dtype, goal_for, oal_flops, parse_settings


def _run(path, settings, ratios, pct, bf16_gemms=True):
    summary = [{"n": n, "dtype": dt, "ratio_sdpa_over_oal": r, "pct_of_gemm": p, "gemm_gflops": 160.0, "load": 0.1,
                "goal": g, "gemm_goal_pct": gg, "settings": settings}
               for (n, dt, g, gg), r, p in zip([(4096, "float32", 1.0, None), (16384, "float32", 4.0, 60.0),
                                                 (4096, "bfloat16", 1.5, None)], ratios, pct, strict=True)]
    cpu = {"model": "Test CPU", "flags": ["avx2", "avx512_bf16"], "capability": "AVX512", "bf16_gemms": bf16_gemms}
    path.write_text(json.dumps({"summary": summary, "cpu": cpu, "threads": 2, "clock": "wall", "torch": "x"}))
    return path


def test_compare_puts_fixed_and_tuned_side_by_side_with_the_goals(tmp_path):
    fixed = _run(tmp_path / "fixed.json", {"chunk": 32, "block_chunks": 16, "pipeline": True, "kv_groups": 0},
                 [0.8, 3.0, 1.0], [40, 45, 10])
    tuned = _run(tmp_path / "tuned.json", {"chunk": 64, "block_chunks": 4, "pipeline": True, "kv_groups": 2},
                 [1.1, 4.2, 1.6], [55, 61, 12])
    text = compare(fixed, tuned)
    assert "Test CPU (AVX512; flags avx2 avx512_bf16; bf16 GEMMs yes)" in text
    assert "| float32 | 16384 | 32x16 pipeline / 64x4 pipeline/kv2 | 3.00 | 4.20 | 4, 60% of GEMM | 45% | 61% |" in text
    assert "float32 N=16384: 61% of GEMM (goal 60%) met" in text and "bfloat16 N=4096: 1.60 (goal 1.5) met" in text
    assert (tmp_path / "operator_tuning.md").read_text() == text


def test_flops_grow_with_the_chunk():
    assert oal_flops(4096, "float32", 64) > oal_flops(4096, "float32", 32) == oal_flops(4096, "float32")


def test_bf16_rows_on_a_cpu_without_bf16_gemms_have_no_goal(tmp_path):
    settings = {"chunk": 32, "block_chunks": 16, "pipeline": True, "kv_groups": 0}
    fixed = _run(tmp_path / "fixed.json", settings, [0.8, 3.0, 1.0], [40, 45, 50], bf16_gemms=False)
    tuned = _run(tmp_path / "tuned.json", settings, [1.1, 4.2, 1.6], [55, 61, 52], bf16_gemms=False)
    text = compare(fixed, tuned)
    assert "| bfloat16 | 4096 | 32x16 pipeline / 32x16 pipeline | 1.00 | 1.60 | none (no bf16 GEMMs) |" in text
    assert goal_for("bfloat16", 4096, bf16_gemms=False) is None and goal_for("bfloat16", 4096, True) == 1.5
    assert goal_for("float32", 16384, bf16_gemms=False) == 4.0


def test_bf16_inputs_are_compared_with_the_gemms_they_run(monkeypatch):
    monkeypatch.setenv("OAL_CPU_BF16", "0")  # bf16 inputs run the fp32 path
    assert gemm_dtype("cpu", torch.bfloat16) == torch.float32 and gemm_dtype("cpu", torch.float32) == torch.float32
    monkeypatch.setenv("OAL_CPU_BF16", "1")
    assert gemm_dtype("cpu", torch.bfloat16) == torch.bfloat16
    assert gemm_dtype("cuda", torch.bfloat16) == torch.bfloat16


def test_settings_parse_another_machines_choice():
    from oal.ops.tuning import Settings

    assert parse_settings("64x2") == Settings(64, 2, True, 0)
    assert parse_settings("64x4,serial") == Settings(64, 4, False, 0)
    assert parse_settings("32x16, pipeline, kv2") == Settings(32, 16, True, 2)
    for bad in ("64", "64x0", "ax2", "64x2,sideways", "64x2,pipeline,kv-1", "64x2,pipeline,kv2,extra"):
        with pytest.raises(ValueError, match="--settings: expected CHUNKxBLOCKS"):
            parse_settings(bad)
