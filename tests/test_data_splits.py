"""The data protocol: roles never overlap; plans serialise; blocks are the right slices of the token stream."""

from __future__ import annotations

import json
import math

import pytest

from oal.data import (
    ROLES,
    BlockSet,
    Corpus,
    SplitPlan,
    bind_pretraining,
    default_plan,
    encode,
    load_corpus,
    plan_blocks,
    token_blocks,
)
from oal.data.byte_tokenizer import byte_tokenizer
from oal.data.splits import DEFAULT_PRETRAIN_START_BLOCK, PLAN_PRESETS, PRETRAIN, encode_prefix


def _plan(**over):
    pretrain = over.pop("pretrain", None)
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
    return SplitPlan(**roles, pretrain=pretrain)


@pytest.mark.parametrize("preset", sorted(PLAN_PRESETS))
def test_every_preset_is_disjoint_and_serialisable(preset):
    plan = default_plan(preset)
    plan.check_disjoint()
    d = json.loads(json.dumps(plan.to_dict()))
    assert set(ROLES) <= set(d)
    assert SplitPlan.from_dict(d) == plan


def test_paper_preset_follows_appendix_b():
    plan = default_plan("qwen2.5-0.5b")
    wt2, wt103 = "wikitext-2-raw-v1", "wikitext-103-raw-v1"
    expected = {  # role: (corpus, split, block length, blocks, through the end)
        "grouping": (wt2, "train", 128, list(range(832, 872)), False),  # 40 x 128 tokens right after block 25
        "calib_train": (wt2, "train", 4096, list(range(16, 24)), False),
        "calib_val": (wt2, "train", 4096, [24, 25], False),
        "fidelity": (wt2, "train", 4096, list(range(16)), False),
        "adapt_train": (wt103, "train", 4096, list(range(512)), False),  # App. F.2: 512 updates of 4096 tokens
        "val": (wt103, "validation", 4096, list(range(32)), False),
        "test": (wt103, "test", 4096, [0], True),  # App. F.3: every complete block
    }
    got = {role: (bs.corpus, bs.split, bs.block_len, list(bs.indices), bs.through_end)
           for role, bs in plan.roles().items()}
    assert got == expected and plan.pretrain is None


def test_token_ranges_merge_adjacent_blocks_only():
    assert BlockSet("train", 10, [5, 0, 1, 2]).token_ranges() == [(0, 30), (50, 60)]
    assert BlockSet("train", 10, [0, 2, 3], through_end=True).token_ranges() == [(0, 10), (20, math.inf)]
    # a merged range keeps its first block: a role reading only that block overlaps it
    with pytest.raises(ValueError, match="'grouping' and 'calib_train'"):
        _plan(calib_train=BlockSet("train", 128, [0, 1]), grouping=BlockSet("train", 128, [0]))


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
    assert blocks["calib_train"].shape == (8, 512) and blocks["calib_val"].shape == (2, 512)
    assert blocks["fidelity"].shape == (8, 512) and blocks["val"].shape == (8, 512)
    assert blocks["test"].shape == (32, 512) and blocks["adapt_train"].shape == (256, 256)
    assert PRETRAIN not in blocks  # the pretraining range is checked, never materialised
    train = token_blocks(tok, corpus.splits["train"], 512)
    assert (blocks["calib_train"] == train[10:18]).all()
    assert (blocks["adapt_train"].reshape(-1) == train[28:156].reshape(-1)).all()
    assert (blocks["grouping"].reshape(-1) == train[:10].reshape(-1)).all()
    test = token_blocks(tok, corpus.splits["test"], 512)
    assert (blocks["test"] == test[:32]).all()


def test_default_plan_keeps_every_role_off_the_pretraining_text():
    plan = default_plan()
    assert plan.pretrain == BlockSet("train", 512, [DEFAULT_PRETRAIN_START_BLOCK], through_end=True)
    last = max(hi for bs in plan.roles().values() if bs.split == "train" for _, hi in bs.token_ranges())
    assert last <= plan.pretrain.token_ranges()[0][0]
    with pytest.raises(ValueError, match="'adapt_train' and 'pretrain'"):
        _plan(adapt_train=BlockSet("train", 256, [7], through_end=True), pretrain=BlockSet("train", 512, [100],
                                                                                           through_end=True))
    with pytest.raises(ValueError, match="'grouping' and 'pretrain'"):
        SplitPlan(**{**plan.roles(), "grouping": BlockSet("train", 128, [4 * DEFAULT_PRETRAIN_START_BLOCK + 1])},
                  pretrain=plan.pretrain)


def test_bind_pretraining_uses_the_models_record(tmp_path):
    rec = {"split": "train", "block_len": 64, "first_block": 40, "through_end": True}  # from token 2560
    (tmp_path / "training_summary.json").write_text(json.dumps({"pretrain": rec}))
    prov = {"source": "package", "path": str(tmp_path)}
    builtin = Corpus("builtin", {"train": "a", "validation": "b", "test": "c"})
    bound = bind_pretraining(_plan(adapt_train=BlockSet("train", 256, [7])), prov, builtin)
    assert bound.pretrain == BlockSet("train", 64, [40], through_end=True)
    with pytest.raises(ValueError, match="'adapt_train' and 'pretrain'"):  # 256-blocks 7.. to the end
        bind_pretraining(_plan(), prov, builtin)
    other = Corpus("mine", {"train": "a", "validation": "b", "test": "c"})
    assert bind_pretraining(_plan(), prov, other).pretrain is None  # another corpus: nothing to bind
    assert bind_pretraining(_plan(), {"source": "local", "path": str(tmp_path)}, builtin).pretrain is None
    # a plan that names its own pretraining range must name the model's
    assert bind_pretraining(bound, prov, builtin) == bound
    other_range = SplitPlan(**bound.roles(), pretrain=BlockSet("train", 64, [41], through_end=True))
    with pytest.raises(ValueError, match="differs from the one the embedded model was trained on"):
        bind_pretraining(other_range, prov, builtin)


def test_encode_prefix_matches_full_encoding():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = "\n\n".join(f"Paragraph {i}: the value (x{i}).\n  indented, code = f({i}) # note" for i in range(400))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe)
    full = encode(tok, text)
    for n in (10, 500, 2000, *range(2100, len(full), 53)):  # dense: some n fall just short of a prefix's length
        got = encode_prefix(tok, text, n)
        assert len(got) >= n and got == full[: len(got)]
    assert encode_prefix(tok, text, math.inf) == full
    assert encode_prefix(tok, text, 10 * len(full)) == full  # more than there is: the whole text


@pytest.mark.parametrize("letters, lengths", [(7, range(600, 2400, 13)), (6, range(500, 700, 3))])
def test_encode_prefix_grows_its_prefix_when_tokens_are_long(letters, lengths):
    """Long tokens (words of 7 or 6 letters: about 8.6 or 7.2 characters a token), so the first prefix encode_prefix
    tries (8 characters per token asked, 4096 at least) falls short of n + PREFIX_MARGIN tokens, or within the
    margin of n, and it must grow it. Dense in n: some land within PREFIX_MARGIN of a prefix's length."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(letters)) for _ in range(50)]
    text = "\n\n".join(" ".join(rng.choice(words) for _ in range(6)) for _ in range(800))
    wl = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    wl.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wl.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[UNK]"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=wl)
    full = encode(tok, text)
    for n in lengths:
        got = encode_prefix(tok, text, n)
        assert len(got) >= n and got == full[: len(got)] and len(got) < len(full)
