"""benchmarks.frontier end to end on the embedded default (tiny settings): the reference schema, every row converting
the K layers its ranking puts first, the softmax arm measured alike, and a rerun reading the finished rows back."""

from __future__ import annotations

import copy
import json

import pytest

from benchmarks import frontier

ARGS = ["--model", "default", "--methods", "swa,oal", "--k", "1,2", "--steps", "1", "--lengths", "64,128",
        "--passkey-lengths", "128", "--trials", "1", "--depths", "0.5", "--decode-tokens", "2", "--threads", "1"]


def _small_plan():
    """The default preset's split plan with fewer blocks per role (same roles, block lengths and reading code): the
    frontier tests check its plumbing, not the numbers (with the calibration budget below: 70 s to about 25 s)."""
    from dataclasses import replace

    from oal.data.splits import BlockSet, default_plan

    return replace(default_plan("default"), grouping=BlockSet("train", 128, list(range(10))),
                   calib_train=BlockSet("train", 512, [10, 11]), fidelity=BlockSet("train", 512, [20, 21]),
                   val=BlockSet("validation", 512, [0, 1]), test=BlockSet("test", 512, [0, 1, 2]))


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """One frontier run, shared by the module's tests (which read it back or re-time it: the smaller plan and
    calibration budget stay in place for all of them)."""
    from oal.data.splits import PLAN_PRESETS
    from oal.pipeline.config import PRESETS

    tmp = tmp_path_factory.mktemp("frontier")
    args = ARGS + ["--work", str(tmp / "work"), "--json", str(tmp / "out.json")]
    small = _small_plan()
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(PLAN_PRESETS, "default", lambda: copy.deepcopy(small))
        mp.setitem(PRESETS["default"], "calib", {"max_steps": 10, "val_every": 5, "patience": 10})
        assert frontier.main(args) == 0
        yield tmp, args, json.loads((tmp / "out.json").read_text())


@pytest.mark.slow
def test_schema_and_rows(result):
    tmp, _, res = result
    assert res["model"] == "default" and set(res["softmax"]) >= {"ppl", "passkey", "decode_ms", "prefill_s"}
    assert set(res["softmax"]["passkey"]) == {"128"} and set(res["softmax"]["decode_ms"]) == {"64", "128"}
    assert [(r["method"], r["n_linear"]) for r in res["rows"]] == [("swa", 1), ("swa", 2), ("oal", 1), ("oal", 2)]
    for r in res["rows"]:
        assert r["layers"] == sorted(res["rankings"][f"{r['method']} by fidelity"][: r["n_linear"]])
        assert r["ppl"] > 1 and 0 <= r["passkey"]["128"] <= 1 and r["decode_ms"]["128"] > 0
    assert res["candidates"] == [1, 2, 3, 4]  # all but the first and last of six layers
    assert (tmp / "out.png").stat().st_size > 0


def test_rerun_reads_the_rows_back(result, capsys):
    tmp, args, res = result
    logged = []
    again = frontier.run(frontier.parse(args), log=logged.append)
    assert [r["ppl"] for r in again["rows"]] == [r["ppl"] for r in res["rows"]]
    assert sum("done earlier" in line for line in logged) == 5  # softmax and the four rows


def test_rows_timed_with_other_settings_say_so(result, tmp_path):
    """--decode-tokens and --threads set how a row is timed: a row read back (adaptation is the hours of a row)
    with others was used without a word; now it says so and names the re-timing tool."""
    import shutil

    tmp, args, _ = result
    shutil.copytree(tmp / "work", tmp_path / "work")  # the module's run stays as it was
    args = [*args, "--work", str(tmp_path / "work"), "--json", str(tmp_path / "out.json")]
    args[args.index("--decode-tokens") + 1] = "3"
    logged = []
    frontier.run(frontier.parse(args), log=logged.append)
    assert sum("done earlier" in line for line in logged) == 5  # still read back
    said = [line for line in logged if "timed with" in line]
    assert said and all("'decode_tokens': 2" in line and "frontier_retime" in line for line in said), logged


def test_bad_methods_are_refused():
    for bad in ("softmax", "nope"):
        with pytest.raises(ValueError, match=f"--methods: unknown or not linear-time: {bad}"):
            frontier.check_methods(frontier.parse(["--methods", bad]).methods)


def test_retime_times_every_arm_again_and_keeps_the_adapted_numbers(result, tmp_path):
    from benchmarks import frontier_retime
    from oal.rundir.hashes import sha256_file

    tmp, _, res = result
    src = tmp / "out.json"
    out = tmp_path / "retimed.json"
    args = frontier_retime.parse([str(src), "--json", str(out), "--decode-tokens", "2", "--repeats", "2",
                                  "--threads", "1"])
    assert frontier_retime.main(args) == 0
    again = json.loads(out.read_text())
    assert again["retimed"]["from"] == {"file": "out.json", "sha256": sha256_file(src)}
    labels = ["softmax", "swa K=1", "swa K=2", "oal K=1", "oal K=2"]
    runs = again["retimed"]["runs"]
    assert sorted(runs) == sorted(labels) and all(len(r) == 2 for r in runs.values())
    for old, new, label in zip(res["rows"], again["rows"], labels[1:], strict=True):
        assert (new["ppl"], new["passkey"], new["layers"]) == (old["ppl"], old["passkey"], old["layers"])
        for n in ("64", "128"):  # the fastest prefill and decode of the rounds
            assert new["prefill_s"][n] == min(t["prefill_s"][n] for t in runs[label])
            assert new["decode_ms"][n] == min(t["decode_ms"][n] for t in runs[label])
    assert again["softmax"]["ppl"] == res["softmax"]["ppl"] and out.with_suffix(".png").stat().st_size > 0


def test_retime_refuses_another_model_and_other_files(result, tmp_path):
    from benchmarks import frontier_retime

    tmp, _, res = result
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**res, "provenance": {**res["provenance"], "state_dict_sha256": "0" * 64}}))
    with pytest.raises(ValueError, match="other.json: its arms were measured on a model with state dict SHA256 0+,"):
        frontier_retime.retime(frontier_retime.parse([str(other), "--repeats", "1"]), log=lambda *_: None)
    (tmp_path / "bad.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match="bad.json: not a frontier JSON"):
        frontier_retime.read_frontier(tmp_path / "bad.json")
