"""`oal run` on a run that `oal adapt` amended: the arm's recorded settings are kept, so the run resumes (it was
refused as another configuration: config.adapt_overrides)."""

import json

from test_pipeline import _cfg, make_assets

from oal.pipeline.runs import _amended, adapt_arm, run


def test_run_resumes_a_run_that_oal_adapt_amended(tmp_path, caplog):
    assets = make_assets(tmp_path / "assets", n_layers=2)
    cfg = _cfg(assets, layers=[1])
    out = tmp_path / "run"
    run(cfg, out, progress=False)
    adapt_arm(out, "oal", steps=2, progress=False)
    adapted = json.loads((out / "metrics.json").read_text())
    with caplog.at_level("INFO", logger="oal"):
        again = run(cfg, out, progress=False)
    assert "keeping the arm settings `oal adapt` recorded (oal: steps 2)" in caplog.text
    recorded = json.loads((out / "config.json").read_text())["config"]
    assert recorded["adapt_overrides"] == {"oal": {"steps": 2}}
    assert again["perplexity"] == adapted["perplexity"]
    assert again["adapt"] == adapted["adapt"]  # nothing was adapted again
    assert _amended(cfg, out, force=True) is cfg  # --force starts clean: the recorded amendment goes with the run
