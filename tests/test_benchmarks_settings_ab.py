"""benchmarks.settings_ab: the tuned settings and other machines' side by side, in interleaved rounds."""

from __future__ import annotations

import pytest
import torch

from benchmarks.settings_ab import run


def test_every_setting_is_timed_in_every_round(monkeypatch):
    monkeypatch.setenv("OAL_NO_TUNE", "1")  # "tuned" falls back to the fixed defaults: no cache is read
    res = run(160, ["32x2,serial", "64x1,pipeline"], rounds=2, dtype=torch.float32, loaded=False)
    assert list(res["settings"]) == ["tuned", "32x2,serial", "64x1,pipeline"] and res["source"] == "fixed"
    assert res["settings"]["32x2,serial"] == "chunk 32, block 64 (2 chunks), serial"
    assert set(res["times"]) == {"quiet"} and all(len(ts) == 2 and min(ts) > 0 for ts in res["times"]["quiet"].values())
    assert res["median"]["quiet"]["tuned"] == pytest.approx(sum(res["times"]["quiet"]["tuned"]) / 2)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="--settings: expected"):
        run(64, ["fast"], rounds=1, dtype=torch.float32, loaded=False)


def test_readouts_run_at_the_tuned_settings_with_their_flags(monkeypatch):
    """--readouts: each named bf16 readout of the fused kernel is timed with the tuned settings, its flags set only
    during its own calls."""
    from oal.ops import cpu_kernel

    monkeypatch.setenv("OAL_NO_TUNE", "1")
    seen = []
    real = cpu_kernel.readout

    def spy(*args, **kwargs):
        seen.append((cpu_kernel.AMX, cpu_kernel.BF16_DOTS))
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_kernel, "readout", spy)
    before = cpu_kernel.AMX, cpu_kernel.BF16_DOTS
    res = run(700, [], rounds=1, dtype=torch.bfloat16, loaded=False, readouts=("dots", "widened"))
    assert list(res["settings"]) == ["tuned", "tuned, dots", "tuned, widened"]
    assert len(set(res["settings"].values())) == 1 and (cpu_kernel.AMX, cpu_kernel.BF16_DOTS) == before
    if cpu_kernel.available():  # each readout's calls saw its flags
        assert {(False, True), (False, False), before} <= set(seen)


def test_nothing_to_compare_is_refused():
    from benchmarks.settings_ab import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--n", "64"])
