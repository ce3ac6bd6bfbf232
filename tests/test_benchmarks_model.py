"""benchmarks.model's composition of the full models from a timed two-layer model, and the length options."""

from __future__ import annotations

import argparse

import pytest

from benchmarks._common import add_length_args, lengths_from
from benchmarks.model import _composed, _jobs


def test_composed_rows_sum_layer_times_per_kind():
    """softmax model = outside + 24 t(softmax layer); converted = outside + 6 t(softmax) + 18 t(converted)."""
    row = {"prefill_s": 10.0, "decode_ms_all": [100.0, 120.0, 110.0], "composed": False, "variant": "mixed"}
    spent = [[3.0, 0.010, 0.012, 0.011], [2.0, 0.020, 0.020, 0.020]]  # call 0: prefill, then decode steps
    soft, oal = _composed(row, spent, {0: 1000, 1: 10}, "qwen")
    assert soft["prefill_s"] == pytest.approx(5.0 + 24 * 3.0)
    assert oal["prefill_s"] == pytest.approx(5.0 + 6 * 3.0 + 18 * 2.0)
    outside = [0.100 - 0.030, 0.120 - 0.032, 0.110 - 0.031]
    want = [1e3 * (o + 24 * s) for o, s in zip(outside, spent[0][1:], strict=True)]
    assert soft["decode_ms_all"] == pytest.approx(want)
    assert oal["decode_ms"] == pytest.approx(1e3 * (0.079 + 6 * 0.011 + 18 * 0.020))
    assert soft["cache_mib"] * 2**20 == 24 * 1000 and oal["cache_mib"] * 2**20 == 6 * 1000 + 18 * 10
    assert oal["converted_layers"] == list(range(3, 21)) and soft["composed"] and oal["layer_decode_ms"]["oal"] == 20
    with pytest.raises(ValueError, match="only the qwen model"):
        _composed(row, spent, {0: 1, 1: 1}, "default")


def test_jobs_compose_long_qwen_lengths_only():
    jobs = _jobs(["qwen", "default"], [1024, 4096, 32768], 4096, check=True)
    assert jobs == [("qwen", 1024, "softmax"), ("qwen", 1024, "oal"), ("qwen", 1024, "mixed"),
                    ("qwen", 4096, "mixed"), ("qwen", 32768, "mixed")] + [
        ("default", n, v) for n in (1024, 4096, 32768) for v in ("softmax", "oal")]


@pytest.mark.parametrize("argv,want", [([], [1024, 2048, 4096]), (["--lengths", "4096,1024"], [1024, 4096])])
def test_lengths(argv, want):
    parser = argparse.ArgumentParser()
    add_length_args(parser)
    assert lengths_from(parser, parser.parse_args(["--max-len", "4096", *argv])) == want
    with pytest.raises(SystemExit):
        lengths_from(parser, parser.parse_args(["--lengths", "1k"]))
