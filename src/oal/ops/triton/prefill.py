"""A fresh sequence's forward on the parallel kernels, without a gradient, worked out once per signature.

What `triton_forward` works out on every call of this route (the dtypes, the tiles, the per-head coefficients, the
constants, the guard's grid and sizes, `_par_fwd`'s grid and meta) depends only on the call's signature
(`oal.ops.plans.fresh`: shapes, dtypes, device, the kernel tensors' versions, the options). A model's
forward at a length it has seen, a benchmark, an evaluation at a fixed length repeat it: the second call in a row at
a length keeps a `Plan` per kernel (`oal.ops.plans`), and the next calls of the same signature run it. A call is
then the guard's launch (the inputs' checks and the overflow multipliers), `_par_fwd`'s launch (which checks its
output and rescales itself) and the status buffer, as on the full path, with none of the host work around them; with
OAL_TRITON_DIRECT_LAUNCH=1 both launches go through the compiled kernels' own launchers (`launch.Launch`).
"""

from __future__ import annotations

from oal.ops import checks
from oal.ops.triton import guard, parallel
from oal.ops.triton.function import CHUNK, _cached_params, _constant, _consts, _gmax, config, layout


class Plan:
    """The parallel route's forward for one signature: `plan(q, k, v, factor, chk)` -> out, with q, k, v contiguous
    and `chk` the call's device check (`checks.begin`). The coefficients are those of the kernel tensors' versions
    in the signature."""

    def __init__(self, q, k, v, groups, factor, eps: float, scale: float):
        d, dv = q.shape[-1], v.shape[-1]
        cfg = config(q, factor, CHUNK)
        acc = cfg.acc_dtype
        _, _, _, self.ws, self.l0 = _cached_params(factor, groups, eps, scale, layout(d), acc)
        self.eps_t = _constant(eps, acc, q.device)
        consts = parallel._consts(q, v, _consts(cfg, "fwd", d, dv), _gmax(cfg.n_groups1))
        self.guard = guard.Site((q.numel(), k.numel(), v.numel(), factor.numel(), 0, 0), first=0, scale=scale, d=d,
                                s_limit=checks.rescale_bound(acc)[1], mults=True)
        self.forward = parallel.Forward(q, v, consts, self.ws.shape[1], acc, check=True)

    def __call__(self, q, k, v, factor, chk: checks.DeviceCheck):
        status = chk.status
        self.guard(status, (q.view(-1), k.view(-1), v.view(-1), factor.reshape(-1), None, None))  # no gradient here
        mult = status[guard.MULT : guard.MULT + 6]
        return self.forward(q, k, v, self.ws, self.l0, self.eps_t, mult, status)[0]
