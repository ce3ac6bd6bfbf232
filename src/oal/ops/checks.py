"""Input checks of the OAL operator: a ValueError naming the argument for bad input, never a silent NaN.

Shapes, dtypes, devices and options are checked on the host on every call; that reads no tensor values. Values
(NaN/Inf in q, k, v, the factor and an initial state, a state's denominator, keys whose products overflow the
state, a non-finite output) are checked in one of two ways:

- On the host (`check`; the CPU, and CUDA with OAL_SYNC_CHECKS=1): read on every call, before the kernels run;
  the group ids and the factor once per tensor and version (`groups_checked`, `factor_checked`).
- On the device (`deferred` devices, CUDA by default): reading a value stalls the host until the device has
  caught up (the floor of about 1.6 ms per call on the H200). There `start` checks the inputs on the device in one
  launch (`triton.guard`); the kernels that write the output flag a non-finite one into the same status (`finish`
  checks it where they do not: the sliding window's token loop); `finish` copies the few numbers to pinned host
  memory without waiting;
  `drain` reads them once they have arrived: at the start of every later operator call on that device, and in
  `check_errors()`.
  A bad input still gets its ValueError with the same message, one call late or a few (a call waits for the
  oldest check once MAX_PENDING are outstanding), suffixed with where it was found. Its output may be NaN until
  then. Decoding calls on the cache's own state (`decode_check`) share one status buffer among DECODE_SHARED
  calls, copied to the host once for all of them: their errors come up to DECODE_SHARED calls later. Group ids are
  read once per groups tensor (cached by identity and version counter: `groups_checked`).
  The overflow rescaling (`rescaled`, Eq. 7) is computed from the device maxima as device multipliers
  (`device_rescale`, computed by the guard kernel), so no decision needs a value on the host.

A state the generation cache produced and hands back (`owned`, set by `models.attention` through `cache_owned`)
is not checked again: the operator checked what went into it. The public `initial_state=` is always checked.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import math
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from oal.errors import env_flag
from oal.ops.kernel import feature_dim, packed_pairs, version

BACKENDS = ("auto", "reference", "recurrent", "chunked", "triton")
DEFERRED_DEVICES = {"cuda"}  # device types whose value checks run on the device (tests add "cpu")
MAX_PENDING = 16  # device checks outstanding before a call waits for the oldest
# Decoding calls on the cache's own state whose checks share one status buffer: at batch 1 on a GPU a decoding call
# is bound by the host, and a buffer, its zeroing, a pinned copy and an event per call cost more than its kernels
DECODE_SHARED = 32


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # states accumulate in fp32, or fp64 for fp64 inputs
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------ the cache's own state

_OWNED: contextvars.ContextVar = contextvars.ContextVar("oal_cache_owned_state", default=None)


@contextlib.contextmanager
def cache_owned(state: torch.Tensor | None):
    """Within this block `state` is the generation cache's own (it came out of the operator and nobody else holds
    it): the operator neither checks it again nor keeps it unchanged (`owned`). For `models.attention` only."""
    token = _OWNED.set(state)
    try:
        yield
    finally:
        _OWNED.reset(token)


def owned(state) -> bool:
    return state is not None and _OWNED.get() is state


def updatable(state: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether an owned `state` may be updated in place: no autograd through it, and not an inference tensor
    outside inference mode."""
    if torch.is_grad_enabled() and (state.requires_grad or any(t is not None and t.requires_grad for t in tensors)):
        return False
    return not (state.is_inference() and not torch.is_inference_mode_enabled())


# ------------------------------------------------------------------------------------------------- host checks


