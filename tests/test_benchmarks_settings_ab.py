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
