"""`analyze` end to end on a tiny random Qwen2, the concentration/stability statistics, and `load_groups`."""

import json

import pytest
import torch
from _tiny import save_tiny_llama
from transformers import Qwen2Config, Qwen2ForCausalLM

from oal.analysis import (
    analyze,
    fixed_budget_groups,
    head_contributions,
    load_groups,
    parse_grouping,
    stable_gap_groups,
)
from oal.analysis.controls import gaussian_chi, share_at, spearman, topk_concentration, topk_overlap
from oal.analysis.offset import offset_moments, offset_summary
from oal.models.capture import capture


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return Qwen2ForCausalLM(cfg).eval()


class _CharTokenizer:
    """Minimal tokenizer: one id per character (enough to exercise string prompts and padding)."""

    pad_token_id = 0

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + ord(ch) % 63 for ch in text]}


def test_analyze_writes_consistent_outputs(tiny, tmp_path):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (6, 20), generator=gen)
    held = torch.randint(0, 64, (4, 20), generator=gen)
    long_seq = torch.randint(0, 64, (70,), generator=gen)
    summary = analyze(tiny, None, ids, [2, 0], tmp_path, heldout=held, long_sequence=long_seq, lengths=[8, 33, 70],
                      n_bootstrap=50, batch_size=4, representative=(2, 1))
    data = json.loads((tmp_path / "groups.json").read_text())
    assert data["layers"] == [0, 2] and data["n_prompts"] == 6 and data["head_dim"] == 8
    # chi in groups.json is Eq. 2 averaged over prompts, from an independent capture
    direct = {}
    with torch.no_grad():
        capture(tiny, ids, [0, 2], lambda c: direct.__setitem__(c.layer, head_contributions(c.q, c.k)))
    for layer in (0, 2):
        chi_file = torch.tensor([h["chi"] for h in data["heads"][str(layer)]], dtype=torch.float64)
        torch.testing.assert_close(chi_file, direct[layer].double().mean(0), rtol=1e-5, atol=1e-8)
        res = stable_gap_groups(direct[layer].double().transpose(0, 1), n_bootstrap=50)
        assert torch.equal(load_groups(tmp_path)[layer], res.groups)
        assert [h["cuts"] for h in data["heads"][str(layer)]] == res.cuts
    # Table 4: the longest prefix is the whole sequence
    with torch.no_grad():
        full = {}
        capture(tiny, long_seq[None], [2], lambda c: full.__setitem__(2, head_contributions(c.q, c.k)[0]))
    share = full[2][1] / full[2][1].sum()
    rep = summary["stability_lengths"]["representative"]
    torch.testing.assert_close(torch.tensor(rep["percent"][-1]), 100 * share[rep["dims"]].float(), rtol=1e-4,
                               atol=1e-4)
    assert summary["stability_lengths"]["lengths"] == [8, 33, 70]
    s = summary["stability_inputs"]
    assert len(s["spearman"]) == 2 and all(-1 <= v <= 1 for row in s["spearman"] for v in row)
    conc = summary["concentration"]
    assert all(5 / 8 <= v <= 1 for row in conc["real_top5"] for v in row)  # top-5 of 8 dims holds >= 5/8
    analysis = json.loads((tmp_path / "analysis.json").read_text())
    assert analysis["representative"] == {"layer": 2, "head": 1}
    # analysis.json["offset"]: the per-query offsets of the prompts' own q/k under the groups used
    moments = {}
    with torch.no_grad():
        capture(tiny, ids, [0, 2], lambda c: moments.__setitem__(c.layer, offset_moments(c.q, c.k, scale=c.scaling)))
    want = offset_summary(moments, load_groups(tmp_path))
    assert analysis["offset"]["verdict"]["text"] == want["verdict"]["text"]
    for layer in ("0", "2"):
        for got, ref in zip(analysis["offset"]["layers"][layer]["heads"], want["layers"][layer]["heads"], strict=True):
            for key in ("offset_share", "offset_std", "isolated_offset_std", "isolated_offset_share"):
                assert got[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-9)
    names = {p.name for p in (tmp_path / "figures").iterdir()}
    assert {"profile_layer0.png", "profile_layer2.png", "representative_head.png", "heatmap_groups.png",
            "heatmap_top5.png", "gaussian_controls.png", "stability_inputs.png", "stability_lengths.png"} <= names
    assert not [n for n in names if n.endswith(".tmp")]


