"""What a reader checks in every figure oal draws: the plotted numbers are the JSON's (read back through
matplotlib's objects), seed spread is shown wherever seeds exist, a method keeps its colour across figures, legends
stay off the data, count colour bars have integer ticks, wide figures fit the report's page, and every figure is
written atomically and closed."""

import json
import runpy
import statistics
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import pytest
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_hex
from matplotlib.transforms import Bbox

from oal.analysis import figures as analysis_figures
from oal.pipeline import report_figures
from oal.pipeline.aggregate import aggregate_seeds
from oal.pipeline.report import write_report
from oal.pipeline.report_format import display_name
from tests.test_report import _run_dir

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "benchmarks" / "reference"


@pytest.fixture
def kept(monkeypatch):
    """Every figure a drawing function saves, still inspectable after it was written (and closed)."""
    figs = []
    real = report_figures.atomic_save_figure

    def keep(fig, path, **kw):
        figs.append(fig)
        return real(fig, path, **kw)

    monkeypatch.setattr(report_figures, "atomic_save_figure", keep)
    monkeypatch.setattr(analysis_figures, "atomic_save_figure", keep)
    return figs


def _seed_metrics(seed: int, shift: float) -> dict:
    per_layer = {str(i): {"relmse": 0.4 + 0.01 * i + shift, "relmse_post_o": 0.5 + shift} for i in (1, 2)}
    return {"model": "tiny", "converted_layers": [1, 2], "seed": seed, "methods": ["oal", "global", "softmax"],
            "perplexity": {"oal": 12.0 + 10 * shift, "global": 13.0 + 5 * shift, "softmax": 9.0 + shift},
            "perplexity_no_adapt": {"oal": 40.0 + 30 * shift, "global": 45.0 - 20 * shift, "softmax": 10.0},
            "fidelity": {m: {"mse": 0.1, "relmse": 0.5, "mse_post_o": 0.05, "relmse_post_o": 0.6,
                             "per_layer": {k: {kk: v + (0.02 if m == "global" else 0.0) for kk, v in row.items()}
                                           for k, row in per_layer.items()}} for m in ("oal", "global")},
            "elapsed_s": {}, "adapt": {}}


def _three_seeds() -> dict:
    return aggregate_seeds({1: _seed_metrics(1, 0.0), 2: _seed_metrics(2, 0.03), 3: _seed_metrics(3, 0.09)})


def test_the_aggregate_names_every_seed_and_no_single_one():
    agg = _three_seeds()
    assert agg["seeds"] == [1, 2, 3] and "seed" not in agg
    assert [agg["per_seed"][str(s)]["seed"] for s in agg["seeds"]] == [1, 2, 3]


def _errbars(container) -> list[float]:
    """Half-lengths of the error bars drawn on a bar container ([] when it has none)."""
    if getattr(container, "errorbar", None) is None:  # a bar container without error bars, or a line's
        return []
    (segments,) = [c.get_segments() for c in container.errorbar.lines[2]]
    return [(s[1][1] - s[0][1]) / 2 for s in segments]


def _std(per_seed: dict, value) -> float:
    return statistics.stdev(value(per_seed[s]) for s in sorted(per_seed))


def test_perplexity_figure_draws_the_seed_spread_of_both_bars(tmp_path, kept):
    """A 3-seed run: the "before adaptation" bars had no error bars although every seed measured them."""
    metrics = _three_seeds()
    assert report_figures.perplexity_figure(metrics, tmp_path / "p.png")
    ax = kept[0].axes[0]
    before, after = [c for c in ax.containers if c.get_label() in ("before adaptation", "after LoRA adaptation")]
    methods = [t.get_text() for t in ax.get_xticklabels()]
    assert methods == [display_name(m) for m in ("softmax", "global", "oal")]
    order = ["softmax", "global", "oal"]
    assert [b.get_height() for b in after] == pytest.approx([metrics["perplexity"][m] for m in order])
    assert [b.get_height() for b in before] == pytest.approx([metrics["perplexity_no_adapt"][m] for m in order])
    per = metrics["per_seed"]
    assert _errbars(after) == pytest.approx([metrics["perplexity_std"][m] for m in order])
    assert _errbars(before) == pytest.approx([_std(per, lambda p, m=m: p["perplexity_no_adapt"][m]) for m in order])
    assert "3 seeds" in ax.get_title()


