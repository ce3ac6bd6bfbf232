"""Diagnostics: Table 1 (retained-error ratio), Fig. 2(b) (group budget), Table 2 (fidelity of all methods).

`table2(model, fidelity_blocks, methods)` and `calibrate_methods(names, train, val, groups, cfg)` are the
entry points for `oal evaluate --methods all`; `diagnose(...)` runs everything into a run directory.
"""

from oal.calibration.model import capture_layers_data
from oal.diagnostics.budget import budget_curve, coefficients_per_head, plot_budget
from oal.diagnostics.fidelity_table import (
    TABLE2_METHODS,
    calibrate_methods,
    capture_chi,
    capture_sequences,
    table2,
)
from oal.diagnostics.retained_error import (
    RetainedErrorConfig,
    SequenceQKV,
    gaussian_control,
    hybrid_output,
    matched_controls,
    p_value,
    retained_error,
)
from oal.diagnostics.tables import table1_markdown, table2_markdown

__all__ = [
    "TABLE2_METHODS",
    "RetainedErrorConfig",
    "SequenceQKV",
    "budget_curve",
    "calibrate_methods",
    "capture_chi",
    "capture_layers_data",
    "capture_sequences",
    "coefficients_per_head",
    "diagnose",
    "gaussian_control",
    "hybrid_output",
    "matched_controls",
    "p_value",
    "plot_budget",
    "retained_error",
    "table1_markdown",
    "table2",
    "table2_markdown",
]


def __getattr__(name):
    if name == "diagnose":  # the runner pulls in rich and the run-directory helpers; import on use
        from oal.diagnostics.runner import diagnose

        return diagnose
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
