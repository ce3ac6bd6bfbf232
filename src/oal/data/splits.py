"""The data protocol: which token blocks serve which role, kept disjoint (paper App. B, F.2, F.3).

A `BlockSet` names blocks of one split of one corpus: block `i` covers tokens `[i * block_len, (i+1) * block_len)`
of that split's token stream. Roles with different block lengths are compared on these token ranges, so
`check_disjoint` catches a 128-token grouping prompt that overlaps a 256-token calibration block.

A plan may also name the text its model was pretrained on (`pretrain`, the embedded default's only): it is never
materialised as blocks, but `check_disjoint` keeps every role off it, so nothing the pipeline groups, calibrates,
evaluates or adapts on was seen in pretraining.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

from oal.data.blocks import encode
from oal.data.corpus import SPLITS, Corpus

ROLES = ("grouping", "calib_train", "calib_val", "fidelity", "adapt_train", "val", "test")
PRETRAIN = "pretrain"


@dataclass
class BlockSet:
    """Blocks `indices` of `split`, each `block_len` tokens long.

    `corpus` names the corpus when it is not the run's own (`None`). `through_end=True` adds every block after the
    last listed index up to the end of the split (for "all test blocks" or "the rest of train").
    """

    split: str
    block_len: int
    indices: list[int]
    corpus: str | None = None
    through_end: bool = False

    def __post_init__(self) -> None:
        if self.split not in SPLITS:
            raise ValueError(f"split: expected one of {SPLITS}, got {self.split!r}")
        if not isinstance(self.block_len, int) or self.block_len < 2:
            raise ValueError(f"block_len: expected an int >= 2, got {self.block_len!r}")
        self.indices = [int(i) for i in self.indices]
        if any(i < 0 for i in self.indices) or len(set(self.indices)) != len(self.indices):
            raise ValueError(f"indices: expected distinct non-negative block indices, got {self.indices}")
        if self.through_end and not self.indices:
            raise ValueError("indices: through_end=True needs at least the first index")

    def resolve(self, n_blocks: int) -> list[int]:
        """The concrete block indices, given that the split has `n_blocks` blocks of this length."""
        idx = list(self.indices)
        if self.through_end:
            idx += list(range(max(idx) + 1, n_blocks))
        bad = [i for i in idx if i >= n_blocks]
        if bad:
            raise ValueError(f"indices: blocks {bad[:5]} requested but split {self.split!r} of corpus "
                             f"{self.corpus or '(run corpus)'} has only {n_blocks} blocks of {self.block_len} tokens "
                             f"(it needs at least {(max(bad) + 1) * self.block_len} tokens)")
        return idx

    def token_ranges(self) -> list[tuple[int, float]]:
        """Half-open token ranges covered, merged; the last one is open-ended with through_end."""
        starts = sorted(self.indices)
        out: list[tuple[int, float]] = []
        for i in starts:
            lo, hi = i * self.block_len, (i + 1) * self.block_len
            if out and out[-1][1] == lo:
                out[-1] = (out[-1][0], hi)
            else:
                out.append((lo, hi))
        if self.through_end:
            out[-1] = (out[-1][0], float("inf"))
        return out


@dataclass
class SplitPlan:
    """One BlockSet per role. All roles on the same corpus split must cover disjoint token ranges, and none may
    touch `pretrain` (the model's pretraining text, when the plan knows it)."""

    grouping: BlockSet
    calib_train: BlockSet
    calib_val: BlockSet
    fidelity: BlockSet
    adapt_train: BlockSet
    val: BlockSet
    test: BlockSet
    notes: str = field(default="", compare=False)
    pretrain: BlockSet | None = None

    def __post_init__(self) -> None:
        self.check_disjoint()

    def roles(self) -> dict[str, BlockSet]:
        return {r: getattr(self, r) for r in ROLES}

    def to_dict(self) -> dict:
        d = {r: asdict(b) for r, b in self.roles().items()}
        d["notes"] = self.notes
        if self.pretrain is not None:
            d[PRETRAIN] = asdict(self.pretrain)
        return d

    @classmethod
    def from_dict(cls, d: Mapping) -> SplitPlan:
        missing = [r for r in ROLES if r not in d]
        if missing:
            raise ValueError(f"plan: missing roles {missing}")
        names = {f.name for f in fields(BlockSet)}

        def block_set(x: Mapping) -> BlockSet:
            return BlockSet(**{k: v for k, v in x.items() if k in names})

        return cls(**{r: block_set(d[r]) for r in ROLES}, notes=d.get("notes", ""),
                   pretrain=block_set(d[PRETRAIN]) if d.get(PRETRAIN) else None)

    def check_disjoint(self) -> None:
        """ValueError naming the first pair of roles (or a role and `pretrain`) whose token ranges overlap on the
        same corpus split."""
        roles = list(self.roles().items())
        if self.pretrain is not None:
            roles.append((PRETRAIN, self.pretrain))
        for a in range(len(roles)):
            for b in range(a + 1, len(roles)):
                (ra, sa), (rb, sb) = roles[a], roles[b]
                if (sa.corpus, sa.split) != (sb.corpus, sb.split):
                    continue
                for lo1, hi1 in sa.token_ranges():
                    for lo2, hi2 in sb.token_ranges():
                        if lo1 < hi2 and lo2 < hi1:
                            raise ValueError(
                                f"plan: roles {ra!r} and {rb!r} overlap on split {sa.split!r} "
                                f"(tokens {max(lo1, lo2)}..{min(hi1, hi2)})")


def _blocks(first: int, count: int) -> list[int]:
    return list(range(first, first + count))


# The embedded model's pretraining text: the builtin train split from this token on (its tokenizer), i.e. the part
# after the held-out prose head (oal.data.corpus.builtin_layout; the head is 161,779 tokens on Python 3.11.7).
# scripts/train_embedded_model.py trains on exactly this range and records it in training_summary.json.
DEFAULT_PRETRAIN_START_BLOCK = 316  # x 512 tokens = token 161,792


def _default() -> SplitPlan:
    # Embedded model + builtin corpus, sized so a full `oal run` stays under 6 min on a 2-core CPU. Everything
    # lies in the held-out head of the train split (tokens [0, 161792)), never in the pretraining text:
    #   grouping 40 x 128 tokens = [0, 5120) = 512-blocks 0-9; calib_train 512-blocks 10-17; calib_val 18-19;
    #   fidelity 20-27 (tokens up to 14336); adapt_train 256-blocks 56-311 (256 updates of 256 tokens: the
    #   adaptation dominates oal run's time, three arms of forward + backward through the converted layers).
    return SplitPlan(
        grouping=BlockSet("train", 128, _blocks(0, 40)),
        calib_train=BlockSet("train", 512, _blocks(10, 8)),
        calib_val=BlockSet("train", 512, _blocks(18, 2)),
        fidelity=BlockSet("train", 512, _blocks(20, 8)),
        adapt_train=BlockSet("train", 256, _blocks(56, 256)),
        val=BlockSet("validation", 512, _blocks(0, 8)),
        test=BlockSet("test", 512, _blocks(0, 32)),
        notes="embedded default: builtin corpus, held-out prose head of train; reduced sizes for CPU",
        pretrain=BlockSet("train", 512, [DEFAULT_PRETRAIN_START_BLOCK], through_end=True),
    )


def _paper() -> SplitPlan:
    # App. B: WikiText-2 train in 4096-token blocks: 0-15 fidelity, 16-23 calibration train, 24-25 calibration
    # validation. The paper's 40 short grouping prompts are not published; we take 40 x 128 tokens right after
    # block 25 (tokens 106496..111616), disjoint from all of the above.
    # App. F.2: adaptation on WikiText-103 train, 512 updates of 4096 tokens; 32 WikiText-103 validation blocks.
    # App. F.3: WikiText-103 test, every complete 4096-token block.
    wt2, wt103 = "wikitext-2-raw-v1", "wikitext-103-raw-v1"
    return SplitPlan(
        grouping=BlockSet("train", 128, _blocks(26 * 4096 // 128, 40), corpus=wt2),
        calib_train=BlockSet("train", 4096, _blocks(16, 8), corpus=wt2),
        calib_val=BlockSet("train", 4096, _blocks(24, 2), corpus=wt2),
        fidelity=BlockSet("train", 4096, _blocks(0, 16), corpus=wt2),
        adapt_train=BlockSet("train", 4096, _blocks(0, 512), corpus=wt103),
        val=BlockSet("validation", 4096, _blocks(0, 32), corpus=wt103),
        test=BlockSet("test", 4096, [0], corpus=wt103, through_end=True),
        notes="paper protocol (App. B, F.2, F.3); WikiText-103 train contains WikiText-2 train articles, "
        "so adaptation text may include the calibration text, as in the paper",
    )


def _smollm2() -> SplitPlan:
    # SmolLM2-135M on the builtin corpus: the default plan's blocks (in SmolLM2's tokens). SmolLM2 was pretrained on
    # web and code data that may include CPython's standard library, so no range of the corpus is known to be unseen
    # (no pretrain role); its perplexities compare methods on one model, not models.
    # 16 test blocks (8192 tokens) instead of 32 keep the six perplexity evaluations of `oal run` inside its budget.
    d = _default()
    return replace(d, pretrain=None, test=BlockSet("test", 512, _blocks(0, 16)),
                   notes="SmolLM2-135M: builtin corpus, the default plan's blocks (16 test blocks); the model's "
                   "pretraining data may overlap the corpus")


PLAN_PRESETS = {"default": _default, "qwen2.5-0.5b": _paper, "llama-3.2-1b": _paper, "smollm2-135m": _smollm2}


def default_plan(preset: str = "default") -> SplitPlan:
    """The SplitPlan of a preset: "default" (embedded model, builtin corpus) or a paper backbone."""
    if preset not in PLAN_PRESETS:
        raise ValueError(f"preset: expected one of {sorted(PLAN_PRESETS)}, got {preset!r}")
    return PLAN_PRESETS[preset]()


def plan_blocks(corpus: Corpus | Mapping[str, Corpus], tokenizer, plan: SplitPlan, *,
                data_dir: str | None = None) -> dict[str, torch.Tensor]:
    """LongTensor [n, block_len] of token blocks for every role of `plan`.

    `corpus` is the run's corpus (roles with `corpus=None`), or a mapping from corpus name to Corpus. Roles naming
    another corpus load it with `load_corpus(name, data_dir=data_dir)`. Each split is tokenised once, and only as
    far as its roles reach (see `encode_prefix`).
    """
    from oal.data.sources import load_corpus

    corpora: dict[str | None, Corpus] = {}
    if isinstance(corpus, Corpus):
        corpora[None] = corpora[corpus.name] = corpus
    else:
        corpora.update(corpus)
    plan.check_disjoint()
    reach: dict[tuple, float] = {}  # tokens each (corpus, split) must provide
    for bs in plan.roles().values():
        end = math.inf if bs.through_end else (max(bs.indices, default=-1) + 1) * bs.block_len
        reach[(bs.corpus, bs.split)] = max(reach.get((bs.corpus, bs.split), 0), end)
    streams: dict[tuple, list[int]] = {}
    out: dict[str, torch.Tensor] = {}
    for role, bs in plan.roles().items():
        if bs.corpus not in corpora:
            if bs.corpus is None:
                raise ValueError(f"corpus: role {role!r} uses the run corpus but only {list(corpora)} were given")
            corpora[bs.corpus] = load_corpus(bs.corpus, data_dir=data_dir)
        c = corpora[bs.corpus]
        key = (id(c), bs.split)
        if key not in streams:
            need = reach[(bs.corpus, bs.split)]
            streams[key] = encode_prefix(tokenizer, c.splits[bs.split], need)
            if math.isfinite(need) and len(streams[key]) < need:  # all roles on this split, not the first one short
                where = f"corpus {bs.corpus}" if bs.corpus else "the run's corpus"
                raise ValueError(f"corpus: split {bs.split!r} of {where} has {len(streams[key])} tokens, and this "
                                 f"plan's roles on it ({', '.join(_roles_on(plan, bs))}) need at least {int(need)}")
        ids = streams[key]
        n_blocks = len(ids) // bs.block_len
        idx = bs.resolve(n_blocks)
        flat = torch.tensor(ids[: n_blocks * bs.block_len], dtype=torch.long).reshape(n_blocks, bs.block_len)
        out[role] = flat[idx] if idx else flat[:0]
    return out


def _roles_on(plan: SplitPlan, bs: BlockSet) -> list[str]:
    return [r for r, other in plan.roles().items() if (other.corpus, other.split) == (bs.corpus, bs.split)]


def bind_pretraining(plan: SplitPlan, provenance: Mapping, corpus: Corpus) -> SplitPlan:
    """`plan` with the embedded model's recorded pretraining range (training_summary.json) as `pretrain` when the
    model is the packaged default and the corpus is builtin, so `check_disjoint` refuses any role -- a custom plan
    included -- that reaches into text the model was trained on. Other models and corpora: `plan` unchanged."""
    summary = Path(str(provenance.get("path", ""))) / "training_summary.json"
    if provenance.get("source") != "package" or corpus.name != "builtin" or not summary.is_file():
        return plan
    rec = json.loads(summary.read_text()).get("pretrain")
    if not rec:
        return plan
    pre = BlockSet(rec["split"], rec["block_len"], [rec["first_block"]], through_end=True)
    if plan.pretrain is not None and plan.pretrain != pre:
        raise ValueError(f"plan: its pretrain range {plan.pretrain} differs from the one the embedded model was "
                         f"trained on ({pre}, {summary})")
    return replace(plan, pretrain=pre)  # __post_init__ checks every role against it


PREFIX_MARGIN = 64  # tokens dropped at the end of an encoded prefix (the last pieces may differ from the full text's)


def encode_prefix(tokenizer, text: str, n_tokens: float) -> list[int]:
    """Token ids of `text` whose first `n_tokens` equal `encode(tokenizer, text)`'s (all of them when n is inf or
    the text is short). Encodes growing prefixes cut at a paragraph break: tokenisers split text into pieces at
    whitespace, so only the last few pieces before the cut can differ from the full encoding, and PREFIX_MARGIN
    tokens are dropped there. Saves encoding all of a long split (the builtin train split is ~8 MB) for a few
    blocks at its head."""
    chars = max(4096, 8 * int(min(n_tokens, len(text))))
    while math.isfinite(n_tokens) and chars < len(text):
        cut = text.find("\n\n", chars)
        if cut < 0:
            break
        ids = encode(tokenizer, text[:cut])
        if len(ids) >= n_tokens + PREFIX_MARGIN:
            return ids[: len(ids) - PREFIX_MARGIN]
        chars *= 2
    return encode(tokenizer, text)