def test_fidelity_figure_draws_the_seed_spread_per_layer(tmp_path, kept):
    metrics = _three_seeds()
    assert report_figures.fidelity_figure(metrics, tmp_path / "f.png")
    for ax, key in zip(kept[0].axes, ("relmse", "relmse_post_o"), strict=True):
        bars = {c.get_label(): c for c in ax.containers if c.get_label() in ("OAL", "Learned global")}
        for m in ("oal", "global"):
            c = bars[display_name(m)]
            rows = metrics["fidelity"][m]["per_layer"]
            assert [b.get_height() for b in c] == pytest.approx([rows[k][key] for k in ("1", "2")])
            assert _errbars(c) == pytest.approx(
                [_std(metrics["per_seed"], lambda p, k=k, m=m, key=key: p["fidelity"][m]["per_layer"][k][key])
                 for k in ("1", "2")])
        assert "3 seeds" in ax.get_title()


def test_one_seed_draws_no_error_bars(tmp_path, kept):
    metrics = json.loads((_run_dir(tmp_path) / "metrics.json").read_text())
    report_figures.perplexity_figure(metrics, tmp_path / "p.png")
    report_figures.fidelity_figure(metrics, tmp_path / "f.png")
    for fig in kept:
        for ax in fig.axes:
            assert all(_errbars(c) == [] for c in ax.containers) and "seeds" not in ax.get_title()


def _colours(ax) -> dict[str, str]:
    """Legend label -> colour of what it labels (a line or a bar group)."""
    out = {line.get_label(): to_hex(line.get_color()) for line in ax.get_lines()}
    out |= {c.get_label(): to_hex(c.patches[0].get_facecolor()) for c in ax.containers if hasattr(c, "patches")}
    return {k: v for k, v in out.items() if not k.startswith("_")}  # unlabelled marks (matplotlib's "_child0")


def test_a_method_keeps_its_colour_across_the_report_figures(tmp_path, kept):
    """OAL was green in the adaptation curves and orange in the fidelity bars (matplotlib's cycle, per figure)."""
    write_report(_run_dir(tmp_path))
    by_title = {fig.axes[0].get_title(): fig for fig in kept}
    adapt = next(f for t, f in by_title.items() if t.startswith("Adaptation"))
    fid = next(f for t, f in by_title.items() if t.startswith("Attention fidelity"))
    for m in ("oal", "global"):
        want = to_hex(report_figures.METHOD_COLORS[m])
        for ax in (*adapt.axes, *fid.axes):
            assert _colours(ax)[display_name(m)] == want, (m, ax.get_title())
    assert _colours(adapt.axes[0])[display_name("softmax")] == to_hex(report_figures.METHOD_COLORS["softmax"])


def test_adaptation_and_calibration_curves_are_the_json(tmp_path, kept):
    run = _run_dir(tmp_path)
    cal = json.loads((run / "calibration.json").read_text())
    # the real run's sets of initialisations differ per method: "taylor" must not change colour between panels
    for layer in cal["methods"]["global"].values():
        for h in layer["heads"]:
            h["curves"] = {"quadratic": h["curves"]["taylor"], "taylor": h["curves"]["taylor"]}
    for layer in cal["methods"]["oal"].values():
        for h in layer["heads"]:
            h["curves"]["global_perturbed"] = h["curves"]["global_embedded"]
    assert report_figures.calibration_figure(cal, tmp_path / "c.png")
    assert report_figures.adaptation_figure(run, ["oal", "global", "softmax"], tmp_path / "a.png")
    cal_fig, adapt_fig = kept
    colours = [_colours(ax) for ax in cal_fig.axes]
    assert colours[0]["taylor"] == colours[1]["taylor"]
    heads = cal["methods"]["oal"]["1"]["heads"] + cal["methods"]["oal"]["2"]["heads"]
    (line,) = [ln for ln in cal_fig.axes[1].get_lines() if ln.get_label() == "taylor"]
    steps = [p[0] for p in heads[0]["curves"]["taylor"]]
    assert list(line.get_xdata()) == steps
    assert list(line.get_ydata()) == pytest.approx(
        [statistics.fmean(h["curves"]["taylor"][i][1] for h in heads) for i in range(len(steps))])
    val_ax = adapt_fig.axes[1]
    for m in ("oal", "global", "softmax"):
        val = json.loads((run / "adapter" / m / "adapt.json").read_text())["validation"]
        (line,) = [ln for ln in val_ax.get_lines() if ln.get_label() == display_name(m)]
        assert list(line.get_xdata()) == [v["step"] for v in val]
        assert list(line.get_ydata()) == pytest.approx([v["val_nll"] for v in val])


