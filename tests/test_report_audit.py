"""report.md read as a paper's reader would: every number in its tables equals the metrics.json it comes from at
the precision printed, rounding never shows two methods (or a seed spread) as equal when they were not, a multi-seed
report says which numbers are one seed's, and the aggregate never averages what some seed did not measure alike."""

import copy
import json
import re
import statistics

import pytest

from oal.pipeline.aggregate import aggregate_seeds, summary_table
from oal.pipeline.report import write_report
from oal.pipeline.report_format import PAPER_TABLE3_LLAMA, display_name
from oal.rundir.files import atomic_write_json
from tests.test_report import _run_dir

NAMES = {display_name(m): m for m in ("softmax", "global", "oal")}
KEYS = ("mse", "relmse", "mse_post_o", "relmse_post_o")


def tables(text: str) -> dict[str, list[tuple[list[str], list[list[str]]]]]:
    """Every markdown table of a report, by the `## ` section it sits in: (header, rows of cells)."""
    out, section, lines, i = {}, None, text.splitlines(), 0
    while i < len(lines):
        if lines[i].startswith("## "):
            section = lines[i][3:]
        if lines[i].startswith("| ") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = [c.strip() for c in lines[i].strip().strip("|").split("|")]
            rows, i = [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append([c.strip() for c in lines[i].strip().strip("|").split("|")])
                i += 1
            out.setdefault(section, []).append((header, rows))
            continue
        i += 1
    return out


def section(text: str, prefix: str) -> list[tuple[list[str], list[list[str]]]]:
    (found,) = [v for k, v in tables(text).items() if k.startswith(prefix)]
    return found


def shown(cell: str) -> tuple[float, float, float | None, float]:
    """(value, its rounding half-step, std or None, the std's half-step) of a cell such as `0.0649 ± 8e-06`."""
    def one(s):
        s = s.strip().rstrip("x")
        mant, _, exp = s.partition("e")
        dec = len(mant.split(".")[1]) if "." in mant else 0
        return float(s), 0.5 * 10 ** (-dec) * (10 ** int(exp) if exp else 1)

    mean, _, std = cell.partition(" ± ")
    value, half = one(mean)
    if not std:
        return value, half, None, 0.0
    s, s_half = one(std)
    return value, half, s, 0.0 if std == "0" else s_half  # a bare 0: the seeds agreed exactly


def agrees(cell: str, value: float, std: float | None = None) -> bool:
    got, half, got_std, std_half = shown(cell)
    ok = abs(got - value) <= half * (1 + 1e-9)
    if std is not None:
        ok = ok and got_std is not None and abs(got_std - std) <= std_half * (1 + 1e-9)
        ok = ok and (got_std > 0) == (std > 0)  # a spread is never rounded away to 0
    return ok


def _seed_dir(root, seed: int, shift: float):
    """A seed's directory (tests/test_report.py's run) whose numbers move with `shift`, some by tiny amounts."""
    d = _run_dir(root / f"seed-{seed}")
    m = json.loads((d / "metrics.json").read_text())
    m["seed"] = seed
    m["perplexity"] = {"oal": 12.5012 + shift, "global": 12.5041 - shift, "softmax": 9.75 + 2 * shift}
    m["perplexity_no_adapt"] = {"oal": 40.0 + 10 * shift, "global": 45.0, "softmax": 10.0}
    m["zeroshot"] = {meth: {"piqa": {"acc": 50.0, "acc_norm": 52.0 + 0.001 * seed + k, "acc_norm_lmeval": 51.0,
                                     "n": 100}} for k, meth in enumerate(("softmax", "global", "oal"))}
    for k, meth in enumerate(("oal", "global")):  # MSEs of 3e-04 whose seeds differ by 1e-06
        m["fidelity"][meth].update(mse=3.156e-4 + 1e-6 * seed + 2e-6 * k, relmse=0.5 + 1e-5 * seed + 0.01 * k)
    atomic_write_json(d / "metrics.json", m)
    return m


def _multi_seed(tmp_path, seeds=(1, 2, 3)):
    per = {s: _seed_dir(tmp_path, s, 0.001 * s * s) for s in seeds}
    metrics = aggregate_seeds(per)
    atomic_write_json(tmp_path / "metrics.json", metrics)
    config = json.loads((tmp_path / f"seed-{seeds[0]}" / "config.json").read_text())
    atomic_write_json(tmp_path / "config.json", {**config, "seeds": list(seeds)})
    return metrics


def _check_method_tables(text: str, metrics: dict, multi: bool) -> int:
    """Compares the summary, Table 2 and Table 3 rows with metrics.json; returns how many cells it checked."""
    ppl, pre, fid = metrics["perplexity"], metrics["perplexity_no_adapt"], metrics["fidelity"]
    std = metrics.get("perplexity_std", {}) if multi else {}
    pre_std = metrics.get("perplexity_no_adapt_std", {}) if multi else {}
    fstd = metrics.get("fidelity_std", {}) if multi else {}
    checked = 0
    (summary,) = section(text, "Summary")
    for row in summary[1]:
        m = NAMES[row[0]]
        assert agrees(row[1], ppl[m], std.get(m)), row
        assert agrees(row[3], pre[m], pre_std.get(m)), row
        if m != "softmax":
            assert agrees(row[2], ppl[m] / ppl["softmax"]), row
            assert agrees(row[4], fid[m]["relmse_post_o"], fstd.get(m, {}).get("relmse_post_o")), row
        checked += 1
    header, rows = section(text, "Frozen-attention fidelity")[0]
    assert header[1:] == ["Before W_o MSE", "Before W_o RelMSE", "After W_o MSE", "After W_o RelMSE"]
    for row in rows:
        m = NAMES[row[0]]
        for cell, k in zip(row[1:], KEYS, strict=True):
            assert agrees(cell, fid[m][k], fstd.get(m, {}).get(k)), (row, k)
            checked += 1
    header, rows = section(text, "Language modelling")[0]
    for row in rows:
        m = NAMES[row[0]]
        assert agrees(row[1], ppl[m], std.get(m)) and agrees(row[2], pre[m], pre_std.get(m)), row
        if multi:
            per = [metrics["per_seed"][str(s)]["perplexity"][m] for s in metrics["seeds"]]
            assert all(agrees(c, v) for c, v in zip(row[3].split(", "), per, strict=True)), row
        checked += 1
    return checked


def test_single_seed_report_numbers_equal_metrics_json(tmp_path):
    d = _run_dir(tmp_path)
    m = json.loads((d / "metrics.json").read_text())
    m["perplexity"].update(oal=12.5012, **{"global": 12.5041})  # 0.003 apart: two decimals would print both 12.50
    atomic_write_json(d / "metrics.json", m)
    text = write_report(d).read_text()
    assert _check_method_tables(text, m, multi=False) >= 10
    (summary,) = section(text, "Summary")
    cells = {NAMES[r[0]]: r[1] for r in summary[1]}
    assert cells["oal"] != cells["global"]  # rounding must not make different arms look alike
    assert "OAL beats the learned global quadratic" in text and "one seed, so no spread is measured" in text
    (timing,) = section(text, "Time per stage")
    shown_s = {r[0]: float(r[1]) for r in timing[1]}
    assert shown_s.pop("total") == pytest.approx(sum(m["elapsed_s"].values()), abs=0.05)
    assert shown_s == pytest.approx(m["elapsed_s"], abs=0.05)
    # the report stage is timed after report.md is written: its total then differs from metrics.json's, said so
    assert "metrics.json adds its time once the file is written" in text.split("## Time per stage")[1]


def test_multi_seed_report_numbers_and_spreads_equal_metrics_json(tmp_path):
    """The known case: a fidelity std of ~1e-06 beside a mean of 3.156e-04 printed as `± 0.0000`, and the summary's
    PPL std of 0.0004 as `± 0.00`."""
    metrics = _multi_seed(tmp_path)
    text = write_report(tmp_path).read_text()
    assert _check_method_tables(text, metrics, multi=True) >= 10
    spreads = [c for s in ("Summary", "Frozen-attention fidelity", "Language modelling")
               for _, rows in section(text, s) for r in rows for c in r if " ± " in c]
    assert len(spreads) >= 14 and sum(shown(c)[2] > 0 for c in spreads) >= 10, spreads
    (zs,) = [rows for header, rows in section(text, "Zero-shot") if header[:2] == ["Method", "PPL (LoRA)"]]
    for row in zs:
        m = NAMES[row[0]]  # PIQA's column
        piqa, piqa_std = metrics["zeroshot"][m]["piqa"], metrics["zeroshot_std"][m]["piqa"]
        assert agrees(row[2], piqa["acc_norm"], piqa_std["acc_norm"]), row
    per = metrics["per_seed"]
    assert metrics["perplexity_no_adapt_std"]["oal"] == pytest.approx(
        statistics.stdev(per[s]["perplexity_no_adapt"]["oal"] for s in ("1", "2", "3")))


def test_multi_seed_report_says_which_sections_are_one_seeds(tmp_path):
    """Calibration and analysis are read from seed-1/ alone; they sat beside the seed means unlabelled."""
    _multi_seed(tmp_path, seeds=(1, 2))
    text = write_report(tmp_path).read_text()
    for name in ("Calibration", "Contribution analysis"):
        body = text.split(f"## {name}")[1].split("\n## ")[0]
        assert "Seed 1 alone (of seeds [1, 2]" in body, name
    for name in ("Summary", "Frozen-attention fidelity", "Language modelling"):
        assert "Seed 1 alone" not in text.split(f"## {name}")[1].split("\n## ")[0], name
    prov = text.split("## Configuration and provenance")[1]
    assert "seeds [1, 2]" in prov.splitlines()[2]  # not "seed 1": the run measured both


def test_aggregate_keeps_seeds_that_converted_different_layers_apart(tmp_path):
    """`--layers auto:K` selects per seed: per-layer fidelity of a layer one seed did not convert raised KeyError
    at the very end of the run."""
    per = {s: _seed_dir(tmp_path, s, 0.01 * s) for s in (1, 2)}
    per[2]["converted_layers"] = [2, 3]
    for m in ("oal", "global"):
        per[2]["fidelity"][m]["per_layer"] = {"3": {"relmse": 0.4}}
        per[1]["fidelity"][m]["per_layer"]["3"] = {"relmse": 0.45}
    metrics = aggregate_seeds(per)
    assert metrics["converted_layers_per_seed"] == {"1": [1, 2], "2": [2, 3]}
    assert list(metrics["fidelity"]["oal"]["per_layer"]) == ["3"]  # the layer both seeds converted
    atomic_write_json(tmp_path / "metrics.json", metrics)
    text = write_report(tmp_path).read_text()
    assert "Seeds converted different layers" in text.split("## Summary")[1].split("\n## ")[0]


def test_aggregate_names_what_a_seed_did_not_measure(tmp_path):
    """A number one seed lacks is left out of the mean, and now said so (it vanished from the report silently)."""
    per = {s: _seed_dir(tmp_path, s, 0.01 * s) for s in (1, 2, 3)}
    del per[3]["perplexity"]["oal"]
    zs = {"acc": 50.0, "acc_norm": 55.0, "acc_norm_lmeval": 54.0, "n": 100}
    for s in (1, 2, 3):
        per[s]["zeroshot"] = {"oal": {"piqa": dict(zs, n=100 if s < 3 else 80)}}
    metrics = aggregate_seeds(copy.deepcopy(per))
    assert metrics["not_averaged"] == {"perplexity:oal": [3], "zeroshot:oal:piqa": [3]}
    assert "oal" not in metrics["perplexity"] and "zeroshot" not in metrics
    atomic_write_json(tmp_path / "metrics.json", metrics)
    text = write_report(tmp_path).read_text()
    summary = text.split("## Summary")[1].split("\n## ")[0]
    assert "perplexity:oal (seeds [3])" in summary and "zeroshot:oal:piqa (seeds [3])" in summary


def test_headline_states_a_quick_run_and_why_zero_shot_is_missing(tmp_path):
    d = _run_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["config"]["zeroshot_tasks"] = []  # --tasks none
    atomic_write_json(d / "config.json", cfg)  # preset default: 256 updates; this run's arms made 8 (--steps)
    text = write_report(d).read_text()
    summary = text.split("## Summary")[1].split("\n## ")[0]
    assert "**Quick run**: 8 adaptation updates per arm against the `default` preset's 256" in summary
    assert "no task was selected (`--tasks none`)" in text.split("## Zero-shot")[1].split("\n## ")[0]


def test_zero_shot_limit_is_in_the_headline(tmp_path):
    d = _run_dir(tmp_path)
    m = json.loads((d / "metrics.json").read_text())
    m["zeroshot"] = {meth: {"piqa": {"acc": 50.0, "acc_norm": 52.0, "acc_norm_lmeval": 51.0, "n": 100}}
                     for meth in ("oal", "global", "softmax")}
    m["zeroshot_data"] = {"piqa": {"source": "task_file", "path": "p.jsonl", "schema_of": "piqa", "sha256": "ef" * 32,
                                   "rows": 100, "limit": 100}}
    atomic_write_json(d / "metrics.json", m)
    summary = write_report(d).read_text().split("## Summary")[1].split("\n## ")[0]
    assert re.search(r"\*\*Quick run\*\*: zero-shot on the first 100 examples", summary)


def test_llama_preset_is_compared_with_the_papers_llama_column(tmp_path):
    d = _run_dir(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["config"]["preset"] = "llama-3.2-1b"
    atomic_write_json(d / "config.json", cfg)
    text = write_report(d).read_text()
    assert "paper Table 3, Llama-3.2-1B" in text and "paper Table 3, Qwen2.5-0.5B" not in text
    (ref,) = [rows for header, rows in section(text, "Language modelling") if header[0] == "Method (paper)"]
    assert {r[0]: tuple(map(float, r[1:])) for r in ref} == {display_name(m): v for m, v in PAPER_TABLE3_LLAMA.items()}
    # the paper's sentence on Llama: OAL "reduces perplexity from 36.03 to 32.99"
    assert (PAPER_TABLE3_LLAMA["global"][0], PAPER_TABLE3_LLAMA["oal"][0]) == (36.03, 32.99)


def test_terminal_table_shows_a_small_seed_spread(tmp_path):
    from rich.console import Console

    metrics = _multi_seed(tmp_path, seeds=(1, 2))
    console = Console(record=True, width=200)
    console.print(summary_table(metrics))
    out = console.export_text()
    assert "± 0.000 " not in out and "± 0.000│" not in out.replace(" ", "")
    assert f"± {metrics['perplexity_std']['oal']:.2g}" in out


def test_terminal_table_gives_every_averaged_number_its_spread(tmp_path):
    """The terminal table showed ± on the adapted PPL only: RelMSE, PPL no adapt and zero-shot were means alone."""
    from rich.console import Console

    metrics = _multi_seed(tmp_path, seeds=(1, 2, 3))
    console = Console(record=True, width=250)
    console.print(summary_table(metrics))
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in console.export_text().splitlines() if line.count("│") > 3}
    oal = rows["oal"]  # RelMSE, RelMSE post-o, PPL no adapt, PPL (LoRA), PPL / softmax, PIQA
    assert agrees(oal[0], metrics["fidelity"]["oal"]["relmse"], metrics["fidelity_std"]["oal"]["relmse"]), oal
    assert agrees(oal[2], metrics["perplexity_no_adapt"]["oal"], metrics["perplexity_no_adapt_std"]["oal"]), oal
    assert agrees(oal[3], metrics["perplexity"]["oal"], metrics["perplexity_std"]["oal"]), oal
    assert agrees(oal[5], metrics["zeroshot"]["oal"]["piqa"]["acc_norm"],
                  metrics["zeroshot_std"]["oal"]["piqa"]["acc_norm"]), oal


def test_zero_shot_of_some_seeds_only_is_reported_as_such(tmp_path):
    """Zero-shot scored on one seed of two (`oal evaluate --zeroshot` on seed-1/ alone) was reported as 'not evaluated
    in this run', with '`--tasks none`' where the run had selected none."""
    per = {s: _seed_dir(tmp_path, s, 0.001 * s) for s in (1, 2)}
    del per[2]["zeroshot"]
    metrics = aggregate_seeds(per)
    atomic_write_json(tmp_path / "metrics.json", metrics)
    config = json.loads((tmp_path / "seed-1" / "config.json").read_text())
    config["config"]["zeroshot_tasks"] = []
    atomic_write_json(tmp_path / "config.json", {**config, "seeds": [1, 2]})
    body = write_report(tmp_path).read_text().split("## Zero-shot accuracy")[1].split("\n## ")[0]
    assert "measured on some seeds only" in body and "oal:piqa: seeds [2] lack it" in body, body
    assert "not evaluated in this run" not in body and "--tasks none" not in body, body


def test_zero_shot_on_another_file_of_as_many_rows_is_not_averaged(tmp_path):
    """Seeds scored on different --task-file data with the same number of examples were averaged as one task."""
    per = {s: _seed_dir(tmp_path, s, 0.001 * s) for s in (1, 2)}
    for s, digest in ((1, "a" * 64), (2, "b" * 64)):
        per[s]["zeroshot_data"] = {"piqa": {"source": "task_file", "sha256": digest, "rows": 100}}
    metrics = aggregate_seeds(per)
    assert "zeroshot" not in metrics and metrics["not_averaged"]["zeroshot:oal:piqa"] == [2]
    per[2]["zeroshot_data"] = per[1]["zeroshot_data"]
    assert aggregate_seeds(per)["zeroshot"]["oal"]["piqa"]["n"] == 100