def qkv_shapes(q, k, v) -> None:
    """q [B, Hq, N, d], k [B, Hkv, N, d], v [B, Hkv, N, dv], floating point, Hq a multiple of Hkv."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: expected a 4-D tensor [B, H, N, d], got {shape}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    bsz, n_q, n, d = q.shape
    if d == 0:
        raise ValueError("q: expected a head dimension d >= 1, got d = 0")
    if k.shape[0] != bsz or k.shape[2] != n or k.shape[3] != d:
        raise ValueError(f"k: expected shape [{bsz}, Hkv, {n}, {d}] to match q {tuple(q.shape)}, got {tuple(k.shape)}")
    n_kv = k.shape[1]
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v: expected shape [{bsz}, {n_kv}, {n}, dv] to match k, got {tuple(v.shape)}")
    if n_kv == 0 or n_q % n_kv != 0:
        raise ValueError(f"q/k: query heads Hq={n_q} must be a multiple of KV heads Hkv={n_kv}")


def check_types(q, factor, causal, output_final_state) -> None:
    """What the operator reads before its other checks: q and factor are tensors, the flags are bools (None or a
    string is not read as a flag: `causal=None` ran non-causal attention). No tensor values are read."""
    for name, t in (("q", q), ("factor", factor)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a tensor, got {type(t).__name__}")
    for name, flag in (("causal", causal), ("output_final_state", output_final_state)):
        if not isinstance(flag, bool):
            raise ValueError(f"{name}: expected True or False, got {flag!r}")


def check_shapes(q, k, v, groups, factor, eps, scale, initial_state, backend, chunk_size=None):
    """Everything but tensor values, and the group ids (read on the host once per groups tensor and version:
    `groups_checked`)."""
    qkv_shapes(q, k, v)
    bsz, n_q, _, d = q.shape
    n_kv = k.shape[1]
    if (
        not isinstance(factor, torch.Tensor)
        or factor.dim() != 3
        or factor.shape[0] != n_q
        or (factor.shape[1] != factor.shape[2] or factor.shape[1] < 2)
    ):
        got = tuple(factor.shape) if isinstance(factor, torch.Tensor) else type(factor).__name__
        raise ValueError(f"factor: expected shape [Hq={n_q}, G+1, G+1] with G >= 1, got {got}")
    n_groups = factor.shape[1] - 1
    if not isinstance(groups, torch.Tensor) or groups.shape != (n_q, d):
        got = tuple(groups.shape) if isinstance(groups, torch.Tensor) else type(groups).__name__
        raise ValueError(f"groups: expected an integer tensor of shape [Hq={n_q}, d={d}], got {got}")
    if groups.is_floating_point() or groups.is_complex() or groups.dtype == torch.bool:
        raise ValueError(f"groups: expected an integer dtype, got {groups.dtype}")
    if initial_state is not None and not isinstance(initial_state, torch.Tensor):
        raise ValueError(f"initial_state: expected a tensor or None, got {type(initial_state).__name__}")
    for name, t in (("k", k), ("v", v), ("groups", groups), ("factor", factor), ("initial_state", initial_state)):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name}: expected a tensor on q's device {q.device}, got {t.device}")
    groups_checked(groups, n_groups)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps: expected a finite number >= 0, got {eps!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise ValueError(f"scale: expected a finite number or None, got {scale!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size: expected a positive integer or None, got {chunk_size!r}")
    if initial_state is not None:
        want = (bsz, n_kv, feature_dim(d), v.shape[-1] + 1)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state: expected shape {list(want)}, got {tuple(initial_state.shape)}")


def _group_range(groups: torch.Tensor, n_groups: int) -> None:
    if groups.numel() and (int(groups.min()) < 0 or int(groups.max()) >= n_groups):
        raise ValueError(
            f"groups: ids must lie in [0, G={n_groups}) (G from factor's shape [Hq, G+1, G+1]), got range "
            f"[{int(groups.min())}, {int(groups.max())}]"
        )


_GROUPS_OK = WeakIdKeyDictionary()  # groups tensor -> (version, address, G) it was found valid for


def groups_checked(groups: torch.Tensor, n_groups: int) -> None:
    """`_group_range` once per groups tensor and G: read again only after an in-place write (its version counter).
    Writes through `.data` bypass that counter; on deferred devices they are not seen (ids out of range then
    fail inside torch's gather as a device assert, not silently)."""
    key = (version(groups), n_groups)
    if _GROUPS_OK.get(groups) != key:
        _group_range(groups, n_groups)
        _GROUPS_OK[groups] = key


def check(q, k, v, groups, factor, eps, scale, initial_state, backend, chunk_size=None, *, check_state=True):
    """All checks on the host; returns (max |q|, max |k|) as floats. The kernel's tensors (group ids, factor) are
    read once per tensor and version (`groups_checked`, `factor_checked`): a decoding step reads q, k, v only."""
    check_shapes(q, k, v, groups, factor, eps, scale, initial_state, backend, chunk_size)
    mags = {name: max_abs(name, t) for name, t in (("q", q), ("k", k), ("v", v))}
    factor_checked(factor)
    if initial_state is not None and check_state:
        max_abs("initial_state", initial_state)
        check_denominator(initial_state, q.shape[-1])
    return mags["q"], mags["k"]


def check_denominator(state: torch.Tensor, d: int) -> None:
    """A state's last column sums [1, k_j, k_j k_j^T] over the keys so far, so its token count (H0) and the sums of
    squares on H2's diagonal cannot be negative; a state that breaks this makes normalisers negative or zero."""
    count, squares = _moments(state, d)
    if (count < 0).any() or (squares < 0).any():
        raise ValueError(_denominator_message(float(count.min()), float(squares.min())))


def _moments(state: torch.Tensor, d: int):
    """(token count [B, Hkv], sums of squares k_r^2 [B, Hkv, d]) of a state's denominator column."""
    den = state[..., -1]
    return den[..., 0], den[..., 1 + d :].index_select(-1, _diagonal(d, state.device))


@functools.cache
def _diagonal(d: int, device: torch.device) -> torch.Tensor:
    """Positions of the pairs (r, r) among the packed pairs: an index, not a mask (a mask is a host read). A normal
    tensor also when first asked for in inference mode: index_select saves it for backward (a state checked first
    under torch.inference_mode, as generation does, then made every training call with a state fail)."""
    with torch.inference_mode(False):
        r, t, _ = packed_pairs(d, "cpu")
        return torch.nonzero(r == t).flatten().to(device)


def _denominator_message(count: float, squares: float) -> str:
    return (f"initial_state: its denominator column (index dv) must hold key moments (token count >= 0, sums of "
            f"squares k_r^2 >= 0), got count {count:.4g} and squares down to {squares:.4g}; pass the state a "
            f"previous call returned")


def max_abs(name: str, t: torch.Tensor) -> float:
    """max |t|, or a ValueError naming `name` if t holds NaN or Inf (one pass: aminmax propagates NaN)."""
    if t.numel() == 0:
        return 0.0
    lo, hi = (float(x) for x in torch.aminmax(t.detach()))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"{name}: contains NaN or Inf values")
    return max(-lo, hi)


