"""report.md: every referenced figure exists and is non-empty; tables carry the run's and the paper's numbers."""

import json

import pytest

from oal.pipeline.report import figure_references, write_report
from oal.pipeline.report_format import PAPER_TABLE3_QWEN
from oal.rundir.files import atomic_write_json


def _curve(n, start):
    return [[s, start / (1 + s), start / (1 + s) * 1.1] for s in range(0, n, 5)]


def _run_dir(tmp_path, with_figures=True):
    methods = ["oal", "global", "softmax"]
    atomic_write_json(tmp_path / "config.json", {
        "config": {"model": "tiny", "preset": "default", "methods": methods, "seed": 7, "dtype": "float32"},
        "converted_layers": [1, 2],
        "split_plan": {"test": {"split": "test", "block_len": 64, "indices": [0, 1, 2], "through_end": False}},
        "blocks": {"test": {"shape": [3, 64]}},
        "model": {"sha256": {"model.safetensors": "ab" * 32}},
        "data": {"name": "corpus.txt", "sha256": {"test": "cd" * 32}},
        "versions": {"torch": "2.13.0"},
    })
    heads = [{"head": h, "init": "taylor", "val_mse": 0.01 * (h + 1), "best_step": 5, "steps": 10,
              "curves": {"taylor": _curve(11, 1.0), "global_embedded": _curve(6, 2.0)}} for h in range(2)]
    atomic_write_json(tmp_path / "calibration.json", {"methods": {
        "oal": {"1": {"heads": heads}, "2": {"heads": heads}}, "global": {"1": {"heads": heads}}}})
    for m in methods:
        atomic_write_json(tmp_path / "adapter" / m / "adapt.json", {
            "history": [{"step": s, "loss": 3.0 - 0.1 * s, "lr": 1e-3} for s in range(1, 9)],
            "validation": [{"step": 4, "val_nll": 2.9}, {"step": 8, "val_nll": 2.7}]})
    fid = {m: {"mse": 0.1, "relmse": 0.5 if m == "oal" else 0.6, "mse_post_o": 0.05, "relmse_post_o": 0.7,
               "per_layer": {"1": {"relmse": 0.5 if m == "oal" else 0.6}}} for m in ("oal", "global")}
    adapt = {m: {"steps": 8, "best_step": 8, "best_val_nll": 2.7, "n_lora_params": 100,
                 "n_kernel_params": 0 if m == "softmax" else 8, "kernel_change": 0.1} for m in methods}
    atomic_write_json(tmp_path / "metrics.json", {
        "model": "tiny", "converted_layers": [1, 2], "seed": 7, "methods": methods, "fidelity": fid,
        "perplexity": {"oal": 12.5, "global": 13.25, "softmax": 9.75},
        "perplexity_no_adapt": {"oal": 40.0, "global": 45.0, "softmax": 10.0}, "adapt": adapt,
        "elapsed_s": {"analyze": 1.5, "adapt:oal": 3.0}, "missing": []})
    if with_figures:  # an analysis figure as `oal analyze` leaves it
        (tmp_path / "figures").mkdir(exist_ok=True)
        (tmp_path / "figures" / "heatmap_groups.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"0" * 64)
    return tmp_path


def test_report_references_existing_nonempty_figures(tmp_path):
    path = write_report(_run_dir(tmp_path))
    text = path.read_text()
    refs = figure_references(text)
    assert {"figures/calibration_curves.png", "figures/adaptation_curves.png", "figures/perplexity.png",
            "figures/heatmap_groups.png"} <= set(refs)
    for ref in refs:
        f = tmp_path / ref
        assert f.is_file() and f.stat().st_size > 0, ref
    own = [tmp_path / "figures" / n for n in ("calibration_curves.png", "adaptation_curves.png", "perplexity.png")]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in own)


def test_report_tables(tmp_path):
    text = write_report(_run_dir(tmp_path)).read_text()
    assert "| OAL | 12.5000 | 40.0000 |" in text and "| Learned global | 13.2500 | 45.0000 |" in text
    assert "OAL beats the learned global quadratic" in text
    assert "| OAL | 0.1000 | 0.5000 | 0.0500 | 0.7000 |" in text  # Table 2 layout
    # the paper's Table 3 reference group, labelled as such, with its numbers
    assert "paper Table 3, Qwen2.5-0.5B" in text
    for m, row in (("Softmax (LoRA)", PAPER_TABLE3_QWEN["softmax"]), ("OAL", PAPER_TABLE3_QWEN["oal"])):
        assert f"| {m} | {row[0]:.2f} | {row[1]:.2f} |" in text
    assert PAPER_TABLE3_QWEN["global"][0] == 31.71 and PAPER_TABLE3_QWEN["oal"][0] == 27.50
    assert "ab" * 32 in text and "cd" * 32 in text  # provenance hashes
    assert "| total | 4.5 |" in text


def test_report_names_a_failed_comparison_honestly(tmp_path):
    d = _run_dir(tmp_path, with_figures=False)
    m = json.loads((d / "metrics.json").read_text())
    m["perplexity"]["oal"] = 14.0
    atomic_write_json(d / "metrics.json", m)
    text = write_report(d).read_text()
    assert "does NOT beat" in text


def test_report_requires_metrics(tmp_path):
    with pytest.raises(ValueError, match="metrics.json"):
        write_report(tmp_path)
