"""One interface for every attention approximation, and the registry behind `--method`.

A method is an `nn.Module` built once per converted layer. It receives post-RoPE, *unscaled* q/k/v in HF
layout (q [B, Hq, N, d], k/v [B, Hkv, N, d|dv], GQA by `h // (Hq // Hkv)`) and returns [B, Hq, N, dv].
Every method has a dense O(N^2) `dense_kernel` (the oracle and the basis of the Table 1 diagnostics) and a
linear-time `forward`. Adding a method: one file with a subclass decorated by `@register`.

`version` numbers a method's construction: bump it when the same saved tensors and record would compute another
function (kernels files and exported models record it; `check_version` refuses a record of another version,
unless `legacy` names the settings under which this construction computes that version's function:
`record_settings` then rebuilds it with them).
"""

from __future__ import annotations

import importlib
import numbers
from typing import ClassVar

import torch
from torch import nn

__all__ = ["AttentionMethod", "METHODS", "build_method", "causal_mask", "check_version", "constructor_settings",
           "get_method", "method_names", "method_settings", "newer_versions", "record_settings", "register",
           "repeat_kv", "unknown_method", "unknown_settings"]

METHODS: dict[str, type[AttentionMethod]] = {}


def register(cls: type[AttentionMethod]) -> type[AttentionMethod]:
    """Class decorator: make `cls` selectable by `--method cls.name`."""
    if cls.name in METHODS:
        raise ValueError(f"method {cls.name!r} is registered twice")
    METHODS[cls.name] = cls
    return cls


# Modules holding the built-in methods; each registers itself on import.
_BUILTIN = ("oal", "softmax", "performer", "spectraformer", "dijiang", "taylorshift", "window")


def _load_builtin() -> None:
    for mod in _BUILTIN:
        importlib.import_module(f"{__package__}.{mod}")


def method_names() -> list[str]:
    """The registered methods' names, the built-in ones first (what `--methods` and `oal.linearize` accept)."""
    _load_builtin()
    return list(METHODS)


def unknown_method(name, known=None, *, some: bool = False, whose: str = "") -> str:
    """The one message for a method name not among `known` (default: every registered method), wherever a command or
    the library takes one: "unknown method 'oall'; expected one of oal, global, ... (did you mean 'oal'?)". `some`:
    a list of names is asked for (--methods); `whose` follows the names (" (this run's)"). The messages differed,
    one as Python lists ("unknown ['oall']; expected some of ['oal', ...]")."""
    import difflib

    known = [str(k) for k in (method_names() if known is None else known)]
    close = difflib.get_close_matches(str(name), known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown method {name!r}; expected {'some' if some else 'one'} of {', '.join(known)}{whose}{hint}"


def get_method(name: str) -> type[AttentionMethod]:
    """The `AttentionMethod` subclass registered as `name`; ValueError naming the known ones otherwise."""
    _load_builtin()
    if name not in METHODS:
        raise ValueError(f"method: {unknown_method(name)}")
    return METHODS[name]


def build_method(name: str, n_heads: int, n_kv_heads: int, head_dim: int, **kwargs) -> AttentionMethod:
    """A new, uncalibrated `name` method for a layer of `n_heads` query and `n_kv_heads` KV heads of `head_dim`;
    `kwargs` are its constructor's (`layer_idx`, `seed`, and the method's own: `groups`, `window`, ...). A setting
    the constructor does not take is a ValueError naming it (a misspelt `windw=64` was dropped silently)."""
    unknown, known = unknown_settings(name, set(kwargs) - {"layer_idx"})  # the layer's index is every method's
    if unknown:
        raise ValueError(f"{', '.join(unknown)}: not a setting of method {name!r} (its settings: {known})")
    return get_method(name)(n_heads, n_kv_heads, head_dim, **kwargs)


def unknown_settings(name: str, settings) -> tuple[list[str], str]:
    """(the keys of `settings` that method `name`'s constructor does not take, sorted; its settings as a phrase)."""
    known = constructor_settings(name)
    unknown = [] if known is None else sorted(set(settings) - set(known))
    return unknown, ", ".join(known or []) or ("any" if known is None else "none")


def constructor_settings(name: str) -> list[str] | None:
    """The keyword settings method `name`'s constructor takes, besides its sizes and `layer_idx` (sorted); None
    for a constructor that takes any (`**kwargs`)."""
    import inspect

    params = inspect.signature(get_method(name).__init__).parameters
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):  # a registered method that takes anything
        return None
    return sorted(k for k, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and k not in ("self", "n_heads", "n_kv_heads", "head_dim", "layer_idx"))


def method_settings(name: str, options) -> dict:
    """The entries of `options` (a run's method settings, e.g. {"window": 64, "sinks": 4} from `--window` and
    `--sinks`) that method `name` takes as constructor arguments (its `settings`)."""
    cls = get_method(name)
    return {k: options[k] for k in cls.settings if k in (options or {})}


def check_version(info, where: str) -> None:
    """Refuse a saved method record (kernels.json layer, config.oal layer) written by another construction version
    of its method; records from before versions were recorded count as version 1."""
    cls = get_method(info["method"])
    got = info.get("version", 1)
    if got != cls.version and got not in cls.legacy:
        raise ValueError(f"{where}: {cls.name} kernels were saved by construction version {got!r}, this oal builds "
                         f"version {cls.version} (the same tensors would compute another function); recalibrate or "
                         f"re-export them with this version")