def _k_overflow_message(kmax: float, dtype: torch.dtype) -> str:
    return f"k: values up to {kmax:.3g} overflow the {dtype} state (k_r k_t); use float64"


@functools.cache
def rescale_bound(dtype: torch.dtype) -> tuple[float, float]:
    """(largest max|k|^2 the state holds, largest score bound evaluated without rescaling) in `dtype`."""
    info = torch.finfo(dtype)
    return info.max / 1e6, info.max**0.25


def rescaled(q, qmax: float, kmax: float, factor, eps: float, scale: float, dtype: torch.dtype):
    """(q, factor, eps, scale, lam) with which `dtype` evaluates kappa / lam without overflow (max |q|, |k| given).

    kappa / lam = eps / lam + |L'^T [1, s / sqrt(lam)]|^2 with L' = L whose row 0 is divided by sqrt(lam)
    (Eq. 7), and the output num / den does not change when every kappa is divided by lam. So scores too large
    for `dtype` (bound s_max beyond max^(1/4), where the readout's s^2-sized terms could overflow) are evaluated
    exactly with lam = s_max^2: q / max|q| and scale 1 / (d max|k|), which keeps the query features near 1
    and the state (raw keys, by contract) unchanged. Keys whose own products k_r k_t overflow are refused.
    lam is 1 when nothing was rescaled (the sliding-window hybrid needs it: there kappa's scale does not cancel).
    """
    k_limit, s_limit = rescale_bound(dtype)
    if kmax * kmax > k_limit:  # the state holds the raw products k_r k_t
        raise ValueError(_k_overflow_message(kmax, dtype))
    d = q.shape[-1]
    s_max = abs(scale) * d * qmax * kmax  # |s| <= scale d max|q| max|k|
    if s_max <= s_limit:
        return q, factor, eps, scale, 1.0
    row0 = torch.ones(factor.shape[-1], 1, dtype=factor.dtype, device=factor.device)
    row0[0] = 1.0 / s_max
    return q / qmax, factor * row0, eps / s_max**2, math.copysign(1.0 / (d * kmax), scale), s_max**2


def out_message(eps: float, dtype: torch.dtype) -> str:
    if eps == 0:
        return "eps: with eps=0 the kernel vanished for every visible key of some query (0/0); use eps > 0"
    return f"q/k/factor: the kernel overflowed {dtype}; use float64 inputs"


# ----------------------------------------------------------------------------------------------- device checks


def deferred(q) -> bool:
    """Whether the value checks of a call with this q run on the device (see the module docstring)."""
    return (isinstance(q, torch.Tensor) and q.device.type in DEFERRED_DEVICES
            and not env_flag("OAL_SYNC_CHECKS", False))


@dataclass
class DeviceCheck:
    """One call's value checks on the device: `status` holds them in the slots of `triton.guard`."""

    device: torch.device
    dtype: torch.dtype  # the compute dtype (for the overflow bound)
    eps: float
    status: torch.Tensor
    state_keys: bool = True  # a state of the keys' products k_r k_t is made (not for plain sliding windows)
    shared: tuple | None = None  # `decode_check`'s key: the status is shared by decoding calls
    calls: int = 0  # the calls that wrote into a shared status