def test_group_count_heatmap_has_integer_colour_ticks(tmp_path, kept):
    """The groups-per-head colour bar read 2.0, 2.2, 2.4 ... groups."""
    values = [[2, 3, 2, 2], [2, 2, 2, 5]]
    analysis_figures.heatmap(tmp_path / "h.png", values, [1, 2], "Groups per head (App. B)", "groups", "d")
    fig = kept[0]
    bar = fig.axes[1]
    ticks = list(bar.get_yticks())
    assert ticks and all(float(t).is_integer() for t in ticks) and {2, 3, 5} <= set(ticks)
    ax = fig.axes[0]
    assert [[int(t.get_text()) for t in ax.texts[i * 4:(i + 1) * 4]] for i in range(2)] == values
    analysis_figures.heatmap(tmp_path / "s.png", [[0.2, 0.3]], [1], "top-5", "share", ".2f")  # shares: continuous
    assert [t.get_text() for t in kept[1].axes[0].texts] == ["0.20", "0.30"]


def test_representative_head_fits_the_report_page(tmp_path, kept):
    """Four panels in one 18-inch row: at report.md's page width the labels shrank to a few pixels."""
    head = {"head": 0, "chi": [0.01 * r for r in range(8)], "groups": [0] * 7 + [1], "cuts": [7], "n_groups": 2}
    analysis_figures.head_panels(tmp_path / "r.png", 1, head, [1.0] * 8, [0.5] * 8)
    fig = kept[0]
    assert fig.get_size_inches()[0] <= 12
    chi_ax = fig.axes[2]
    assert [p.get_height() for p in chi_ax.patches] == pytest.approx(head["chi"])
    assert chi_ax.get_ylim()[1] > max(head["chi"]) * 1.05  # its "r=7" label sits inside the frame


def test_pipeline_picture_is_written_atomically_and_closed(tmp_path, monkeypatch):
    calls = []
    import oal.rundir.files as files

    real = files.atomic_write
    monkeypatch.setattr(files, "atomic_write", lambda path, write: calls.append(path) or real(path, write))
    before = set(plt.get_fignums())
    runpy.run_path(str(ROOT / "docs" / "assets" / "pipeline_figure.py"))["main"](tmp_path / "pipeline.png")
    assert set(plt.get_fignums()) == before
    assert calls == [tmp_path / "pipeline.png"] and [p.name for p in tmp_path.iterdir()] == ["pipeline.png"]


def test_report_figures_are_closed_and_drawn_without_a_display(tmp_path):
    assert matplotlib.get_backend().lower() == "agg"
    before = set(plt.get_fignums())
    for _ in range(3):
        write_report(_run_dir(tmp_path))
    assert set(plt.get_fignums()) == before


def _bench_figure(monkeypatch, module, draw):
    """Run a benchmark's plot function and return its figure (written to a temp path, closed)."""
    import oal.rundir.files as files

    figs = []
    real = files.atomic_save_figure
    monkeypatch.setattr(files, "atomic_save_figure", lambda fig, path, **kw: figs.append(fig) or real(fig, path, **kw))
    draw(module)
    return figs[0]


