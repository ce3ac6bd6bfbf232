"""Evaluation metrics of a model: frozen-attention fidelity, perplexity, zero-shot accuracy, passkey retrieval and
embedding similarity (`oal evaluate` on a run directory is `pipeline.evaluate_*`).

Submodules are imported on use; nothing is imported here eagerly.
"""