def _status(device) -> torch.Tensor:
    from oal.ops.triton import guard

    return torch.zeros(guard.SLOTS, dtype=torch.float32, device=device)


def begin(device, dtype: torch.dtype, eps: float, *, state_keys: bool = True) -> DeviceCheck:
    """A call's own device check, after reading earlier calls' checks (`drain`, which raises what they found):
    a fresh status buffer for the kernels and the guard to write into."""
    drain(device)
    return DeviceCheck(device, dtype, float(eps), _status(device), state_keys=state_keys)


def _state_stats(guard, status, state: torch.Tensor, d: int) -> None:
    """A caller's state: NaN/Inf, and its token counts and sums of squares (negated: above 0 when negative)."""
    count, squares = _moments(state.detach(), d)
    guard.launch(status, [state.detach()], first=4, signed=-torch.cat([count.reshape(-1), squares.reshape(-1)]))


def start(q, k, v, factor, initial_state, dtype: torch.dtype, eps: float, *, scale: float, check_state=True,
          moments=True):
    """Begin a call's value checks on the device, one launch (`triton.guard`), no host read; returns the check and
    the overflow multipliers [qs, m_a, m_b, m_c, m_w, m_l0] of `device_rescale` (a view of its status). Errors found
    by earlier calls are raised first. q, k, v contiguous. `factor` None: no kernel (a plain sliding window, whose
    keys make no state of their products). `moments` False: the initial state is checked for NaN/Inf only (the
    sliding window's state, whose layout is not OAL's)."""
    from oal.ops.triton import guard

    chk = begin(q.device, dtype, eps, state_keys=factor is not None)
    d = q.shape[-1]
    tensors = [q, k, v, q.new_empty(0) if factor is None else factor]  # the slots are positional
    if initial_state is not None and check_state and not moments:
        tensors.append(initial_state)
    guard.launch(chk.status, [t.detach() for t in tensors], first=0, scale=scale, d=d,
                 s_limit=rescale_bound(dtype)[1], mults=True)
    if initial_state is not None and check_state and moments:
        _state_stats(guard, chk.status, initial_state, d)
    return chk, chk.status[guard.MULT : guard.MULT + 6]


def device_rescale(qmax: torch.Tensor, kmax: torch.Tensor, scale: float, d: int, dtype: torch.dtype) -> torch.Tensor:
    """`rescaled` as device multipliers [qs, m_a, m_b, m_c, m_w, m_l0] from the device maxima of |q| and |k|: the
    kernels evaluate kappa / lam with q * qs and, for their per-head coefficients, a * m_a (eps too), scale b * m_b,
    scale^2 C * m_c, scale w_m * m_w, L_0m * m_l0; all 1 when nothing needs rescaling (s_max <= max^(1/4)).
    The reference of what `triton.guard` computes in its last program."""
    _, s_limit = rescale_bound(dtype)
    s_max = abs(scale) * d * qmax * kmax
    one = torch.ones((), dtype=s_max.dtype, device=s_max.device)
    big = s_max > s_limit
    safe_q = torch.where(big, qmax, one)
    inv_s = torch.where(big, 1.0 / torch.where(big, s_max, one), one)
    ratio = safe_q * inv_s  # neither lam = s_max^2 nor max|q|^2 is formed: either can overflow
    return torch.stack([1.0 / safe_q, inv_s * inv_s, ratio * inv_s, ratio * ratio, ratio, inv_s])


_FACTOR_OK = WeakIdKeyDictionary()  # factor tensor -> (version, address) it was found finite for


def factor_checked(factor: torch.Tensor) -> None:
    """`max_abs("factor", ...)` once per factor tensor and version (as `groups_checked`): the decoding kernels read
    the coefficients built from it, not the factor."""
    key = version(factor)
    if _FACTOR_OK.get(factor) != key:
        max_abs("factor", factor)
        _FACTOR_OK[factor] = key


def start_decode(q, factor, initial_state, dtype: torch.dtype, eps: float, *, check_state=True, moments=True):
    """The checks of a call on the decoding kernels, which check q, k, v and their output themselves into the
    returned status buffer; the factor is read once per version, a state not the cache's own on the device.
    `factor` None: a plain sliding window (no kernel). `moments` False: the state is checked for NaN/Inf only (the
    sliding windows' state, whose layout is not OAL's). The cache's own state (not `check_state`): the status is
    `decode_check`'s shared one."""
    if factor is not None:
        factor_checked(factor)
    if not check_state:
        chk = decode_check(q.device, dtype, eps, factor is not None)
        return chk, chk.status
    chk = begin(q.device, dtype, eps, state_keys=factor is not None)
    from oal.ops.triton import guard

    if moments:
        _state_stats(guard, chk.status, initial_state, q.shape[-1])
    else:
        guard.launch(chk.status, [initial_state.detach()], first=4)
    return chk, chk.status


