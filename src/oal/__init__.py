"""oal: Outlier-Aware Attention Linearization for pretrained HF causal LMs.

Top-level helpers are imported lazily so that `import oal` stays light (no transformers import). Importing oal
registers the converted-model types ("oal_qwen2", ...) with transformers' Auto classes as soon as transformers
loads them (`models.auto`), so `AutoModelForCausalLM.from_pretrained(DIR)` rebuilds a saved converted model.
"""

from __future__ import annotations

from .models import auto as _auto

__version__ = "0.1.0"
__all__ = ["convert", "load", "save_kernels"]


def __getattr__(name: str):
    if name == "convert":
        from .models.convert import convert

        return convert
    if name in ("load", "save_kernels"):
        from . import io

        return getattr(io, name)
    raise AttributeError(f"module 'oal' has no attribute {name!r}")


_auto.install()
