"""What a researcher meets first: the report's headline (adapted PPL against softmax, fidelity) before the record
(hashes, versions); the terminal table's ratio column and its caption; every report figure labelled."""

import json

import pytest
from rich.console import Console

from oal.pipeline import report_figures
from oal.pipeline.aggregate import summary_table
from oal.pipeline.report import write_report
from tests.test_report import _run_dir


def test_report_opens_with_the_headline_and_keeps_provenance_last(tmp_path):
    text = write_report(_run_dir(tmp_path)).read_text()
    summary, analysis = text.index("## Summary"), text.index("## Contribution analysis")
    provenance, timing = text.index("## Configuration and provenance"), text.index("## Time per stage")
    assert summary < analysis and timing < provenance
    head = text[summary:analysis]
    assert "| OAL | 12.50 | 1.282x | 40.00 | 0.7000 | - |" in head  # 12.5 / 9.75, RelMSE after W_o
    assert "| Softmax (LoRA) | 9.75 | 1.000x (reference) |" in head
    assert "lower is better" in head and "Speed" in head
    assert "![fidelity per layer](figures/fidelity_per_layer.png)" in text


def test_terminal_table_compares_with_softmax_and_says_what_columns_mean(tmp_path):
    metrics = json.loads((_run_dir(tmp_path) / "metrics.json").read_text())
    console = Console(width=160, record=True)
    console.print(summary_table(metrics))
    out = console.export_text()
    assert "PPL / softmax" in out and "1.282x" in out and "1.359x" in out  # oal, global (13.25 / 9.75)
    assert "lower is better" in out and "against softmax" in out


@pytest.fixture
def figures(monkeypatch):
    """The matplotlib figures the report draws, kept open instead of saved."""
    kept = []

    def keep(fig, path, **kw):
        kept.append(fig)
        path.write_bytes(b"\x89PNG\r\n\x1a\n")  # the report checks that what it embeds exists

    monkeypatch.setattr(report_figures, "atomic_save_figure", keep)
    return kept


def test_report_figures_label_every_axis(tmp_path, figures):
    write_report(_run_dir(tmp_path))
    assert len(figures) == 4  # calibration, fidelity per layer, adaptation, perplexity
    for fig in figures:
        for ax in fig.axes:
            assert ax.get_title() and ax.get_ylabel(), fig
            assert ax.get_xlabel() or ax.get_xticklabels(), fig
            assert ax.get_legend() is not None, fig


def test_fidelity_figure_per_layer(tmp_path, figures):
    metrics = json.loads((_run_dir(tmp_path) / "metrics.json").read_text())
    assert report_figures.fidelity_figure(metrics, tmp_path / "f.png")
    (before, after), = [fig.axes for fig in figures]
    assert "per layer" in before.get_title() and "W_o" in after.get_title()
    assert before.get_xlabel() == "converted layer" and "RelMSE" in before.get_ylabel()
    assert [t.get_text() for t in before.get_legend().get_texts()] == ["Learned global", "OAL"]
    assert not report_figures.fidelity_figure({"fidelity": {}}, tmp_path / "g.png")


def test_analysis_figures_name_their_axes_and_keep_labels_apart(tmp_path, monkeypatch):
    """The per-layer profile had no y label; the stability scatter printed close top-5 labels over each other."""
    from oal.analysis import figures as analysis_figures

    kept = []
    monkeypatch.setattr(analysis_figures, "_save", lambda fig, path: kept.append(fig))
    chi = [0.01 * r for r in range(16)]
    heads = [{"head": h, "chi": chi, "groups": [0] * 14 + [1, 1], "cuts": [14], "n_groups": 2} for h in range(9)]
    analysis_figures.layer_profiles(tmp_path / "p.png", 1, heads)
    rows = [ax for ax in kept[0].axes if ax.get_subplotspec().colspan.start == 0 and ax.axison]
    assert len(rows) == 3 and all("chi" in ax.get_ylabel() for ax in rows)  # 9 heads in rows of 4
    assert kept[0].get_size_inches()[0] <= 11  # readable at the report's width (7 columns: 18 inches)
    calib = [0.001 * r for r in range(10)] + [0.26, 0.18, 0.181, 0.185, 0.15]
    held = calib[:10] + [0.263, 0.188, 0.187, 0.184, 0.152]
    analysis_figures.stability_scatter(tmp_path / "s.png", calib, held, 0.99, 5, "layer 1, head 0")
    ax = kept[1].axes[0]
    assert ax.get_xlabel() and ax.get_ylabel() and ax.get_title()
    ys = sorted(t.xyann[1] for t in ax.texts)
    assert len(ys) == 5 and min(b - a for a, b in zip(ys, ys[1:], strict=False)) >= 0.04 * max(held)