def test_string_prompts_with_padding_match_single_prompts(tiny, tmp_path):
    tok = _CharTokenizer()
    prompts = ["the quick brown fox", "a b", "jumps over the lazy dog!", "xyz abc"]
    analyze(tiny, tok, prompts, [1], tmp_path / "batched", n_bootstrap=20, batch_size=4, figures=False)
    analyze(tiny, tok, prompts, [1], tmp_path / "single", n_bootstrap=20, batch_size=1, figures=False)
    a = json.loads((tmp_path / "batched" / "groups.json").read_text())
    b = json.loads((tmp_path / "single" / "groups.json").read_text())
    assert a["prompt_lengths"] == [len(p) for p in prompts]
    chi_a = torch.tensor([h["chi"] for h in a["heads"]["1"]])
    chi_b = torch.tensor([h["chi"] for h in b["heads"]["1"]])
    torch.testing.assert_close(chi_a, chi_b, rtol=1e-5, atol=1e-7)
    # padded pairs do not count in the per-query offsets either
    off_a, off_b = (json.loads((tmp_path / d / "analysis.json").read_text())["offset"]["layers"]["1"]["heads"]
                    for d in ("batched", "single"))
    assert [h["offset_share"] for h in off_a] == pytest.approx([h["offset_share"] for h in off_b], rel=1e-4)


def test_statistics():
    a = torch.tensor([[1.0, 5.0, 2.0, 9.0, 3.0, 0.5]], dtype=torch.float64)
    assert spearman(a, a**3 + 7).item() == pytest.approx(1.0)
    assert spearman(a, -a).item() == pytest.approx(-1.0)
    b = torch.tensor([[1.0, 1.0, 2.0, 3.0]], dtype=torch.float64)  # ties take the average rank
    c = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    assert spearman(b, c).item() == pytest.approx(0.9486832980505138)
    assert topk_overlap(a, a, 5).item() == 5
    assert topk_overlap(a, torch.tensor([[9.0, 0.0, 8.0, 1.0, 7.0, 6.0]]), 3).item() == 1
    assert topk_concentration(torch.tensor([4.0, 1.0, 3.0, 2.0]), 2).item() == pytest.approx(0.7)
    assert share_at(torch.tensor([4.0, 1.0, 3.0, 2.0]), torch.tensor([1, 3])).item() == pytest.approx(0.3)
    g = gaussian_chi(3, 2, 16, [40, 50, 60], torch.Generator().manual_seed(0))
    assert g.shape == (3, 2, 16)
    # isotropic: E|q||k| / sqrt(d) = (2 / pi) / 4 for every dimension
    assert g.mean().item() == pytest.approx(2 / torch.pi / 4, rel=0.05)


def test_budget_grouping_records_app_b_beside_it(tiny, tmp_path):
    ids = torch.randint(0, 64, (6, 20), generator=torch.Generator().manual_seed(3))
    summary = analyze(tiny, None, ids, [0, 1], tmp_path, n_bootstrap=30, budget=3, figures=False)
    data = json.loads((tmp_path / "groups.json").read_text())
    assert data["procedure"] == summary["procedure"] == "budget:3"
    app_b = stable_gap_groups(torch.stack([head_contributions(c.q, c.k).double().transpose(0, 1) for c in _cap(
        tiny, ids, [0, 1])]), n_bootstrap=30)
    for li, layer in enumerate(("0", "1")):
        for h in data["heads"][layer]:
            chi = torch.tensor(h["chi"], dtype=torch.float64)
            assert h["groups"] == fixed_budget_groups(chi, 3).tolist() and h["n_groups"] == 3
            assert len(h["cuts"]) == 2 and h["fallback_cuts"] == []
            sorted_ids = [h["groups"][r] for r in h["order"]]
            assert [k for k in range(1, 8) if sorted_ids[k] != sorted_ids[k - 1]] == h["cuts"]
            assert h["app_b"]["groups"] == app_b.groups[li, h["head"]].tolist()  # App. B kept as evidence
        assert torch.equal(load_groups(tmp_path)[int(layer)], torch.tensor([h["groups"] for h in data["heads"][layer]]))
    assert summary["n_groups"]["histogram"] == {"3": 8} and "app_b_histogram" in summary["n_groups"]
    assert set(summary["regime"]["layers"]) == {"0", "1"} and summary["regime"]["verdict"]["text"]
    with pytest.raises(ValueError, match="budget"):
        analyze(tiny, None, ids, [0], tmp_path, n_bootstrap=30, budget=0)


