"""HF model integration: the model registry (registry.py), capture, conversion and caches."""
