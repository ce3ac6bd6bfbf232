"""A new user's first hour with SmolLM2-135M-Instruct (2026-12-07), on tiny stand-ins: `oal generate --method
softmax` (the baseline a user compares against) was refused as "not calibrated"; an instruct model's bare question
printed the prompt alone, as if nothing ran, with no way to use its chat template; the report's figures clipped a
calibration panel's title and put fractional ticks on an axis of whole updates."""

from __future__ import annotations

import json

import pytest
import torch
from _runs import random_methods
from _tiny import save_tiny_llama
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from oal.calibration.kernels import kernel_dir, save_kernels
from oal.cli import load_commands
from oal.models.registry import load_model

TEMPLATE = ("{% for m in messages %}<user>{{ m['content'] }}</user>{% endfor %}"
            "{% if add_generation_prompt %}<bot>{% endif %}")


def _make_run(root, *, mute: bool = False, template: bool = True):
    """A run directory with random oal kernels and the softmax arm's record (config.json), on a tiny Llama whose
    tokenizer has a chat template (unless not `template`); `mute` zeroes its final norm, so every logit is 0 and
    greedy decoding emits the pad token (a special token) alone."""
    base = save_tiny_llama(root / "base")
    if template:
        tok = AutoTokenizer.from_pretrained(base)
        tok.chat_template = TEMPLATE
        tok.save_pretrained(base)
    if mute:
        mdl = AutoModelForCausalLM.from_pretrained(base)
        with torch.no_grad():
            mdl.model.norm.weight.zero_()
        mdl.save_pretrained(base)
    run = root / "run"
    _, _, prov = load_model(str(base))
    save_kernels(random_methods("oal", 4, 2, 8, seed=0), kernel_dir(run, "oal"), base_model=str(base),
                 provenance=prov)
    record = {"model": str(base), "state_dict_sha256": prov["state_dict_sha256"], "dtype": prov["dtype"],
              "sha256": prov["sha256"]}
    (run / "config.json").write_text(json.dumps({"config": {"dtype": "float32"}, "model": record}))
    return base, run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _make_run(tmp_path_factory.mktemp("first-hour"))


def _generate(*args):
    res = CliRunner().invoke(load_commands(), ["generate", *[str(a) for a in args]])
    return res, res.output.rstrip().splitlines()


def _greedy(base, ids, n):
    mdl = AutoModelForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        return mdl.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                            pad_token_id=0)[0, ids.shape[1]:]


def test_generate_runs_the_softmax_arm(tiny):
    """It was refused: "the run did not calibrate 'softmax'", though the run holds the softmax arm."""
    base, run = tiny
    tok = AutoTokenizer.from_pretrained(base)
    res, lines = _generate("Hello", "--out", run, "--method", "softmax", "--max-new-tokens", 6, "--device", "cpu")
    assert res.exit_code == 0, res.output
    ids = tok("Hello", return_tensors="pt", add_special_tokens=False).input_ids
    assert lines[-1] == "Hello" + tok.decode(_greedy(base, ids, 6), skip_special_tokens=True)


def test_generate_chat_sends_the_prompt_through_the_chat_template(tiny):
    base, run = tiny
    tok = AutoTokenizer.from_pretrained(base)
    res, lines = _generate("Hi?", "--out", run, "--method", "softmax", "--chat", "--max-new-tokens", 5,
                           "--device", "cpu")
    assert res.exit_code == 0, res.output
    ids = tok("<user>Hi?</user><bot>", return_tensors="pt", add_special_tokens=False).input_ids
    reply = tok.decode(_greedy(base, ids, 5), skip_special_tokens=True)
    assert reply.strip() and lines[-1] == reply  # the reply alone: the templated prompt is not echoed


def test_generate_chat_without_a_template_is_one_line(tmp_path):
    _, run = _make_run(tmp_path, template=False)
    res, _ = _generate("Hi", "--out", run, "--chat", "--device", "cpu")
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert "--chat" in res.output and "no chat template" in res.output, res.output


