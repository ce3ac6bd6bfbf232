"""Attention methods behind one interface: `oal`, `global`, `softmax`, the paper's baselines, sliding windows."""

from oal.methods.base import AttentionMethod, build_method, get_method, method_names, register, repeat_kv

__all__ = ["AttentionMethod", "build_method", "get_method", "method_names", "register", "repeat_kv"]
