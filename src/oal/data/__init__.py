"""Corpora, token blocks and the disjoint data protocol."""

from __future__ import annotations

from oal.data.blocks import encode, token_blocks
from oal.data.corpus import SPLITS, Corpus, builtin_corpus, local_corpus
from oal.data.sources import load_corpus
from oal.data.splits import ROLES, BlockSet, SplitPlan, bind_pretraining, default_plan, plan_blocks
from oal.data.wikitext import CONFIGS as WIKITEXT_CONFIGS
from oal.data.wikitext import load_wikitext

__all__ = ["Corpus", "BlockSet", "SplitPlan", "ROLES", "SPLITS", "load_corpus", "token_blocks", "encode",
           "bind_pretraining", "default_plan", "plan_blocks", "builtin_corpus", "local_corpus", "load_wikitext",
           "WIKITEXT_CONFIGS"]