def test_operator_phase_legend_does_not_cover_the_bars(tmp_path, monkeypatch):
    from benchmarks import operator

    data = json.loads((REFERENCE / "operator_tuned_xeon_amx_final.json").read_text())
    fig = _bench_figure(monkeypatch, operator, lambda m: m._plot(data["rows"], data["summary"], tmp_path / "o.png"))
    ax = fig.axes[2]
    canvas = FigureCanvasAgg(fig)  # closing left the figure a bare canvas
    canvas.draw()
    renderer = canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [*operator.PHASES, "other"]
    assert not any(p.get_window_extent(renderer).overlaps(legend) for p in ax.patches if p.get_height() > 0)
    shares = sorted(s["phase_share"][operator.PHASES[0]] * 100 for s in data["summary"])
    assert sorted(p.get_height() for c in (ax.containers[0], ax.containers[5]) for p in c) == pytest.approx(shares)


def test_benchmark_figures_use_the_methods_colours(tmp_path, monkeypatch):
    from benchmarks import _budget_study, frontier, generate

    want = {m: to_hex(c) for m, c in report_figures.METHOD_COLORS.items()}
    gen = json.loads((REFERENCE / "generate_cpu_xeon_amx.json").read_text())
    fig = _bench_figure(monkeypatch, generate, lambda m: m.plot(gen["rows"], "t", tmp_path / "g.png"))
    assert {k: want[k] for k in _colours(fig.axes[0])} == _colours(fig.axes[0])
    front = json.loads((REFERENCE / "frontier_smollm2.json").read_text())
    fig = _bench_figure(monkeypatch, frontier, lambda m: m.figure(front, tmp_path / "f.png"))
    colours = _colours(fig.axes[0])
    for r in front["rows"]:
        assert colours[frontier.arm(r)] == want[r["method"]]
        (line,) = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == frontier.arm(r)]
        assert list(line.get_ydata()) == [x["ppl"] for x in sorted(
            (x for x in front["rows"] if frontier.arm(x) == frontier.arm(r)), key=lambda x: x["n_linear"])]
    markers = {ln.get_label(): ln.get_marker() for ln in fig.axes[0].get_lines()}
    assert markers["swa"] != markers["swa (fidelity+recall)"]  # one point each: colour alone cannot tell them apart
    budget = json.loads((REFERENCE / "smollm2_budget.json").read_text())
    fig = _bench_figure(monkeypatch, _budget_study, lambda m: m.plot(budget, tmp_path / "b.png"))
    for label, colour in _colours(fig.axes[0]).items():
        assert colour == want[label.split(",")[0]], label


def _drawn(fig):
    canvas = FigureCanvasAgg(fig)  # closing left the figure a bare canvas
    canvas.draw()
    return canvas.get_renderer()


def _many_methods(metrics: dict) -> dict:
    """Every baseline beside OAL and global, far worse on layer 1: the RelMSE axis turns log."""
    for k, m in enumerate(("performer", "spectraformer", "dijiang", "taylorshift", "swa", "global-swa", "oal-swa")):
        metrics["fidelity"][m] = {"per_layer": {"1": {"relmse": 3.0 * (k + 1), "relmse_post_o": 2.0},
                                                "2": {"relmse": 0.1, "relmse_post_o": 1.5}}}
        metrics["perplexity"][m] = 100.0 * (k + 1)
    return metrics


@pytest.mark.parametrize("many", [False, True])
def test_bar_legends_keep_off_the_bars_and_labels_stay_on_the_figure(tmp_path, kept, many):
    """Bars of similar height fill the axes: "best" laid the legend over them (3-seed fidelity figure); with every
    method the log-scale y label ran off the figure and the legend over the neighbouring panel."""
    metrics = _many_methods(_three_seeds()) if many else _three_seeds()
    report_figures.fidelity_figure(metrics, tmp_path / "f.png")
    report_figures.perplexity_figure(metrics, tmp_path / "p.png")
    for fig in kept:
        renderer = _drawn(fig)
        page = fig.bbox
        for ax in fig.axes:
            legend = ax.get_legend().get_window_extent(renderer)
            marks = [p.get_window_extent(renderer) for p in ax.patches if p.get_height() > 0]
            marks += [Bbox(ax.transData.transform(seg)) for c in ax.containers if getattr(c, "errorbar", None)
                      for col in c.errorbar.lines[2] for seg in col.get_segments() if len(seg) == 2]
            assert not any(m.overlaps(legend) for m in marks), ax.get_title()
            assert ax.bbox.x0 <= legend.x0 and legend.x1 <= ax.bbox.x1, ax.get_title()  # inside its own panel
            label = ax.yaxis.label.get_window_extent(renderer)
            assert page.y0 <= label.y0 and label.y1 <= page.y1 and page.x0 <= label.x0, ax.get_ylabel()


