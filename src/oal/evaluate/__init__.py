"""Evaluation: frozen-attention fidelity (`oal.evaluate.fidelity`) and perplexity (`oal.evaluate.perplexity`).

Submodules are imported on use; nothing is imported here eagerly.
"""
