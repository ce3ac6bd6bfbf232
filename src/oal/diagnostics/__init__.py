"""Diagnostics: Table 1 (retained-error ratio), Fig. 2(b) (group budget), Table 2 (fidelity of all methods)."""
