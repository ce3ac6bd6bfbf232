"""Passkey audit: a key cut by the token budget is not a match, bad lengths and methods fail before any decoding,
and the report says when its arms were measured with different settings."""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import ByT5Tokenizer

from oal.errors import InputError
from oal.evaluate.passkey import answer_tokens, evaluate_passkey, passkey_section, passkey_table

TOK = ByT5Tokenizer(extra_ids=0)  # one token per byte: the budget below is counted in characters


class Answers(torch.nn.Module):
    """A stand-in for a causal LM whose generate() writes `before` + the prompt's key + `after` (the EOS token for
    "</s>"), cut at max_new_tokens as generate() does; counts its calls."""

    def __init__(self, before: str, after: str):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(max_position_embeddings=None)
        self.generation_config = None
        self.before, self.after, self.calls = before, after, 0

    def generate(self, input_ids, max_new_tokens, **kwargs):
        self.calls += 1
        key = re.search(r"The pass key is (\d+)\.", TOK.decode(input_ids[0].tolist())).group(1)
        new = TOK(self.before + key + self.after, add_special_tokens=False)["input_ids"]
        if self.after.endswith("</s>"):
            new = TOK(self.before + key, add_special_tokens=False)["input_ids"] + [TOK.eos_token_id]
        return torch.cat([input_ids, torch.tensor([new[:max_new_tokens]], device=input_ids.device)], 1)


def _mean(model) -> float:
    return evaluate_passkey(model, TOK, lengths=[300], depths=[0.0, 1.0], trials=2)["mean"]


def test_a_key_cut_by_the_token_budget_is_not_a_match():
    """The model writes 'ab ' and then the key with one more digit; the budget (8 tokens here) ends right after
    the key's five digits, so the text read '...ab 12345' and scored 1.0 although the number was 123459."""
    budget = answer_tokens(TOK)
    assert len("ab ") + 5 == budget  # the case: the key's last digit is the last token generated
    assert _mean(Answers("ab ", "9.")) == 0.0
    # the same key whole: followed by a non-digit inside the budget, or by EOS as the budget's last token
    assert _mean(Answers(" ", ".")) == 1.0
    assert _mean(Answers("a ", "</s>")) == 1.0
    assert _mean(Answers(" ", "9.")) == 0.0  # a longer number inside the budget was always a miss


def test_a_too_short_length_fails_before_any_decoding():
    """`--lengths 300,40`: every prompt at 300 tokens was decoded before 40 failed, with a ValueError that did not
    name --lengths."""
    model = Answers(" ", ".")
    with pytest.raises(InputError, match="cannot hold") as exc:
        evaluate_passkey(model, TOK, lengths=[300, 40], depths=[0.5], trials=2)
    assert exc.value.param == "--lengths" and model.calls == 0


def test_every_method_is_checked_before_the_first_arm_is_measured(tmp_path, monkeypatch):
    """`oal evaluate --passkey --methods softmax,bogus` measured softmax (both variants) before failing on bogus."""
    import oal.artefact.arms as arms
    import oal.pipeline.publish as publish
    from oal.pipeline.evaluate_passkey import evaluate_passkey_run

    loaded = []

    def load_arm(run_dir, method, *args, **kwargs):
        loaded.append(method)
        raise RuntimeError("loaded")

    monkeypatch.setattr(publish, "check_publishable", lambda out_dir: None)
    monkeypatch.setattr(arms, "load_arm", load_arm)
    with pytest.raises(InputError, match="'bogus'") as exc:
        evaluate_passkey_run(tmp_path, ["softmax", "bogus"], lengths=[300], progress=False)
    assert exc.value.param == "--methods" and loaded == []


def _result(lengths, depths, trials, acc=1.0):
    grid = {str(n): {f"{d:g}": acc for d in depths} for n in lengths}
    return {"lengths": lengths, "depths": depths, "trials": trials, "digits": 5, "seed": 0, "accuracy": grid,
            "by_length": {str(n): acc for n in lengths}, "by_depth": {f"{d:g}": acc for d in depths}, "mean": acc,
            "examples": {}}


