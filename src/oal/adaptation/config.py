"""Adaptation settings (App. F.2) and what an adaptation returns (adapt.json)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from oal.errors import from_known_keys

__all__ = ["AdaptConfig", "AdaptResult", "adapt_identity"]


@dataclass
class AdaptConfig:
    """App. F.2 defaults; `steps`/`val_every` are the paper's 512/128 (presets shrink them for the CPU).

    `batch_size` blocks per process and micro-batch, `grad_accum` micro-batches per update: an update averages
    batch_size x processes x grad_accum blocks (the paper: 1 x 1 x 1)."""

    steps: int = 512
    lr: float = 5e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    warmup_frac: float = 0.05
    grad_clip: float = 1.0
    val_every: int = 128
    ckpt_every: int = 32
    lora_r: int = 8
    lora_alpha: int = 16
    lora_dropout: float = 0.05
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    train_kernel: bool = True
    seed: int = 42
    batch_size: int = 1
    grad_accum: int = 1

    def __post_init__(self):
        self.betas = tuple(self.betas)
        self.target_modules = tuple(self.target_modules)
        for name in ("steps", "val_every", "ckpt_every", "lora_r", "batch_size", "grad_accum"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer >= 1, got {getattr(self, name)!r}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"lr: expected a finite number > 0, got {self.lr!r}")
        if not 0 <= self.warmup_frac < 1:
            raise ValueError(f"warmup_frac: expected a value in [0, 1), got {self.warmup_frac!r}")
        if not 0 <= self.lora_dropout < 1:
            raise ValueError(f"lora_dropout: expected a value in [0, 1), got {self.lora_dropout!r}")
        # a NaN grad_clip passed `<= 0` and made every parameter NaN, as did an adam_eps of 0 (LoRA A's first
        # gradient is 0 while B = 0: 0 / 0); a lora_alpha of 0 scaled LoRA's update to nothing. grad_clip inf: none
        for name, closed, top in (("grad_clip", False, math.inf), ("lora_alpha", False, None),
                                  ("weight_decay", True, None), ("adam_eps", False, None)):
            value = getattr(self, name)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
            if not ok or value < 0 or (value == 0 and not closed) or (math.isinf(value) and value != top):
                kind = "a number" if top else "a finite number"
                raise ValueError(f"{name}: expected {kind} {'>=' if closed else '>'} 0, got {value!r}")
        if len(self.betas) != 2 or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas: expected two numbers in [0, 1), got {self.betas!r}")

    @classmethod
    def from_dict(cls, d: dict) -> AdaptConfig:
        return from_known_keys(cls, d, "adapt config")

    def to_dict(self) -> dict:
        return asdict(self)


# Settings that arrived with data parallelism, at the values that change nothing (the paper's protocol).
_NEUTRAL = {"batch_size": 1, "grad_accum": 1}


def adapt_identity(cfg: AdaptConfig, processes: int = 1) -> dict:
    """What adaptation results depend on: the settings, and the number of processes (it sets the global batch).
    batch_size 1, grad_accum 1 and one process are left out, so that run directories and checkpoints made before
    these settings existed stay valid: they compute exactly what those did."""
    d = {k: v for k, v in cfg.to_dict().items() if not (k in _NEUTRAL and v == _NEUTRAL[k])}
    return d if processes == 1 else {**d, "processes": processes}


@dataclass
class AdaptResult:
    best_step: int
    best_val_nll: float
    steps: int
    n_lora_params: int
    n_kernel_params: int
    kernel_change: float  # |theta_final - theta_calibrated| over kernel parameters (0 when none train)
    kernel_names: list[str] = field(default_factory=list)  # trained kernel parameters (names without peft prefix)
    base_sha256: str = ""  # converted_model_sha256 of the model before adaptation (what the adapter is bound to)
    history: list[dict] = field(default_factory=list)  # per update: step, loss (global-batch mean), lr
    validation: list[dict] = field(default_factory=list)  # step, val_nll
    processes: int = 1  # processes that trained it (data parallel)
    global_batch: int = 1  # blocks per update: batch_size x processes x grad_accum

    def to_dict(self) -> dict:
        return asdict(self)
