"""Evaluation records (`oal evaluate`) carry the versions of the code that measured them: a record of an older
scorer (zero-shot tokenisation, passkey decoding) is not published once the scorer changed, and a stage of `oal run`
that measures the same numbers again forgets the older records (`rundir.metrics`)."""

from __future__ import annotations

import json

from oal.rundir.metrics import drop_evaluations, record_evaluation, verified_evaluations

NEEDS = {"zeroshot:": {"zeroshot_scoring": 2}}


def _names(run_dir, versions=NEEDS):
    return [path[-1] for path, _ in verified_evaluations(run_dir, versions)[0]]


def test_a_record_of_another_scorer_version_is_left_out(tmp_path, caplog):
    record_evaluation(tmp_path, "zeroshot:oal:piqa", [(("zeroshot", "oal", "piqa"), 1)], {},
                      versions={"zeroshot_scoring": 2})
    record_evaluation(tmp_path, "zeroshot:oal:arc", [(("zeroshot", "oal", "arc"), 2)], {},
                      versions={"zeroshot_scoring": 1})
    record_evaluation(tmp_path, "zeroshot:softmax:piqa", [(("zeroshot", "softmax", "piqa"), 3)], {})  # before versions
    record_evaluation(tmp_path, "fidelity_adapted:oal", [(("fidelity_adapted", "oal"), 4)], {})  # no version asked
    with caplog.at_level("WARNING", logger="oal"):
        assert _names(tmp_path) == ["piqa", "oal"]
    assert "zeroshot:oal:arc, measured by an older oal (zeroshot_scoring 1, now 2)" in caplog.text
    assert "zeroshot_scoring unrecorded, now 2" in caplog.text
    assert _names(tmp_path, None) == ["piqa", "arc", "piqa", "oal"]  # a reader that asks for none takes them all


def test_drop_evaluations_forgets_the_records_and_their_values(tmp_path):
    for m in ("oal", "softmax"):
        record_evaluation(tmp_path, f"zeroshot:{m}:piqa", [(("zeroshot", m, "piqa"), 1)], {})
    values = sorted((tmp_path / ".oal" / "evaluate").iterdir())
    drop_evaluations(tmp_path, "zeroshot:oal:")
    assert list(json.loads((tmp_path / ".oal" / "evaluations.json").read_text())) == ["zeroshot:softmax:piqa"]
    assert sorted((tmp_path / ".oal" / "evaluate").iterdir()) == [v for v in values if "softmax" in v.name]
    drop_evaluations(tmp_path / "none", "zeroshot:")  # no records: nothing to do


def test_the_pipeline_asks_for_the_current_scorers():
    from oal.evaluate.passkey import DECODING_VERSION
    from oal.evaluate.zeroshot import SCORING_VERSION
    from oal.pipeline.base import EVALUATION_VERSIONS

    assert EVALUATION_VERSIONS == {"zeroshot:": {"zeroshot_scoring": SCORING_VERSION},
                                   "passkey:": {"passkey_decoding": DECODING_VERSION}}


def test_passkey_records_carry_the_decoding_version(tmp_path, monkeypatch):
    from test_passkey_audit import TOK, Answers

    import oal.artefact.arms as arms
    import oal.pipeline.publish as publish
    from oal.evaluate.passkey import DECODING_VERSION
    from oal.pipeline.evaluate_passkey import evaluate_passkey_run

    info = {"method": "softmax", "adapter": None}
    monkeypatch.setattr(publish, "check_publishable", lambda out_dir: None)
    monkeypatch.setattr(publish, "republish", lambda out_dir, console=None: {})
    monkeypatch.setattr(arms, "load_arm", lambda *a, **k: (Answers(" ", "."), TOK, info))
    monkeypatch.setattr(arms, "arm_inputs", lambda *a, **k: {})
    evaluate_passkey_run(tmp_path, ["softmax"], lengths=[300], depths=[0.0], trials=1, adapter=False,
                         progress=False)
    records = json.loads((tmp_path / ".oal" / "evaluations.json").read_text())
    assert records and all(r["versions"] == {"passkey_decoding": DECODING_VERSION} for r in records.values())


def test_an_evaluation_record_claims_no_time_it_did_not_measure(tmp_path):
    """Every record said `elapsed_s: 0.0`, also for passkey arms that took a minute; a stage's time stays recorded."""
    from oal.rundir.stages import StageLog

    record_evaluation(tmp_path, "zeroshot:oal:piqa", [(("zeroshot", "oal", "piqa"), 1)], {})
    (record,) = json.loads((tmp_path / ".oal" / "evaluations.json").read_text()).values()
    assert "elapsed_s" not in record and record["outputs"]
    log = StageLog(tmp_path)
    log.mark("setup", "k", 1.25)
    assert log.elapsed() == {"setup": 1.25}