def _table(header, rows):
    return "\n".join("|".join(r) for r in [header, *rows])


def test_report_names_the_settings_of_each_arm_when_they_differ(tmp_path: Path):
    """softmax measured again with --trials 1 --depths 0.5: the report's line still read "depths 0, 0.25, 0.5,
    0.75, 1 ..., 2 keys per cell" (the first arm's) above rows that did not compare."""
    every = [0.0, 0.25, 0.5, 0.75, 1.0]
    pk = {"oal": {"no_adapt": _result([256], every, 2, 0.0)}, "softmax": {"no_adapt": _result([256], [0.5], 1)}}
    text = "\n".join(passkey_section({"passkey": pk}, tmp_path, _table))
    assert "different settings" in text
    assert "softmax (no adapt): a 5-digit key hidden at depths 0.5 of the filler, 1 key per cell" in text
    assert "oal (no adapt): a 5-digit key hidden at depths 0, 0.25, 0.5, 0.75, 1 of the filler, 2 keys" in text
    same = {"oal": {"no_adapt": _result([256], every, 2)}, "softmax": {"no_adapt": _result([256], every, 2)}}
    text = "\n".join(passkey_section({"passkey": same}, tmp_path, _table))
    assert "different settings" not in text and "depths 0, 0.25, 0.5, 0.75, 1 of the filler, 2 keys per cell" in text


def test_table_rows_put_no_adapt_before_adapted_as_the_terminal_does():
    """metrics.json keeps its keys sorted, so the report listed "softmax (adapted)" above "softmax (no adapt)" while
    the terminal's table (from the measured dict) had them the other way round."""
    r = _result([256], [0.5], 1)
    saved = {"oal": {"adapted": r, "no_adapt": r}, "softmax": {"adapted": r, "no_adapt": r}}
    measured = {"softmax": {"no_adapt": r, "adapted": r}, "oal": {"no_adapt": r, "adapted": r}}
    assert passkey_table(saved)[2] == passkey_table(measured)[2]
    assert [row[0] for row in passkey_table(saved)[2]] == ["softmax (no adapt)", "softmax (adapted)",
                                                           "oal (no adapt)", "oal (adapted)"]


def test_each_length_and_depth_is_measured_once_in_order():
    """`--lengths 400,300,400 --depths 1,0,1` decoded every repeated cell again and drew the heatmap's axes in the
    order typed (a repeated column, 400 left of 300)."""
    model = Answers(" ", ".")
    res = evaluate_passkey(model, TOK, lengths=[400, 300, 400], depths=[1.0, 0.0, 1.0], trials=2)
    assert res["lengths"] == [300, 400] and res["depths"] == [0.0, 1.0]
    assert model.calls == 2 * 2 * 2 and list(res["accuracy"]) == ["300", "400"]


def test_heatmap_depth_labels_stay_clear_of_the_panel_on_their_left(tmp_path, monkeypatch):
    """report.md's passkey.png: from the second panel on, the depth tick labels ("0.75") were drawn over the panel
    on their left."""
    import oal.rundir.files as files
    from oal.evaluate.passkey import passkey_figure

    drawn = {}

    def keep(fig, path, **kwargs):
        fig.canvas.draw()
        drawn["boxes"] = [(ax.get_window_extent(), [t.get_window_extent() for t in ax.get_yticklabels()])
                          for ax in fig.axes[:-1]]  # the last axes is the colour bar
        return Path(path)

    monkeypatch.setattr(files, "atomic_save_figure", keep)
    every = [0.0, 0.25, 0.5, 0.75, 1.0]
    arms = {f"m{i} (no adapt)": _result([256, 512, 1024], every, 1) for i in range(4)}
    assert passkey_figure(arms, tmp_path / "passkey.png")
    for (left, _), (_, labels) in zip(drawn["boxes"], drawn["boxes"][1:], strict=False):
        assert all(label.x0 >= left.x1 for label in labels)
