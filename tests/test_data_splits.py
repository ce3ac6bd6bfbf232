"""The data protocol: roles never overlap; plans serialise; blocks are the right slices of the token stream."""

from __future__ import annotations

import json

import pytest

from oal.data import ROLES, BlockSet, SplitPlan, default_plan, load_corpus, plan_blocks, token_blocks
from oal.data.byte_tokenizer import byte_tokenizer
from oal.data.splits import PLAN_PRESETS


def _plan(**over):
    roles = dict(
        grouping=BlockSet("train", 128, list(range(0, 4))),
        calib_train=BlockSet("train", 256, [2, 3]),
        calib_val=BlockSet("train", 256, [4]),
        fidelity=BlockSet("train", 256, [5, 6]),
        adapt_train=BlockSet("train", 256, [7], through_end=True),
        val=BlockSet("validation", 256, [0, 1]),
        test=BlockSet("test", 256, [0], through_end=True),
    )
    roles.update(over)
    return SplitPlan(**roles)


@pytest.mark.parametrize("preset", sorted(PLAN_PRESETS))
def test_every_preset_is_disjoint_and_serialisable(preset):
    plan = default_plan(preset)
    plan.check_disjoint()
    d = json.loads(json.dumps(plan.to_dict()))
    assert set(ROLES) <= set(d)
    assert SplitPlan.from_dict(d) == plan


def test_paper_preset_follows_appendix_b():
    plan = default_plan("qwen2.5-0.5b")
    assert plan.fidelity.indices == list(range(16)) and plan.fidelity.block_len == 4096
    assert plan.calib_train.indices == list(range(16, 24)) and plan.calib_val.indices == [24, 25]
    assert len(plan.grouping.indices) == 40 and plan.val.corpus == "wikitext-103-raw-v1"
    assert len(plan.adapt_train.indices) == 512 and plan.test.through_end


def test_overlap_across_block_lengths_names_roles():
    # grouping 128-token blocks 0-3 cover tokens [0, 512): calib block 1 ([256, 512)) overlaps it.
    with pytest.raises(ValueError, match="'grouping' and 'calib_train'"):
        _plan(calib_train=BlockSet("train", 256, [1]))


def test_overlap_with_open_ended_role():
    with pytest.raises(ValueError, match="'fidelity' and 'adapt_train'"):
        _plan(adapt_train=BlockSet("train", 256, [6], through_end=True))
    with pytest.raises(ValueError, match="'val' and 'test'"):
        _plan(test=BlockSet("validation", 256, [1]))


def test_same_indices_on_other_split_or_corpus_are_fine():
    _plan(val=BlockSet("validation", 256, [0]), test=BlockSet("test", 256, [0]))
    _plan(calib_val=BlockSet("train", 256, [2], corpus="other"))


def test_blockset_validation_and_resolve():
    with pytest.raises(ValueError, match="split"):
        BlockSet("dev", 256, [0])
    with pytest.raises(ValueError, match="indices"):
        BlockSet("train", 256, [1, 1])
    with pytest.raises(ValueError, match="block_len"):
        BlockSet("train", 0, [0])
    assert BlockSet("train", 4, [2], through_end=True).resolve(5) == [2, 3, 4]
    with pytest.raises(ValueError, match="only 3 blocks"):
        BlockSet("train", 4, [3]).resolve(3)
    with pytest.raises(ValueError, match="preset"):
        default_plan("gpt-5")


def test_plan_blocks_default_plan_on_builtin():
    tok = byte_tokenizer()
    corpus = load_corpus("builtin")
    plan = default_plan()
    blocks = plan_blocks(corpus, tok, plan)
    assert blocks["grouping"].shape == (40, 128)
    assert blocks["calib_train"].shape == (8, 256) and blocks["calib_val"].shape == (2, 256)
    assert blocks["fidelity"].shape == (8, 256) and blocks["val"].shape == (8, 256)
    assert blocks["test"].shape == (32, 256) and blocks["adapt_train"].shape[0] > 100
    train = token_blocks(tok, corpus.splits["train"], 256)
    assert (blocks["calib_train"] == train[20:28]).all()
    assert (blocks["adapt_train"] == train[38:]).all()
    assert (blocks["grouping"].reshape(-1) == train[:20].reshape(-1)).all()
    test = token_blocks(tok, corpus.splits["test"], 256)
    assert (blocks["test"] == test[:32]).all()
