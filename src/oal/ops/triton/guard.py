"""The value checks of the Triton path on the device (`oal.ops.checks`) in one launch, and the rescale multipliers.

`_guard` reads up to six tensors, a block of BLOCK entries per program: for each, the largest finite |x| and
whether any entry is NaN or Inf, into STATUS by atomic max (the buffer starts at zero; both values are >= 0). A
tensor marked signed contributes its largest x instead of |x| (the negated moments of a state's denominator
column: above 0 when a token count or a sum of squares is negative). The program that finishes last (a ticket
counter) computes the overflow multipliers of `checks.device_rescale` from the maxima of q and k into MULT.

STATUS slots (`SLOTS`): per checked tensor (max, non-finite) at 2 i, i in q, k, v, factor, initial state; the
negated moments at 10 (11 unused); the output at 12, 13; ticket counters at 14, 15; MULT = STATUS[16:22]. The
decoding kernels (`decode.py`) write their own checks into the same slots.
"""

from __future__ import annotations

import triton
import triton.language as tl

from oal.ops.triton.launch import Launch
from oal.ops.triton.tiles import cdiv

BLOCK = 4096
SLOTS = 22
MULT = 16  # where the multipliers start
OUT = 6  # the slot pair of the output


@triton.jit
def _block_stats(X, n, blk, S, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    finite = x - x == 0.0
    val = x if SIGNED else tl.abs(x)
    tl.atomic_max(S, tl.max(tl.where(mask & finite, val, 0.0), axis=0))
    tl.atomic_max(S + 1, tl.max(tl.where(mask & ~finite, 1.0, 0.0), axis=0))


# the sizes are run-time values: one compiled variant whatever the tensors (no specialisation on 1 or multiples of 16)
@triton.jit(do_not_specialize=["n0", "n1", "n2", "n3", "n4", "n5", "c1", "c2", "c3", "c4", "c5", "total", "d"])
def _guard(
    X0, X1, X2, X3, X4, X5, n0, n1, n2, n3, n4, n5, STATUS, c1, c2, c3, c4, c5, total, scale_abs, d, s_limit,
    FIRST: tl.constexpr, TICKET: tl.constexpr, MULTS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Grid (total,): programs [c_i, c_{i+1}) take tensor i (c0 = 0). FIRST: the slot pair of X0 (the others
    follow); X5 is signed. With MULTS, the last program writes the multipliers."""
    pid = tl.program_id(0)
    if pid < c1:
        _block_stats(X0, n0, pid, STATUS + 2 * FIRST, False, BLOCK)
    elif pid < c2:
        _block_stats(X1, n1, pid - c1, STATUS + 2 * FIRST + 2, False, BLOCK)
    elif pid < c3:
        _block_stats(X2, n2, pid - c2, STATUS + 2 * FIRST + 4, False, BLOCK)
    elif pid < c4:
        _block_stats(X3, n3, pid - c3, STATUS + 2 * FIRST + 6, False, BLOCK)
    elif pid < c5:
        _block_stats(X4, n4, pid - c4, STATUS + 2 * FIRST + 8, False, BLOCK)
    else:
        _block_stats(X5, n5, pid - c5, STATUS + 10, True, BLOCK)
    if MULTS:
        if tl.atomic_add(STATUS + TICKET, 1.0) == total - 1:  # the last program: every maximum is in
            qmax = tl.atomic_max(STATUS + 0, 0.0)  # atomic reads (the values are >= 0: unchanged)
            kmax = tl.atomic_max(STATUS + 2, 0.0)
            s_max = scale_abs * d * qmax * kmax
            big = s_max > s_limit
            safe_q = tl.where(big, qmax, 1.0)
            inv_s = tl.where(big, 1.0 / tl.where(big, s_max, 1.0), 1.0)
            ratio = safe_q * inv_s  # neither lam = s_max^2 nor max|q|^2 is formed: either can overflow
            tl.store(STATUS + 16, 1.0 / safe_q)
            tl.store(STATUS + 17, inv_s * inv_s)
            tl.store(STATUS + 18, ratio * inv_s)
            tl.store(STATUS + 19, ratio * ratio)
            tl.store(STATUS + 20, ratio)
            tl.store(STATUS + 21, inv_s)


@triton.jit
def flag_out(STATUS, out, mask):
    """A forward kernel's own output check (`checks.finish`'s, in the kernel's launch): the output's non-finite
    slot (13) set where the values as stored (`out`, in the output's dtype) hold NaN or Inf."""
    zero = tl.sum(tl.sum(tl.where(mask, out.to(tl.float32) * 0.0, 0.0), axis=1), axis=0)  # NaN iff one was not finite
    if zero != 0.0:
        tl.atomic_max(STATUS + 13, 1.0)


def _scalars(sizes, first: int, scale: float, d: int, s_limit: float, mults: bool) -> tuple[int, tuple, dict]:
    """(programs, the scalars after STATUS, the constexprs) of a `_guard` launch over tensors of `sizes`."""
    blocks = [cdiv(n, BLOCK) for n in sizes]
    total = sum(blocks)
    bounds = tuple(sum(blocks[: i + 1]) for i in range(5))
    meta = dict(FIRST=first, TICKET=14 if mults else 15, MULTS=mults, BLOCK=BLOCK)
    return total, (*bounds, total, abs(scale), d, s_limit), meta


class Site:
    """The guard's launch for tensors of fixed sizes (at most five, in slot pairs from `first`, and the signed
    sixth: `sizes`), its grid and scalars worked out once: a prefill plan keeps one (`oal.ops.triton.prefill`), and
    launches it directly with OAL_TRITON_DIRECT_LAUNCH=1 (`launch.Launch`). With `mults`, the last program also
    writes the multipliers (q and k must be the first two of `first` = 0)."""

    def __init__(self, sizes, *, first: int, scale: float = 1.0, d: int = 1, s_limit: float = 0.0,
                 mults: bool = False):
        self.sizes = tuple(sizes)
        self.total, self.tail, meta = _scalars(self.sizes, first, scale, d, s_limit, mults)
        self.launch = Launch((self.total,), meta)

    def __call__(self, status, tensors) -> None:
        """`tensors`: six flat tensors or None (in `sizes`' order)."""
        if self.total:
            self.launch(_guard, *(t if t is not None else status for t in tensors), *self.sizes, status, *self.tail)


def launch(status, tensors, *, first: int, signed=None, scale: float = 1.0, d: int = 1, s_limit: float = 0.0,
           mults: bool = False) -> None:
    """Check `tensors` (at most five, in slot pairs from `first`) and `signed` (the negated moments, or None) into
    `status`; with `mults`, also the multipliers (q and k must be the first two of `first` = 0). A one-off launch:
    a plan keeps a `Site` instead."""
    present = [t.reshape(-1) for t in tensors] + [None] * (5 - len(tensors))
    present.append(None if signed is None else signed.reshape(-1))
    sizes = [0 if t is None else t.numel() for t in present]
    total, tail, meta = _scalars(sizes, first, scale, d, s_limit, mults)
    if total:
        _guard[(total,)](*(t if t is not None else status for t in present), *sizes, status, *tail, **meta)
