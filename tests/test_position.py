"""Position dependence (issue 37): RoPE rotates dims r and r + d/2 together, so a group sum over whole pairs depends
on the distance between query and key only, as softmax's logit does. A converted layer whose groups split a pair
sees absolute positions: shifting every position id moves its outputs. `pair_tied_groups` keeps each pair in one
group, and the shift then moves the converted model by rounding alone, like the base model."""

import copy
import json

import pytest
import torch
from _tiny import tiny_model
from test_pipeline import _cfg, assets  # noqa: F401  (the tiny model + corpus fixture)

from oal.analysis.grouping import pair_tied_groups, stable_gap_groups
from oal.evaluate.position import shift_error
from oal.methods import build_method
from oal.models.convert import convert


def test_pair_tied_groups_keep_every_rope_pair_together():
    gen = torch.Generator().manual_seed(0)
    chi = torch.rand(3, 20, 16, generator=gen, dtype=torch.float64) * torch.logspace(0, 2, 16, dtype=torch.float64)
    g = pair_tied_groups(chi, n_bootstrap=50, min_groups=2)
    assert g.shape == (3, 16) and torch.equal(g[:, :8], g[:, 8:])
    assert (g.amax(-1) >= 1).all()  # at least G_min = 2 groups
    pairs = chi[..., :8] + chi[..., 8:]
    assert torch.equal(g[:, :8], stable_gap_groups(pairs, n_bootstrap=50, min_groups=2).groups)
    with pytest.raises(ValueError, match="even head dim"):
        pair_tied_groups(chi[..., :15])


def _converted(model, groups_of_head):
    model = copy.deepcopy(model).double()
    cfg = model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    gen = torch.Generator().manual_seed(1)
    methods = {}
    for layer in (1, 2):
        groups = torch.stack([groups_of_head(h, d) for h in range(cfg.num_attention_heads)])
        m = build_method("oal", cfg.num_attention_heads, cfg.num_key_value_heads, d, layer_idx=layer, groups=groups)
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        methods[layer] = m.double()
    return convert(model, list(methods), methods)


def test_pair_tied_groups_make_outputs_depend_on_relative_positions_only():
    base = tiny_model("llama", 97)  # head_dim 8: pairs (0, 4), (1, 5), (2, 6), (3, 7)
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(2))
    split = _converted(base, lambda h, d: torch.tensor([0, 1, 1, 0, 1, 0, 0, 1]))  # every pair split
    tied = _converted(base, lambda h, d: torch.tensor([0, 1, 1, 0, 0, 1, 1, 0]))  # r and r + 4 together
    soft = shift_error(copy.deepcopy(base).double(), ids)  # rounding: HF computes RoPE's angles in float32
    assert soft < 1e-8 and shift_error(tied, ids) < 1e-7  # the same float32 angles, through the kernel's squares
    assert shift_error(split, ids) > 1e3 * shift_error(tied, ids)  # measured: 2.5e-4 against 8.2e-9


def test_run_with_pair_tied_groups_records_them(assets, tmp_path):  # noqa: F811
    """`oal run --grouping app-b-pairs`: groups.json's groups keep every RoPE pair together; App. B's stay beside."""
    from oal.analysis import parse_grouping
    from oal.pipeline.runs import run_seed

    grouping = {"n_bootstrap": 50, **parse_grouping("app-b-pairs")}
    cfg = _cfg(assets, methods=["oal"], adapt={"steps": 2, "val_every": 2})
    cfg.grouping = {**cfg.grouping, **grouping}
    run_seed(cfg, tmp_path, progress=False, stop_after="analyze")
    data = json.loads((tmp_path / "groups.json").read_text())
    assert data["procedure"] == "app_b_pairs"
    for rows in data["heads"].values():
        for h in rows:
            g, half = h["groups"], len(h["groups"]) // 2
            assert g[:half] == g[half:] and "app_b" in h


def test_the_card_says_whether_the_groups_keep_rope_pairs(tmp_path):
    from oal.artefact.card import card_text

    base = tiny_model("llama", 97)
    split = card_text(_converted(base, lambda h, d: torch.tensor([0, 1, 1, 0, 1, 0, 0, 1])).float(), {})
    tied = card_text(_converted(base, lambda h, d: torch.tensor([0, 1, 1, 0, 0, 1, 1, 0])).float(), {})
    assert "Outputs depend on absolute positions" in split and "position_ids" in split
    assert "depend on the distance between query and key only" in tied