def test_budget_curves_show_the_spread_over_seeds(tmp_path, monkeypatch):
    """A study with two seeds per arm drew only their mean: nothing said that seeds disagreed, or by how much."""
    from benchmarks import _budget_study

    data = json.loads((REFERENCE / "smollm2_budget.json").read_text())
    b = data["budgets"]["256"]
    for m, seeds in b["curves_by_seed"].items():
        (first,) = seeds.values()
        seeds["43"] = [[s, v * 1.1] for s, v in first]
        b["curves"][m] = [[s, (v + v * 1.1) / 2] for s, v in first]
    fig = _bench_figure(monkeypatch, _budget_study, lambda m: m.plot(data, tmp_path / "b.png"))
    ax = fig.axes[0]
    bands = ax.collections
    assert len(bands) == len(b["curves"]) and "std" in ax.get_ylabel()
    for band, (m, mean) in zip(bands, sorted(b["curves"].items()), strict=True):
        seeds = list(b["curves_by_seed"][m].values())
        (x, v), sd = mean[0], statistics.stdev(c[0][1] for c in seeds)  # the first validation
        ys = [y for px, y in band.get_paths()[0].vertices if px == x]
        assert min(ys) == pytest.approx(v - sd) and max(ys) == pytest.approx(v + sd)
        assert to_hex(band.get_facecolor()[0]) == to_hex(report_figures.METHOD_COLORS[m])
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert sum("2 seeds" in t for t in labels) == len(b["curves"])
    renderer = _drawn(fig)  # nine entries and their bands: the legend sits under the panel, not on the curves
    assert ax.get_legend().get_window_extent(renderer).y1 <= ax.bbox.y0


def test_offset_gain_figure_gives_both_axes_in_percent_as_its_table(tmp_path, monkeypatch):
    """figures/offset/gain.png plotted the offset share as a fraction (0-0.035) beside a table in percent (1.25%)
    and a y axis in percent."""
    import oal.diagnostics.offset_part as offset_part

    kept = []
    monkeypatch.setattr(offset_part, "atomic_save_figure", lambda fig, path, **kw: kept.append(fig) or path)
    points = {"real": [{"layer": 2, "x": 0.0125, "gain": 0.10}, {"layer": 3, "x": 0.0363, "gain": -0.02}],
              "planted": [{"offset_std": 0.5, "x": 0.02, "gain": 0.05}]}
    offset_part.plot_gain(points, tmp_path / "gain.png")
    ax = kept[0].axes[0]
    real = ax.collections[0].get_offsets()
    assert [round(float(x), 6) for x in real[:, 0]] == [1.25, 3.63] and [round(float(y), 6) for y in real[:, 1]] == \
        [10.0, -2.0]
    assert list(ax.lines[0].get_xdata()) == [2.0] and "%" in ax.get_xlabel()
    plt.close(kept[0])


def test_a_multi_seed_reports_one_seed_curves_say_whose_they_are(tmp_path, kept):
    """The top report's calibration and adaptation curves are seed 1's; the figures did not say so."""
    from test_report_audit import _multi_seed

    _multi_seed(tmp_path, seeds=(1, 2))
    write_report(tmp_path)
    titles = {fig._suptitle.get_text() if fig._suptitle else "" for fig in kept}
    assert "seed 1 alone (of seeds [1, 2])" in titles
    curves = [f for f in kept if f._suptitle and "seed 1 alone" in f._suptitle.get_text()]
    assert {ax.get_title().split(":")[0] for f in curves for ax in f.axes} >= {"Adaptation", "OAL"}, curves
