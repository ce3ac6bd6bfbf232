"""Wording a user walkthrough found untrue or clumsy: the exported card's retrieval caution, the attention-regime
verdict of a window-hybrid run, report.md's plurals and passkey labels, and `oal generate --help`'s line breaks."""

from __future__ import annotations

from pathlib import Path

from _tiny import tiny_model
from typer.testing import CliRunner


def _passkey(lengths, acc, trials=2):
    return {"lengths": lengths, "depths": [0.5], "trials": trials, "digits": 5, "seed": 0,
            "accuracy": {str(n): {"0.5": acc} for n in lengths}, "by_length": {str(n): acc for n in lengths},
            "by_depth": {"0.5": acc}, "mean": acc, "examples": {}}


def _card(method: str, metrics: dict) -> str:
    import oal
    from oal.artefact.card import card_metrics, card_text

    model = oal.convert(tiny_model("llama", 97), [1], method)
    return card_text(model, {}, card_metrics(metrics, method, adapted=True))


def test_card_quotes_the_runs_passkey_not_the_default_models_loss():
    """An oal-swa run that measured passkey 1.00 at 1024 tokens exported a card saying retrieval "is lost on the
    converted layers", with the embedded default model's numbers, and no passkey row in its metrics table."""
    pk = {"oal-swa": {"adapted": _passkey([1024], 1.0)}, "softmax": {"adapted": _passkey([1024], 1.0)}}
    text = _card("oal-swa", {"perplexity": {"softmax": 10.0, "oal-swa": 10.1}, "passkey": pk})
    assert "is lost" not in text and "embedded default model" not in text
    assert "| passkey retrieval, oal-swa (accuracy by context length) | 1024 tokens 1.00, mean 1.00 |" in text
    limits = text.split("## Limitations")[1]
    assert "oal-swa: 1024 tokens 1.00" in limits and "sliding window" in limits and "exact softmax" in limits


def test_card_keeps_the_generic_caution_only_where_passkey_was_not_measured():
    text = _card("oal", {"perplexity": {"softmax": 10.0, "oal": 12.0}})
    assert "Long-context retrieval is lost on the converted layers" in text and "oal evaluate --passkey" in text
    window = _card("oal-swa", {"perplexity": {"softmax": 10.0, "oal-swa": 10.1}})
    assert "is lost" not in window and "not measured" in window and "beyond the window" in window


def _peaked_layers(kernel: str) -> dict:
    row = {"max_weight": [0.99, 0.98], "kernels": {kernel: {"kernel_weight_beyond": [0.0, 0.0],
                                                            "softmax_weight_beyond": [0.0, 0.0]}}}
    return {"1": row}


def test_regime_verdict_of_a_window_hybrid_says_the_kernel_covers_only_older_keys():
    """A run whose only converted arm was oal-swa (1.009x softmax's PPL) was told to "expect every quadratic kernel
    (OAL, global, Taylor) to fail in the same way here"."""
    from oal.analysis.regime import regime_verdict

    hybrid = regime_verdict(_peaked_layers("oal-swa"))
    assert hybrid["outside_regime"] and "Expect every quadratic kernel" not in hybrid["text"]
    assert "oal-swa keeps exact softmax weights inside its sliding window" in hybrid["text"]
    assert "beyond it" in hybrid["text"]
    plain = regime_verdict(_peaked_layers("oal"))
    assert "Expect every quadratic kernel (OAL, global, Taylor) to fail" in plain["text"]


def test_regime_section_rewords_a_recorded_verdict():
    """report.md printed regime.json's stored sentence; the wording follows the recorded statistics."""
    from oal.analysis.regime import regime_markdown

    layers = {"1": {**_peaked_layers("oal-swa")["1"], "eff_keys": [1.0, 1.1], "logit_p01": [0.0, 0.0],
                    "logit_p99": [1.0, 1.0], "logit_min": [0.0, 0.0], "logit_max": [1.0, 1.0]}}
    layers["1"]["kernels"]["oal-swa"]["beyond_vertex"] = [0.0, 0.0]
    stale = {"text": "OUTSIDE ... Expect every quadratic kernel (OAL, global, Taylor) to fail in the same way here"}
    text = "\n".join(regime_markdown({"layers": layers, "settings": {"min_keys": 16}, "verdict": stale}, "here"))
    assert "Expect every quadratic kernel" not in text and "oal-swa keeps exact softmax" in text


def _table(header, rows):
    return "\n".join("|".join(r) for r in [header, *rows])


def test_passkey_section_says_one_key_and_labels_arms_as_the_other_figures(tmp_path: Path):
    from oal.evaluate.passkey import passkey_section
    from oal.pipeline.report_format import display_name

    pk = {"oal": {"adapted": _passkey([256], 0.0, 1), "no_adapt": _passkey([256], 0.0, 1)},
          "softmax": {"adapted": _passkey([256], 1.0, 1)}}
    text = "\n".join(passkey_section({"passkey": pk}, tmp_path, _table, display_name))
    assert "1 key per cell" in text and "1 keys" not in text
    rows = [line.split("|")[0] for line in text.splitlines() if line.count("|") >= 2][1:]
    assert rows == ["Softmax (LoRA)", "OAL before adaptation", "OAL (LoRA)"]


def test_generate_help_rewraps_its_second_sentence():
    """`oal generate --help` broke a line after "a longer" (a hard newline in a later docstring paragraph, which
    typer's rich help keeps), leaving a short line in the middle of a sentence."""
    from oal.cli import load_commands

    res = CliRunner(env={"COLUMNS": "100", "TERMINAL_WIDTH": "100"}).invoke(load_commands(), ["generate", "--help"])
    assert res.exit_code == 0, res.output
    assert "a longer request is refused" in " ".join(res.output.split())
    lines = [line.strip() for line in res.output.splitlines()]
    assert not any(line.endswith("a longer") for line in lines)