@pytest.mark.parametrize("method", ["oal", "softmax"])
def test_generate_says_when_the_model_generated_no_text(tmp_path, method):
    """An instruct model's bare question ends at once with its end token: the prompt came back alone, unremarked."""
    _, run = _make_run(tmp_path, mute=True)
    res, lines = _generate("Hi", "--out", run, "--method", method, "--max-new-tokens", 3, "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert lines[-1] == "Hi"
    assert any("generated no text" in ln and "--chat" in ln for ln in lines), res.output


def test_generate_refuses_an_empty_prompt_before_loading(tmp_path):
    res, _ = _generate("", "--out", tmp_path)  # an empty folder: loading anything would fail on --out
    assert res.exit_code == 2 and "PROMPT" in res.output and "empty" in res.output, res.output


@pytest.fixture
def figures(monkeypatch):
    """The report's figures as drawn, before they are saved and closed."""
    import oal.pipeline.report_figures as rf

    drawn = []
    monkeypatch.setattr(rf, "atomic_save_figure", lambda fig, path, **kw: drawn.append(fig))
    return rf, drawn


def _texts_fit(fig) -> None:
    """Every title and axis label lies inside the figure, and no two of them overlap."""
    fig.canvas.draw()
    renderer, box = fig.canvas.get_renderer(), fig.bbox
    texts = [t for ax in fig.axes for t in (ax.title, ax.xaxis.label, ax.yaxis.label) if t.get_text()]
    extents = [t.get_window_extent(renderer) for t in texts]
    for t, e in zip(texts, extents, strict=True):
        assert box.x0 <= e.x0 and e.x1 <= box.x1 and box.y0 <= e.y0 and e.y1 <= box.y1, t.get_text()
    for i, e in enumerate(extents):
        for j in range(i + 1, len(extents)):
            assert not e.overlaps(extents[j]), (texts[i].get_text(), texts[j].get_text())


@pytest.mark.parametrize("method", ["oal", "oal-swa", "global-swa", "swa"])
def test_calibration_figure_titles_fit(figures, tmp_path, method):
    """One method's panel is 4.5 inches: "Window + OAL (hybrid): calibration (Eq. 20)" ran past both edges."""
    rf, drawn = figures
    curves = {"taylor": [[0, 0.07], [25, 0.02], [50, 0.01]], "global_embedded": [[0, 0.002], [25, 0.0019]]}
    calibration = {"methods": {method: {"13": {"heads": [{"curves": curves}]}}}}
    assert rf.calibration_figure(calibration, tmp_path / "c.png")
    _texts_fit(drawn[0])


def test_adaptation_figure_ticks_whole_updates(figures, tmp_path):
    """Two updates were plotted against ticks 1.2, 1.4, ...: an update count has no fractions."""
    rf, drawn = figures
    for k, m in enumerate(["oal-swa", "softmax"]):
        (tmp_path / "adapter" / m).mkdir(parents=True)
        record = {"history": [{"step": 1, "loss": 2.75 - k / 100}, {"step": 2, "loss": 2.56}],
                  "validation": [{"step": 1, "val_nll": 2.964 - k / 200}, {"step": 2, "val_nll": 2.96 - k / 200}]}
        (tmp_path / "adapter" / m / "adapt.json").write_text(json.dumps(record))
    assert rf.adaptation_figure(tmp_path, ["oal-swa", "softmax"], tmp_path / "a.png")
    fig = drawn[0]
    _texts_fit(fig)
    for ax in fig.axes:
        lo, hi = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks


def test_fidelity_figure_titles_do_not_run_into_the_next_panel(figures, tmp_path):
    """With one method on two layers, the left title ran into the right panel's y label."""
    rf, drawn = figures
    per_layer = {"13": {"relmse": 0.0032, "relmse_post_o": 0.0035}, "14": {"relmse": 0.068, "relmse_post_o": 0.081}}
    assert rf.fidelity_figure({"fidelity": {"oal-swa": {"per_layer": per_layer}}}, tmp_path / "f.png")
    _texts_fit(drawn[0])
