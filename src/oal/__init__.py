"""oal: Outlier-Aware Attention Linearization for pretrained HF causal LMs.

The public face: `oal.linearize` (`pipeline.linearize`: analysis, grouping, calibration and the swap in one call),
`oal.add_lora` (its adaptation, in any training loop), `oal.convert` (`models.convert`), `oal.load`
(`artefact.load`), `oal.save_kernels` (`calibration.kernels`) and `oal.ops.oal_attention`; the packages below
follow the pipeline (docs/design/architecture.md).

Top-level helpers and the subpackages (`oal.ops`, `oal.methods`, ...) are imported lazily, on first use, so that
`import oal` stays light (no transformers import). Importing oal registers the converted-model types ("oal_qwen2",
...) with transformers' Auto classes as soon as transformers loads them (`models.auto`), so
`AutoModelForCausalLM.from_pretrained(DIR)` rebuilds a saved converted model.
"""

from __future__ import annotations

import importlib
import importlib.util

from oal.models import auto as _auto

__version__ = "0.1.0"
__all__ = ["add_lora", "convert", "linearize", "load", "save_kernels"]

# name -> the module that defines it, imported on first use
_LAZY = {"add_lora": "oal.pipeline.linearize", "convert": "oal.models.convert", "linearize": "oal.pipeline.linearize",
         "load": "oal.artefact.load", "save_kernels": "oal.calibration.kernels"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    if name.isidentifier() and not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        # the subpackages as the docs spell them after a bare `import oal` (`oal.ops.oal_attention`,
        # `oal.methods.method_names()`): an AttributeError until something else had imported them
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'oal' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names (what a notebook's completion offers): no `annotations` or `importlib`."""
    return sorted({*_LAZY, "__version__", *(n for n in globals() if not n.startswith("_"))} - {"annotations",
                                                                                             "importlib"})


_auto.install()
