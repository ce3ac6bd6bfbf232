"""Dimension-wise contribution analysis and contribution-based grouping (paper Sec. 3, 4.2, App. A, B)."""

from oal.analysis.contributions import (
    contribution_scores,
    contribution_scores_reference,
    head_contributions,
    prefix_contributions,
)
from oal.analysis.grouping import (
    GroupingResult,
    candidate_cuts,
    fixed_budget_groups,
    parse_grouping,
    stable_gap_groups,
    stable_gap_groups_reference,
)
from oal.analysis.inputs import analysis_inputs

__all__ = [
    "GroupingResult",
    "analysis_inputs",
    "analyze",
    "candidate_cuts",
    "check_groups_model",
    "contribution_scores",
    "contribution_scores_reference",
    "fixed_budget_groups",
    "head_contributions",
    "load_groups",
    "parse_grouping",
    "prefix_contributions",
    "stable_gap_groups",
    "stable_gap_groups_reference",
]


def __getattr__(name):
    # analyze pulls in transformers and matplotlib; import it only when asked for
    if name in ("analyze", "check_groups_model", "load_groups"):
        import importlib

        return getattr(importlib.import_module(f"{__name__}.runner"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
