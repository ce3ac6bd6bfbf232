"""Benchmarks. Run each as a module from the repository root: python -m benchmarks.<name>."""
