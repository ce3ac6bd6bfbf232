"""A multi-seed `oal run` (DIR/seed-<s>/ below an aggregate) used as a user would: evaluating its seeds, passkey in
the aggregate, what the commands say about DIR itself, adding a seed."""

import hashlib
import json
import shutil
import statistics

import pytest
from test_integrity import assert_bad_input, cli
from test_pipeline import _cfg, make_assets

from oal.errors import InputError
from oal.pipeline.aggregate import aggregate_seeds
from oal.pipeline.config import parse_methods
from oal.pipeline.evaluate_passkey import evaluate_passkey_run
from oal.pipeline.runs import run

SEEDS = [0, 1]
PASSKEY = {"lengths": [300], "depths": [0.0, 1.0], "trials": 1}


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    return make_assets(tmp_path_factory.mktemp("assets"), n_layers=2, max_positions=512)


def _ms_cfg(assets):
    return _cfg(assets, methods=parse_methods("oal,softmax"), layers=[1])


@pytest.fixture(scope="module")
def multi(assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("multi") / "run"
    run(_ms_cfg(assets), out, SEEDS, progress=False)
    return out


@pytest.fixture
def copy(multi, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(multi, out)
    return out


def test_passkey_of_every_seed_reaches_the_aggregate(copy):
    """`oal evaluate --out DIR/seed-<s> --passkey` on every seed left DIR's metrics.json and report.md as they were
    (report: "Not measured in this run (`oal evaluate --out DIR --passkey`)", a command refused on DIR), and the
    aggregate had no passkey even after `oal run` again."""
    for s in SEEDS:
        evaluate_passkey_run(copy / f"seed-{s}", ["softmax"], adapter=False, progress=False, **PASSKEY)
    per = [json.loads((copy / f"seed-{s}" / "metrics.json").read_text())["passkey"]["softmax"]["no_adapt"]
           for s in SEEDS]
    top = json.loads((copy / "metrics.json").read_text())
    assert top["sha256"] == {f"seed-{s}/metrics.json": _sha(copy / f"seed-{s}" / "metrics.json") for s in SEEDS}
    got = top["passkey"]["softmax"]["no_adapt"]
    assert got["mean"] == pytest.approx(statistics.fmean(p["mean"] for p in per))
    assert top["passkey_std"]["softmax"]["no_adapt"]["mean"] == pytest.approx(statistics.stdev(p["mean"] for p in per))
    for n in per[0]["accuracy"]:
        for d in per[0]["accuracy"][n]:
            assert got["accuracy"][n][d] == pytest.approx(statistics.fmean(p["accuracy"][n][d] for p in per))
    report = (copy / "report.md").read_text()
    section = report.split("## Passkey retrieval")[1].split("\n## ")[0]
    assert f"Mean over seeds {SEEDS}" in section and "Not measured" not in section


def test_passkey_of_other_prompts_is_not_averaged():
    base = {"model": "m", "converted_layers": [1], "methods": ["softmax"], "perplexity": {"softmax": 2.0},
            "perplexity_no_adapt": {"softmax": 2.0}, "fidelity": {}, "elapsed_s": {}}

    def pk(trials, mean):
        return {"lengths": [300], "depths": [0.0], "trials": trials, "digits": 5, "seed": 0,
                "accuracy": {"300": {"0": mean}}, "by_length": {"300": mean}, "by_depth": {"0": mean}, "mean": mean}

    per_seed = {0: {**base, "passkey": {"softmax": {"no_adapt": pk(1, 1.0)}}},
                1: {**base, "passkey": {"softmax": {"no_adapt": pk(2, 0.5)}}}, 2: dict(base)}
    out = aggregate_seeds(per_seed)
    assert "passkey" not in out and out["not_averaged"]["passkey:softmax:no_adapt"] == [1, 2]
    per_seed[1]["passkey"]["softmax"]["no_adapt"] = pk(1, 0.5)
    per_seed[2]["passkey"] = {"softmax": {"no_adapt": pk(1, 0.0)}}
    out = aggregate_seeds(per_seed)
    assert out["passkey"]["softmax"]["no_adapt"]["mean"] == pytest.approx(0.5)
    assert out["passkey_std"]["softmax"]["no_adapt"]["mean"] == pytest.approx(0.5)


@pytest.mark.parametrize("command", [("export", "--to", "{tmp}/exp"), ("generate", "hello"),
                                     ("evaluate", "--passkey", "--lengths", "300")])
def test_commands_on_the_aggregate_name_the_seed_directories(multi, tmp_path, command):
    """`oal export --out DIR` said "evaluate one seed"; `oal generate --out DIR` said DIR "holds no calibrated kernels
    (run `oal run --out DIR` first)", after exactly that run."""
    args = [a.format(tmp=tmp_path) for a in command]
    res = cli(*args[:1], "--out", multi, *args[1:])
    assert_bad_input(res, "--out", "multi-seed", *(str(multi / f"seed-{s}") for s in SEEDS))
    assert "evaluate one seed" not in res.output and "no calibrated kernels" not in res.output


def test_a_seed_is_added_to_a_multi_seed_run(assets, copy):
    """`oal run --seeds 0,1,2` on a finished `--seeds 0,1` directory was refused, --force (rerunning every seed) the
    only way; now seeds 0 and 1 resume as recorded and seed 2 is added to the aggregate."""
    kept = {s: _sha(copy / f"seed-{s}" / "kernels.safetensors") for s in SEEDS}
    with pytest.raises(InputError, match="not \\[0\\]|single-seed"):
        run(_ms_cfg(assets), copy, [0], progress=False)  # fewer seeds: still refused
    metrics = run(_ms_cfg(assets), copy, [*SEEDS, 2], progress=False)
    assert metrics["seeds"] == [0, 1, 2] and set(metrics["per_seed"]) == {"0", "1", "2"}
    assert {s: _sha(copy / f"seed-{s}" / "kernels.safetensors") for s in SEEDS} == kept
    top = json.loads((copy / "metrics.json").read_text())
    per = [top["per_seed"][str(s)]["perplexity"]["oal"] for s in (0, 1, 2)]
    assert top["perplexity"]["oal"] == pytest.approx(statistics.fmean(per))
    assert top["perplexity_std"]["oal"] == pytest.approx(statistics.stdev(per))
    assert json.loads((copy / "config.json").read_text())["seeds"] == [0, 1, 2]



def test_the_final_aggregate_reads_each_seeds_metrics_as_they_are_on_disk(assets, copy, monkeypatch):
    """`oal evaluate` on seed-0 while `oal run --seeds 0,1` worked on seed-1 rewrote seed-0's metrics.json but could
    not refresh DIR (the run holds it); the run then aggregated seed-0's numbers as its run_seed had returned them,
    beside the SHA256 of the new file. Here run_seed returns the older numbers and seed-0's file holds newer ones."""
    import oal.pipeline.runs as runs
    from oal.rundir.files import atomic_write_json

    returned = {s: json.loads((copy / f"seed-{s}" / "metrics.json").read_text()) for s in SEEDS}
    monkeypatch.setattr(runs, "run_seed", lambda cfg, out, **kw: returned[cfg.seed])
    newer = json.loads(json.dumps(returned[0]))
    newer["perplexity"] = {m: 1.5 * ppl for m, ppl in newer["perplexity"].items()}  # as `oal evaluate` left it
    atomic_write_json(copy / "seed-0" / "metrics.json", newer)
    run(_ms_cfg(assets), copy, SEEDS, progress=False)
    top = json.loads((copy / "metrics.json").read_text())
    assert top["sha256"] == {f"seed-{s}/metrics.json": _sha(copy / f"seed-{s}" / "metrics.json") for s in SEEDS}
    want = aggregate_seeds({0: newer, 1: returned[1]})
    assert top["perplexity"] == want["perplexity"] != aggregate_seeds(returned)["perplexity"]
