"""What calibration reads and returns: its settings (App. B), one layer's frozen attention tensors, and the chosen
parameters of a layer with their per-head evidence (calibration.json)."""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field, replace

import torch

from oal.methods.base import AttentionMethod
from oal.rundir.files import strict_json

__all__ = ["CalibConfig", "HeadResult", "LayerCalibration", "LayerData", "NOT_CALIBRATED"]


@dataclass
class CalibConfig:
    """Calibration settings. `preset("paper")` is App. B; the default is sized for the embedded model on CPU."""

    lr: float = 0.02
    max_steps: int = 200  # updates per initialisation (paper: 1000)
    val_every: int = 25  # paper: 100
    patience: int = 100  # updates without validation improvement before a head stops (paper: 400)
    queries: int = 32  # causal query positions sampled per update
    clip_norm: float = 10.0  # per head
    perturb_std: float = 0.05  # Gaussian perturbation of the perturbed initialisations
    seed: int = 0
    dtype: str = "float32"
    # Which blocks (and their length) serve training/validation is the split plan's job (`oal.data.SplitPlan`:
    # calib_train / calib_val), not this config's.

    @classmethod
    def preset(cls, name: str = "default", **overrides) -> CalibConfig:
        presets = {
            "default": cls(),
            "paper": cls(max_steps=1000, val_every=100, patience=400),
            "tiny": cls(max_steps=40, val_every=10, patience=20),
        }
        if name not in presets:
            raise ValueError(f"preset: expected one of {sorted(presets)}, got {name!r}")
        return replace(presets[name], **overrides)

    def __post_init__(self):
        # True counted as 1 update, and lr=inf passed `lr > 0` (the factor overflowed after the capture)
        for name, low in (("max_steps", 1), ("val_every", 1), ("patience", 1), ("queries", 1), ("seed", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}: expected an integer >= {low}, got {value!r}")
        for name, positive in (("lr", True), ("clip_norm", True), ("perturb_std", False)):
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, numbers.Real) and math.isfinite(value)
            if not number or value < 0 or (positive and value == 0):
                raise ValueError(f"{name}: expected a finite number {'> 0' if positive else '>= 0'}, got {value!r}")
        if self.dtype not in ("float32", "float64"):
            raise ValueError(f"dtype: expected 'float32' or 'float64', got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class LayerData:
    """Frozen attention tensors of S sequences: q [S, Hq, N, d], k/v [S, Hkv, N, d|dv], out [S, Hq, N, dv];
    mask [S, N] (True = real token; None = no padding); causal=False for encoders (all real keys visible)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    mask: torch.Tensor | None = None
    causal: bool = True

    @classmethod
    def from_captured(cls, items) -> LayerData:
        """Concatenate `Captured` objects (or a single one) along the batch dimension."""
        items = [items] if hasattr(items, "q") else list(items)
        if not items:
            raise ValueError("items: expected at least one captured sequence")
        cat = [torch.cat([getattr(c, n) for c in items]) for n in ("q", "k", "v", "out")]
        causal = {getattr(c, "causal", True) for c in items}
        if len(causal) > 1:
            raise ValueError("items: causal and non-causal captures cannot be mixed")
        masks = [getattr(c, "attention_mask", getattr(c, "mask", None)) for c in items]
        mask = None if all(m is None for m in masks) else torch.cat([
            torch.ones(c.q.shape[0], c.q.shape[2], dtype=torch.bool, device=c.q.device) if m is None else m.bool()
            for c, m in zip(items, masks, strict=True)])
        return cls(*cat, mask=mask, causal=causal.pop())

    def __post_init__(self):
        s, hq, n, d = self.q.shape
        if self.k.dim() != 4 or self.k.shape[0] != s or self.k.shape[2:] != (n, d) or hq % self.k.shape[1]:
            raise ValueError(f"k: expected [{s}, Hkv, {n}, {d}] with Hq % Hkv == 0, got {tuple(self.k.shape)}")
        if self.v.shape[:3] != self.k.shape[:3] or self.out.shape != (s, hq, n, self.v.shape[-1]):
            raise ValueError(f"v/out: shapes {tuple(self.v.shape)} / {tuple(self.out.shape)} do not match q/k")
        if self.mask is not None:
            if self.mask.shape != (s, n):
                raise ValueError(f"mask: expected shape [{s}, {n}], got {tuple(self.mask.shape)}")
            self.mask = self.mask.bool()
            if not bool(self.mask.any(1).all()):
                raise ValueError("mask: every sequence needs at least one real token")
        for name in ("q", "k", "v", "out"):  # a NaN would silently leave heads at their start (Eq. 20 undefined)
            t = getattr(self, name)
            if name == "out" and self.mask is not None:
                t = t.transpose(1, 2)[self.mask]  # padded queries are never scored
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name}: non-finite values (NaN or inf) in the captured attention tensors")

    def to(self, dtype) -> LayerData:
        return LayerData(*(t.to(dtype) for t in (self.q, self.k, self.v, self.out)), mask=self.mask,
                         causal=self.causal)

    def head(self, h: int, rep: int) -> LayerData:
        kv = h // rep
        return LayerData(self.q[:, h : h + 1], self.k[:, kv : kv + 1], self.v[:, kv : kv + 1], self.out[:, h : h + 1],
                         mask=self.mask, causal=self.causal)


@dataclass
class HeadResult:
    head: int
    init: str  # chosen initialisation
    val_mse: float  # best validation MSE of the chosen initialisation
    best_step: int
    steps: int  # updates run by the chosen initialisation before it stopped
    val_mse_by_init: dict[str, float] = field(default_factory=dict)
    curves: dict[str, list[list[float]]] = field(default_factory=dict)  # init -> [[step, val_mse, train_mse]]


@dataclass
class LayerCalibration:
    """Selected parameters of one layer, with per-head (or, for shared parameters, per-layer) evidence."""

    layer: int
    method: str
    params: dict[str, torch.Tensor]  # the chosen trainable parameters, in the method's own shapes
    heads: list[HeadResult]
    elapsed_s: float
    per_head: bool = True

    def apply(self, method: AttentionMethod) -> AttentionMethod:
        """Copy the chosen parameters into `method` (same shapes) and return it."""
        named = dict(method.named_parameters())
        with torch.no_grad():
            for name, value in self.params.items():
                if name not in named or named[name].shape != value.shape:
                    raise ValueError(f"method: parameter {name!r} missing or of a different shape")
                named[name].copy_(value.to(named[name].dtype))
        return method

    def summary(self) -> dict:
        """calibration.json's entry; NaN / inf (no training loss at step 0, a diverged start) become null, since
        strict JSON parsers reject bare NaN."""
        return strict_json({"layer": self.layer, "method": self.method, "elapsed_s": self.elapsed_s,
                            "per_head": self.per_head, "heads": [asdict(h) for h in self.heads]})


# calibration.json entry of a method without trainable kernel parameters
NOT_CALIBRATED = {"elapsed_s": 0.0, "per_head": False, "heads": [], "note": "no trainable kernel parameters"}