def record_settings(info) -> dict:
    """The constructor settings of a saved method record: its `init`, with those that make this construction compute
    the function of the record's older version (`AttentionMethod.legacy`)."""
    return {**info.get("init", {}), **get_method(info["method"]).legacy.get(info.get("version", 1), {})}


def newer_versions(names) -> dict[str, int]:
    """{method: construction version} for those of `names` above version 1. For cache and stage keys: a result
    computed by an older construction gets another key and is recomputed, while keys of results that involve
    version-1 methods only stay as they were."""
    return {n: get_method(n).version for n in names if get_method(n).version != 1}


def causal_mask(n: int, m: int, device) -> torch.Tensor:
    """[n, m] bool: query i sees key j iff j <= i + m - n (the last n of m positions query)."""
    return torch.ones(n, m, dtype=torch.bool, device=device).tril(m - n)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, N, d] -> [B, Hkv * n_rep, N, d], query head h reading KV head h // n_rep (as HF's repeat_kv)."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


class AttentionMethod(nn.Module):
    """Base class. Subclasses set `name` and implement `dense_kernel` and `forward`."""

    name: ClassVar[str] = ""
    stochastic: ClassVar[bool] = False  # random features: Table 1 averages over seeds
    supports_state: ClassVar[bool] = False  # forward accepts initial_state / output_final_state
    uses_groups: ClassVar[bool] = False  # built with the stable-gap groups (groups=, n_groups=), as oal is
    settings: ClassVar[tuple[str, ...]] = ()  # constructor settings a run configures (`method_settings`)
    positional: ClassVar[bool] = False  # causal only; dense_kernel(q, k, positions=) depends on where queries sit
    version: ClassVar[int] = 1  # construction version, recorded with saved kernels (see module doc)
    legacy: ClassVar[dict[int, dict]] = {}  # older version -> the settings under which this one computes it
    # App. F.1-F.2: OAL and the learned global start LoRA from their calibrated coefficients; a baseline's trainable
    # kernel parameters start it at their initial values (its calibration serves the frozen-attention evaluation)
    adapts_from_calibration: ClassVar[bool] = False
    # tensors shared by every head of the layer whatever their first dimension (calibration otherwise reads a tensor
    # whose first dimension equals n_heads as per query head: `calibration.fit._per_head_names`)
    layer_shared: ClassVar[tuple[str, ...]] = ()

    def __init__(self, n_heads: int, n_kv_heads: int, head_dim: int, *, layer_idx: int = 0, seed: int = 0):
        super().__init__()
        for arg, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                # 0, -3 or 4.0 failed deep in a method's tensor constructors, or built a method nothing could call
                raise ValueError(f"{arg}: expected an integer >= 1, got {value!r}")
        n_heads, n_kv_heads, head_dim = int(n_heads), int(n_kv_heads), int(head_dim)
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads: {n_heads} must be a multiple of n_kv_heads {n_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.layer_idx, self.seed = layer_idx, seed

    @property
    def n_rep(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def trainable(self) -> bool:
        """Whether the method has parameters to calibrate and adapt (softmax and the sliding window have none)."""
        return any(p.requires_grad for p in self.parameters())

    @property
    def n_kernel_params(self) -> int:
        """Trainable kernel coefficients as the paper counts them (App. D, F.1); here every trainable entry."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def dense_kernel(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Unnormalised kernel weights [B, Hq, N, M] between queries q [B, Hq, N, d] and keys k [B, Hkv, M, d]."""
        raise NotImplementedError

    def masked_kernel(self, q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, **kwargs) -> torch.Tensor:
        """`dense_kernel(q, k, **kwargs)` with 0 wherever `allowed` (bool, broadcastable to [B, Hq, N, M]) is False.
        A method whose dense kernel shifts an exponent by a max over keys overrides this to take that max over the
        allowed keys only: a masked key scoring far above the kept ones would underflow every kept weight (0/0)."""
        return self.dense_kernel(q, k, **kwargs).masked_fill(~allowed, 0.0)

    def reference(self, q, k, v, *, causal: bool = True) -> torch.Tensor:
        """Dense O(N^2): normalised kernel-weighted sum of values (Eq. 1 evaluated pairwise)."""
        everything = torch.ones(1, 1, dtype=torch.bool, device=q.device)
        w = self.masked_kernel(q, k, causal_mask(q.shape[2], k.shape[2], q.device) if causal else everything)
        w = w.to(v.dtype)
        return (w @ repeat_kv(v, self.n_rep)) / w.sum(-1, keepdim=True)

    def forward(self, q, k, v, *, causal: bool = True, initial_state=None, output_final_state: bool = False):
        """The method's attention output [B, Hq, N, dv] for q [B, Hq, N, d], k [B, Hkv, N, d], v [B, Hkv, N, dv], in
        linear time where the method has a fast path; methods with `supports_state` continue from `initial_state`
        and return `(out, state)` when `output_final_state`."""
        raise NotImplementedError
