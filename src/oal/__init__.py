"""oal: Outlier-Aware Attention Linearization for pretrained HF causal LMs.

The public face: `oal.convert` (`models.convert`), `oal.load` (`artefact.load`), `oal.save_kernels`
(`calibration.kernels`) and `oal.ops.oal_attention`; the packages below follow the pipeline (README "Layout").

Top-level helpers are imported lazily so that `import oal` stays light (no transformers import). Importing oal
registers the converted-model types ("oal_qwen2", ...) with transformers' Auto classes as soon as transformers
loads them (`models.auto`), so `AutoModelForCausalLM.from_pretrained(DIR)` rebuilds a saved converted model.
"""

from __future__ import annotations

from oal.models import auto as _auto

__version__ = "0.1.0"
__all__ = ["convert", "load", "save_kernels"]


def __getattr__(name: str):
    if name == "convert":
        from oal.models.convert import convert

        return convert
    if name == "load":
        from oal.artefact.load import load

        return load
    if name == "save_kernels":
        from oal.calibration.kernels import save_kernels

        return save_kernels
    raise AttributeError(f"module 'oal' has no attribute {name!r}")


_auto.install()