_PENDING: dict = collections.defaultdict(collections.deque)  # device -> deque of (event, host values, check)
_SHARED: dict = {}  # (device, dtype, eps, state keys) -> the DeviceCheck decoding calls share (`decode_check`)


def decode_check(device, dtype: torch.dtype, eps: float, state_keys: bool) -> DeviceCheck:
    """The check of a decoding call on the cache's own state, after reading earlier calls' checks (`drain`): one
    status buffer for DECODE_SHARED calls of the same device, dtype and eps (the kernels write their checks by
    atomic max, so the calls' flags and maxima add up), copied to the host by the last of them (`finish`)."""
    drain(device)
    key = (str(device), dtype, float(eps), state_keys)
    chk = _SHARED.get(key)
    if chk is None:
        chk = _SHARED[key] = DeviceCheck(torch.device(device), dtype, float(eps), _status(device), state_keys, key)
    return chk


def finish(chk: DeviceCheck, out: torch.Tensor | None = None) -> None:
    """Check the output (unless the kernels did: decoding) and copy the status to the host without waiting (a
    shared status: once DECODE_SHARED calls wrote into it)."""
    if out is not None:
        from oal.ops.triton import guard

        guard.launch(chk.status, [out.detach()], first=guard.OUT)
    if chk.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return  # inside a CUDA graph capture: no host copy can be recorded (the checks are not reported there)
    if chk.shared is not None:
        chk.calls += 1
        if chk.calls < DECODE_SHARED:
            return
        _SHARED.pop(chk.shared, None)
    _enqueue(chk)


def _flush_shared(device: str) -> None:
    """Send the shared decoding checks of `device` to the host now (`check_errors`)."""
    for key in [key for key in _SHARED if key[0] == device]:
        _enqueue(_SHARED.pop(key))


def _enqueue(chk: DeviceCheck) -> None:
    event = None
    if chk.device.type == "cuda":
        host = torch.empty(chk.status.shape, dtype=chk.status.dtype, pin_memory=True)
        host.copy_(chk.status, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(chk.device))  # the stream of the copy (q's device may not be current)
    else:  # a device whose memory the host reads directly (the tests' CPU stand-in)
        host = chk.status
    _PENDING[str(chk.device)].append((event, host, chk))


def drain(device, wait: bool = False) -> None:
    """Read the checks of earlier calls on `device` whose results have arrived (all of them with `wait`, and the
    oldest when more than MAX_PENDING are outstanding); raise the first error found."""
    if wait:
        _flush_shared(str(device))
    queue = _PENDING.get(str(device))
    while queue:
        event, host, chk = queue[0]
        if event is not None and not event.query():
            if not wait and len(queue) <= MAX_PENDING:
                return
            event.synchronize()
        queue.popleft()
        _inspect(host.numpy().tolist(), chk)  # host memory: no device read


def check_errors(device=None) -> None:
    """Wait for every outstanding device check (of `device`, or all devices) and raise the first error found.
    Call it where a late error would be too late: after the last operator call of a run, in tests."""
    for key in [str(torch.device(device))] if device is not None else {*_PENDING, *(k[0] for k in _SHARED)}:
        drain(key, wait=True)


def _inspect(vals: list, chk: DeviceCheck) -> None:
    """Raise the first error `vals` (the status slots of `triton.guard`) show, in the order of the host checks."""
    where = f" (found on {chk.device} after an earlier call: the device checks report late, see oal.ops.checks)"
    for name, slot in (("q", 1), ("k", 3), ("v", 5), ("factor", 7), ("initial_state", 9)):
        if vals[slot]:
            raise ValueError(f"{name}: contains NaN or Inf values{where}")
    if vals[10] > 0:  # a negative token count or sum of squares (the moments were negated)
        raise ValueError(f"initial_state: its denominator column (index dv) must hold key moments (token count >= 0, "
                         f"sums of squares k_r^2 >= 0), got one down to {-vals[10]:.4g}; pass the state a previous "
                         f"call returned{where}")
    if chk.state_keys and vals[2] * vals[2] > rescale_bound(chk.dtype)[0]:
        raise ValueError(_k_overflow_message(vals[2], chk.dtype) + where)
    if vals[13]:
        raise ValueError(out_message(chk.eps, chk.dtype) + where)