@pytest.mark.parametrize("progress", [True, False])
def test_no_progress_draws_no_capture_bars(tiny, tmp_path, progress):
    """`oal run --no-progress` still drew the analysis' three capture bars (Progress without disable=)."""
    import io

    from rich.console import Console

    out = io.StringIO()
    ids = torch.randint(0, 64, (4, 20), generator=torch.Generator().manual_seed(5))
    analyze(tiny, None, ids, [0], tmp_path, n_bootstrap=10, figures=False, progress=progress,
            console=Console(file=out, force_terminal=True, width=120), results=Console(quiet=True))
    assert ("capture: calibration prompts" in out.getvalue()) is progress


def _cap(model, ids, layers):
    got = []
    with torch.no_grad():
        capture(model, ids, layers, got.append)
    return sorted(got, key=lambda c: c.layer)


def test_parse_grouping():
    assert parse_grouping("app-b") == {} and parse_grouping("budget:4") == {"budget": 4}
    for bad in ("budget:0", "budget:x", "gaps", "budget"):
        with pytest.raises(ValueError, match="grouping"):
            parse_grouping(bad)


def test_bad_input(tiny, tmp_path):
    with pytest.raises(ValueError, match="prompts"):
        analyze(tiny, None, torch.zeros(0, 5, dtype=torch.long), [0], tmp_path)
    with pytest.raises(ValueError, match="tokenizer"):
        analyze(tiny, None, ["abc"], [0], tmp_path)
    with pytest.raises(ValueError, match="layer"):
        analyze(tiny, None, torch.zeros(2, 5, dtype=torch.long), [7], tmp_path)
    with pytest.raises(ValueError, match="representative"):
        analyze(tiny, None, torch.zeros(2, 5, dtype=torch.long), [0], tmp_path, representative=(1, 0))
    with pytest.raises(ValueError, match="missing: is missing"):
        load_groups(tmp_path / "missing")
    (tmp_path / "folder" / "groups.json").mkdir(parents=True)  # it said "no groups.json at" a path that exists
    with pytest.raises(ValueError, match="groups.json: is a directory, not the groups file"):
        load_groups(tmp_path / "folder")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny byte-level Llama saved in HF format (what `oal analyze --model PATH` loads)."""
    return save_tiny_llama(tmp_path_factory.mktemp("tiny_model"))


def test_cli_end_to_end(tiny_dir, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from oal.cli import load_commands

    app = load_commands()

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out = tmp_path / "run"
    args = ["analyze", "--model", str(tiny_dir), "--out", str(out), "--layers", "0,2", "--n-bootstrap", "30",
            "--heldout", "6", "--no-figures", "--head", "2:3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    groups = load_groups(out)
    assert sorted(groups) == [0, 2] and groups[0].shape == (4, 8)
    data = json.loads((out / "groups.json").read_text())
    assert data["n_prompts"] == 40 and data["prompt_lengths"] == [128] * 40  # default plan: 40 x 128 tokens
    assert data["grouping"]["n_bootstrap"] == 30 and data["grouping"]["tail_fraction"] == 0.25
    analysis = json.loads((out / "analysis.json").read_text())
    assert analysis["stability_inputs"]["n_heldout"] == 6
    assert analysis["stability_lengths"]["lengths"][-1] == 512  # the default plan's fidelity block length
    assert "top-5 share" in result.output
    bad = CliRunner().invoke(app, ["analyze", "--model", str(tiny_dir), "--out", str(out), "--layers", "5"])
    assert bad.exit_code != 0 and "--layers" in bad.output
    bad = CliRunner().invoke(app, ["analyze", "--model", str(tiny_dir), "--out", str(out), "--grouping", "gaps"])
    assert bad.exit_code == 2 and "--grouping" in bad.output


@pytest.mark.parametrize("damage", ["negative", "fraction", "head twice", "head missing", "not a list"])
def test_load_groups_refuses_group_ids_it_cannot_use_naming_the_file(tmp_path, damage):
    """Eq. 19's groups are ids 0..G-1 per dimension, one row per query head 0..Hq-1. A negative or fractional id (it
    was truncated to an integer silently), a head twice or missing is a damaged groups.json, named as such, rather
    than a one_hot crash in calibration or a groups tensor of the wrong shape."""
    heads = [{"head": 0, "groups": [0, 0, 1, 1]}, {"head": 1, "groups": [0, 1, 0, 2]}]
    if damage == "negative":
        heads[1]["groups"][0] = -1
    elif damage == "fraction":
        heads[1]["groups"][3] = 1.5
    elif damage == "head twice":
        heads[1]["head"] = 0
    elif damage == "head missing":
        heads[1]["head"] = 2
    else:
        heads[0]["groups"] = 3
    path = tmp_path / "groups.json"
    path.write_text(json.dumps({"format": "oal.groups/1", "heads": {"0": heads}}))
    with pytest.raises(ValueError, match="groups.json: damaged groups record"):
        load_groups(tmp_path)


def test_gaussian_control_of_an_encoder_takes_every_pair(tmp_path):
    """Fig. 5's isotropic control keeps everything but the q/k distribution: for an encoder, whose chi (Eq. 2) runs
    over every pair of real tokens, the control's chi does too, not over causal pairs only."""
    from _tiny_encoders import tiny_encoder

    model = tiny_encoder("bert")
    ids = torch.randint(5, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    summary = analyze(model, None, ids, [1], tmp_path, n_bootstrap=10, figures=False, progress=False, seed=4)

    def control(causal):
        gen = torch.Generator().manual_seed(4)
        chi = torch.stack([head_contributions(torch.randn(1, 4, 12, 8, generator=gen, dtype=torch.float64),
                                              torch.randn(1, 4, 12, 8, generator=gen, dtype=torch.float64),
                                              causal=causal)[0] for _ in range(3)])  # [P, H, d]
        return topk_concentration(chi.mean(0), 5)

    got = torch.tensor(summary["concentration"]["gaussian_top5"][0], dtype=torch.float64)
    torch.testing.assert_close(got, control(False))
    assert not torch.allclose(got, control(True))


def test_pair_tied_grouping_settings_are_checked_before_the_capture(tiny, tmp_path, monkeypatch):
    """`pairs=True` groups the d/2 RoPE pairs with App. B, whose G_min must fit d/2's candidate cuts: d = 8, alpha
    0.25 leaves d/2 = 4 one candidate cut, so G_min = 3 is refused up front (as for d), not after the capture."""
    import oal.analysis.runner as runner

    def no_capture(*args, **kwargs):
        raise AssertionError("captured before refusing the settings")

    monkeypatch.setattr(runner, "_run_capture", no_capture)
    ids = torch.randint(0, 64, (4, 20), generator=torch.Generator().manual_seed(5))
    with pytest.raises(ValueError, match=r"min_groups: expected at most 2 for the d/2 = 4 RoPE pairs"):
        analyze(tiny, None, ids, [0], tmp_path, n_bootstrap=10, figures=False, pairs=True, min_groups=3)


def test_a_dead_head_leaves_analysis_json_strict_and_its_means_defined(tiny, tmp_path):
    """A head whose queries are all zero has chi = 0 (Eq. 2): its top-5 share and Spearman are undefined. They were
    NaN, which made every layer mean NaN and wrote bare NaN into analysis.json (strict JSON parsers reject it)."""
    import copy

    model = copy.deepcopy(tiny)
    attn = model.model.layers[0].self_attn
    d = attn.head_dim
    with torch.no_grad():  # query head 0 of layer 0 reads nothing
        attn.q_proj.weight[:d].zero_()
        attn.q_proj.bias[:d].zero_()
    gen = torch.Generator().manual_seed(3)
    ids, held = torch.randint(0, 64, (4, 20), generator=gen), torch.randint(0, 64, (3, 20), generator=gen)
    summary = analyze(model, None, ids, [0], tmp_path, heldout=held, n_bootstrap=10)  # with its figures

    def refuse(name):
        raise ValueError(f"bare {name} in analysis.json")

    data = json.loads((tmp_path / "analysis.json").read_text(), parse_constant=refuse)
    conc, stab = data["concentration"], data["stability_inputs"]
    assert conc["real_top5"][0][0] is None and conc["real_top5"][0][1] is not None
    assert conc["mean"]["real_top5"] == pytest.approx(sum(conc["real_top5"][0][1:]) / 3)
    assert stab["spearman"][0][0] is None and stab["mean_spearman"] is not None and stab["min_spearman"] is not None
    assert summary["concentration"]["mean"] == conc["mean"]
    # the report's readers of the file take the nulls
    from oal.analysis.offset import offset_markdown
    from oal.pipeline.report_sections import stability_section

    assert any("%" in line for line in offset_markdown(data["offset"], conc))
    assert "Spearman rho" in stability_section(data)[0]
