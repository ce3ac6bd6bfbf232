"""Passages for encoders: paragraphs of a corpus split, tokenised one by one with the model's special tokens.

Encoders (BERT family) read sentences and passages, each wrapped in its own [CLS] ... [SEP] (<s> ... </s>) and
right-padded to the longest of its batch, rather than a token stream cut into blocks. So the encoder protocol
names, per role, a contiguous range of the paragraphs of one split (a `PassageSet`); roles on the same split must
not overlap, as in `SplitPlan` for decoders.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

import torch

from oal.data.corpus import SPLITS, Corpus
from oal.errors import from_known_keys

__all__ = ["PASSAGE_ROLES", "PassagePlan", "PassageSet", "default_passage_plan", "paragraphs", "plan_passages",
           "tokenize_passages"]

# grouping: contribution scores (App. B); calib_*: output matching (Eq. 20); heldout: fidelity and embeddings
PASSAGE_ROLES = ("grouping", "calib_train", "calib_val", "heldout")


@dataclass
class PassageSet:
    """Paragraphs `start .. start + count - 1` of `split`."""

    split: str
    start: int
    count: int

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {self.split!r}")
        if not isinstance(self.start, int) or not isinstance(self.count, int) or self.start < 0 or self.count < 1:
            raise ValueError(f"start/count: expected start >= 0 and count >= 1, got {self.start!r}, {self.count!r}")


@dataclass
class PassagePlan:
    """One PassageSet per role; `max_len` truncates each tokenised passage; paragraphs shorter than `min_words`
    words are skipped (headings, code fragments)."""

    grouping: PassageSet
    calib_train: PassageSet
    calib_val: PassageSet
    heldout: PassageSet
    max_len: int = 128
    min_words: int = 8

    def __post_init__(self) -> None:
        if not isinstance(self.max_len, int) or self.max_len < 4:
            raise ValueError(f"max_len: expected an int >= 4, got {self.max_len!r}")
        if not isinstance(self.min_words, int) or self.min_words < 1:
            raise ValueError(f"min_words: expected a positive int, got {self.min_words!r}")
        roles = list(self.roles().items())
        for a, (ra, sa) in enumerate(roles):
            for rb, sb in roles[a + 1 :]:
                if sa.split == sb.split and sa.start < sb.start + sb.count and sb.start < sa.start + sa.count:
                    raise ValueError(f"plan: roles {ra!r} and {rb!r} overlap on split {sa.split!r}")

    def roles(self) -> dict[str, PassageSet]:
        return {r: getattr(self, r) for r in PASSAGE_ROLES}

    def to_dict(self) -> dict:
        return {**{r: asdict(p) for r, p in self.roles().items()}, "max_len": self.max_len,
                "min_words": self.min_words}

    @classmethod
    def from_dict(cls, d: Mapping) -> PassagePlan:
        if not all(r in d for r in PASSAGE_ROLES):
            raise ValueError(f"plan: expected the passage roles {list(PASSAGE_ROLES)}, got {sorted(d)}")
        return from_known_keys(cls, {**d, **{r: from_known_keys(PassageSet, d[r], r) for r in PASSAGE_ROLES}},
                               "plan")


def default_passage_plan() -> PassagePlan:
    """40 grouping passages (as the paper's 40 prompts), 32 + 8 for calibration, 32 held out; up to 128 tokens."""
    return PassagePlan(grouping=PassageSet("train", 0, 40), calib_train=PassageSet("train", 40, 32),
                       calib_val=PassageSet("train", 72, 8), heldout=PassageSet("test", 0, 32))


def paragraphs(text: str, min_words: int = 8) -> list[str]:
    """The blank-line separated paragraphs of `text` with at least `min_words` words, whitespace collapsed."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        para = " ".join(block.split())
        if len(para.split(" ")) >= min_words:
            out.append(para)
    return out


def plan_passages(corpus: Corpus, plan: PassagePlan) -> dict[str, list[str]]:
    """role -> list of passage strings of `corpus` under `plan` (ValueError when a split has too few)."""
    cache: dict[str, list[str]] = {}
    out = {}
    for role, ps in plan.roles().items():
        if ps.split not in cache:
            cache[ps.split] = paragraphs(corpus.splits[ps.split], plan.min_words)
        paras = cache[ps.split]
        if ps.start + ps.count > len(paras):
            raise ValueError(f"plan: role {role!r} needs paragraphs {ps.start}..{ps.start + ps.count - 1} of split "
                             f"{ps.split!r}, but {corpus.name} has only {len(paras)} of >= {plan.min_words} words")
        out[role] = paras[ps.start : ps.start + ps.count]
    return out


def tokenize_passages(tokenizer, texts: Sequence[str], max_len: int) -> dict[str, torch.Tensor]:
    """{"input_ids", "attention_mask"} [P, L]: each passage with its special tokens, truncated to `max_len` (or the
    tokenizer's `model_max_length` when shorter), right-padded to the longest."""
    if not texts:
        raise ValueError("texts: expected at least one passage")
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer: an encoder tokenizer needs a padding token")
    max_len = min(max_len, getattr(tokenizer, "model_max_length", max_len) or max_len)
    enc = tokenizer(list(texts), padding="longest", truncation=True, max_length=max_len, padding_side="right",
                    return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
