"""Kernel calibration by output matching (paper Eq. 20, App. B "Coefficient calibration").

For one layer, the trainable parameters of an attention method are fitted so that its normalised causal output
matches the frozen softmax output on captured post-RoPE q, k, v:

    L* = argmin_L  1/(2|C|) sum_x sum_i || y_i(L; x) - y_i^softmax(x) ||^2                    (Eq. 20)

Protocol (App. B): Adam (lr 0.02, no scheduler, fp32), gradient-norm clip 10, up to 1000 updates per
initialisation; each update samples one training sequence and 32 causal query positions; validation every
100 updates; early stop after 400 updates without improvement; the best checkpoint is kept per head, and the
final parameters are chosen per head across initialisations by validation MSE.

Batching: heads are independent, so all heads of a layer *and* all initialisations run as one method with
I*Hq query heads (initialisation i owns heads [i*Hq, (i+1)*Hq) and KV heads [i*Hkv, (i+1)*Hkv)). The loss is
the sum of the per-head Eq. 20 objectives (1/2 the squared error summed over the sampled queries), gradient
clipping is per head, and each head keeps its own best
checkpoint and early-stopping clock ("stopped" heads get zero gradients). `calibrate_layer_sequential` runs the
same loop one head at a time; with the same seed both give the same per-head trajectories.

Encoders: with `LayerData.causal=False` every query sees every real key (Eq. 20 without the causal mask), and
`LayerData.mask` keeps padding out: padded keys get zero weight, and only real query positions are sampled and
scored.

Generic over methods: a tensor (parameter or buffer) whose first dimension equals the method's `n_heads` is
taken to be per query head (unless the method names it in `layer_shared`) and is sliced/tiled along that
dimension; any other trainable parameter is shared by
the layer, in which case the layer is one selection unit and only a single initialisation is allowed.
"""

from __future__ import annotations

import contextlib
import copy
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar

import torch
from torch import nn

from oal.calibration.data import CalibConfig, HeadResult, LayerCalibration, LayerData
from oal.calibration.loss import _val_mse, sampled_dense_output
from oal.methods.base import AttentionMethod

__all__ = ["calibrate_layer", "calibrate_layer_sequential", "calibrate_methods", "calibrate_oal_layer", "global_inits",
           "oal_inits", "on_step", "sampled_dense_output"]


# ----------------------------------------------------------------------------------------------- method surgery


def _per_head_names(method: AttentionMethod) -> tuple[set[str], set[str]]:
    """(per-head tensor names, shared trainable parameter names) by the first-dimension convention; the method's
    `layer_shared` tensors are the layer's whatever their shape (SpectraFormer's B, G, S when Hq equals their
    length)."""
    per_head, shared = set(), set()
    for name, t in list(method.named_parameters()) + list(method.named_buffers()):
        if t.dim() >= 1 and t.shape[0] == method.n_heads and name not in method.layer_shared:
            per_head.add(name)
        elif isinstance(t, nn.Parameter) and t.requires_grad:
            shared.add(name)
    return per_head, shared


def _set_tensor(module: nn.Module, name: str, value: torch.Tensor) -> None:
    *path, leaf = name.split(".")
    for p in path:
        module = getattr(module, p)
    if leaf in module._parameters:
        module._parameters[leaf] = nn.Parameter(value, requires_grad=module._parameters[leaf].requires_grad)
    else:
        module._buffers[leaf] = value


def _restructure(method, n_heads, n_kv, make: Callable[[str, torch.Tensor], torch.Tensor]) -> AttentionMethod:
    new = copy.deepcopy(method)
    per_head, _ = _per_head_names(method)
    for name, t in list(method.named_parameters()) + list(method.named_buffers()):
        if name in per_head:
            _set_tensor(new, name, make(name, t.detach()).clone())
    new.n_heads, new.n_kv_heads = n_heads, n_kv
    return new


def _fold(methods: Sequence[AttentionMethod]) -> AttentionMethod:
    """One method with I*Hq heads from I copies (initialisations) of the same layer's method."""
    base = methods[0]
    tensors = [dict(list(m.named_parameters()) + list(m.named_buffers())) for m in methods]
    return _restructure(base, base.n_heads * len(methods), base.n_kv_heads * len(methods),
                        lambda name, _t: torch.cat([t[name].detach() for t in tensors]))


def _head(method: AttentionMethod, h: int) -> AttentionMethod:
    """The single-head method of query head h (KV head h // rep)."""
    return _restructure(method, 1, 1, lambda _name, t: t[h : h + 1])


# ----------------------------------------------------------------------------------------------- the loop


_on_step: ContextVar[Callable[[str, int, int], None] | None] = ContextVar("oal_calibration_on_step", default=None)


@contextlib.contextmanager
def on_step(callback: Callable[[str, int, int], None]) -> Iterator[None]:
    """Within it, `callback(method name, step, max_steps)` follows every optimiser step of the fits: a progress
    bar inside a layer, which takes minutes on a real model."""
    token = _on_step.set(callback)
    try:
        yield
    finally:
        _on_step.reset(token)


def _optimize(method: AttentionMethod, train: LayerData, val: LayerData, cfg: CalibConfig, per_head: bool,
              n_copies: int = 1):
    """Run the protocol on `method` (already folded/sliced; `n_copies` stacked initialisations of the data's
    heads). Units are heads (`per_head`), or 1 for shared parameters (said, not inferred from the unit count: a
    one-head layer's shared parameters were taken per head and failed with an IndexError).

    Returns (best_params {name: tensor}, best_val [U], best_step [U], steps [U], curves [U] of [step, val, train]).
    """
    params = {n: p for n, p in method.named_parameters() if p.requires_grad}
    if not params:
        raise ValueError(f"method: {method.name!r} has no trainable parameters to calibrate")
    n_units = method.n_heads if per_head else 1
    opt = torch.optim.Adam(params.values(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed)
    n_seq, _, n_tok, _ = train.q.shape
    n_q = min(cfg.queries, n_tok)

    def unit_val():  # on the CPU, like the rest of the bookkeeping (stopped, steps), also when the data is on a GPU
        v = _val_mse(method, val, n_copies).detach().cpu()
        return v if per_head else v.mean().reshape(1)

    best = {n: p.detach().clone() for n, p in params.items()}
    best_val = unit_val()
    best_val = torch.where(torch.isfinite(best_val), best_val, torch.full_like(best_val, math.inf))
    best_step = torch.zeros(n_units, dtype=torch.long)
    steps = torch.zeros(n_units, dtype=torch.long)
    stopped = torch.zeros(n_units, dtype=torch.bool)
    curves: list[list[list[float]]] = [[[0, float(best_val[u]), math.nan]] for u in range(n_units)]
    train_sum = torch.zeros(n_units, dtype=torch.float64, device=train.q.device)  # read at validations only
    train_count = 0
    report = _on_step.get()
    for step in range(1, cfg.max_steps + 1):
        s = int(torch.randint(n_seq, (1,), generator=gen))
        key_mask = None if train.mask is None else train.mask[s : s + 1]
        if key_mask is None:
            pos = torch.randperm(n_tok, generator=gen)[:n_q].sort().values.to(train.q.device)
        else:  # real tokens only
            real = key_mask[0].nonzero().flatten()
            pos = real[torch.randperm(real.numel(), generator=gen)[:n_q].to(real.device)].sort().values
        pred = sampled_dense_output(method, train.q[s : s + 1], train.k[s : s + 1], train.v[s : s + 1], pos,
                                    n_copies, causal=train.causal, key_mask=key_mask)
        target = train.out[s : s + 1, :, pos].repeat(1, n_copies, 1, 1)
        sq = (pred - target).square()
        # Eq. 20 on the sampled queries: 1/2 sum_i ||y_i(L) - y_i^softmax||^2 per head (a sum over queries and
        # output dims, not a mean: the gradient-norm clip at 10 is set for this scale; with a per-head mean the
        # gradient norms stay far below 10 and the clip never acts). Curves report the per-head MSE.
        loss = 0.5 * sq.sum(dim=(0, 2, 3))  # [I*H]
        err = sq.detach().mean(dim=(0, 2, 3))
        loss_units = loss if per_head else loss.sum().reshape(1)
        opt.zero_grad(set_to_none=False)
        loss_units.sum().backward()
        with torch.no_grad():
            _clip_and_mask(params, stopped, cfg.clip_norm, per_head)
            opt.step()
            if report is not None:
                report(method.name, step, cfg.max_steps)
            active = ~stopped
            steps[active] = step
            train_sum += (err if per_head else err.mean().reshape(1)).double().nan_to_num(math.inf)
            train_count += 1
            if step % cfg.val_every == 0 or step == cfg.max_steps:
                cur = unit_val()
                improved = active & torch.isfinite(cur) & (cur < best_val)
                best_val = torch.where(improved, cur, best_val)
                best_step[improved] = step
                for n, p in params.items():
                    if per_head:
                        best[n][improved] = p[improved]
                    elif bool(improved[0]):
                        best[n].copy_(p)
                tr = (train_sum / train_count).cpu()
                for u in torch.nonzero(active).flatten().tolist():
                    curves[u].append([step, float(cur[u]), float(tr[u])])
                train_sum.zero_()
                train_count = 0
                stopped |= active & ((step - best_step) >= cfg.patience)
                stopped |= ~torch.isfinite(cur)
                if bool(stopped.all()):
                    break
    return best, best_val, best_step, steps, curves


def _clip_and_mask(params, stopped, clip_norm, per_head):
    """Per-unit gradient-norm clipping (clip 10 per head, as if each head were optimised alone); stopped units
    get zero gradient."""
    grads = [p.grad for p in params.values()]
    for g in grads:
        g.nan_to_num_(0.0, 0.0, 0.0)
    if per_head:
        sq = sum(g.reshape(g.shape[0], -1).square().sum(1) for g in grads)
        coef = (clip_norm / (sq.sqrt() + 1e-6)).clamp(max=1.0) * (~stopped).to(device=sq.device, dtype=sq.dtype)
        for g in grads:
            g.mul_(coef.view(-1, *([1] * (g.dim() - 1))))
    else:
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        coef = 0.0 if bool(stopped[0]) else (clip_norm / (norm + 1e-6)).clamp(max=1.0)  # no host read
        for g in grads:
            g.mul_(coef)


# ----------------------------------------------------------------------------------------------- public entry points


def _prepare(method, inits, train, val, cfg):
    dtype = cfg.torch_dtype
    train, val = train.to(dtype), val.to(dtype)
    # sequence lengths may differ (padded encoder passages); heads and head size may not
    if train.q.shape[1::2] != val.q.shape[1::2] or train.q.shape[1] != method.n_heads:
        raise ValueError(f"train/val: expected {method.n_heads} query heads with matching shapes, got "
                         f"{tuple(train.q.shape)} / {tuple(val.q.shape)}")
    if train.k.shape[1] != method.n_kv_heads:
        raise ValueError(f"train: expected {method.n_kv_heads} KV heads, got {train.k.shape[1]}")
    for name in ("k", "v"):  # the GQA map and value size come from train: val must share them
        a, b = getattr(train, name).shape, getattr(val, name).shape
        if a[1::2] != b[1::2]:
            raise ValueError(f"val: expected {name} of {a[1]} heads of size {a[3]} as in train, got {tuple(b)}")
    inits = dict(inits) if inits else {"default": {}}
    copies = {}
    for name, values in inits.items():
        # the stage's boundary: the copies that train live where the captured data lives (parameters and buffers:
        # random features and projections too); `_select` brings the chosen values back to `method`'s device
        m = copy.deepcopy(method).to(device=train.q.device, dtype=dtype)
        named = dict(m.named_parameters())
        with torch.no_grad():
            for pname, value in values.items():
                if pname not in named or named[pname].shape != value.shape:
                    got = tuple(value.shape)
                    raise ValueError(f"inits[{name!r}]: parameter {pname!r} missing or shape {got} does not match")
                named[pname].copy_(value.to(dtype))
        copies[name] = m
    _, shared = _per_head_names(method)
    if shared and len(copies) > 1:
        raise ValueError(f"inits: method {method.name!r} shares parameters {sorted(shared)} across heads; "
                         "only a single initialisation is supported")
    return train, val, copies, not shared


def _select(method, layer, copies, results, per_head, t0) -> LayerCalibration:
    """Pick per head (or per layer) the initialisation with the lowest validation MSE."""
    names = list(copies)
    vals = torch.stack([results[n][1] for n in names])  # [I, U]
    choice = vals.argmin(0)
    params = {}
    for pname, p in method.named_parameters():
        if not p.requires_grad:
            continue
        stacked = torch.stack([results[n][0][pname] for n in names])  # [I, ...]
        if per_head:
            params[pname] = stacked[choice.to(stacked.device), torch.arange(stacked.shape[1], device=stacked.device)]
        else:
            params[pname] = stacked[int(choice[0])]
        params[pname] = params[pname].to(device=p.device, dtype=p.dtype)
    heads = []
    for u in range(vals.shape[1]):
        i = names[int(choice[u])]
        _, best_val, best_step, steps, curves = results[i]
        heads.append(HeadResult(
            head=u if per_head else -1, init=i, val_mse=float(best_val[u]), best_step=int(best_step[u]),
            steps=int(steps[u]), val_mse_by_init={n: float(results[n][1][u]) for n in names},
            curves={n: results[n][4][u] for n in names},
        ))
    return LayerCalibration(layer, method.name, params, heads, time.perf_counter() - t0, per_head)


def calibrate_layer(method: AttentionMethod, train: LayerData, val: LayerData, cfg: CalibConfig | None = None,
                    inits: Mapping[str, Mapping[str, torch.Tensor]] | None = None, *, layer: int | None = None,
                    ) -> LayerCalibration:
    """Batched calibration of one layer: all heads and all initialisations in one tensor program.

    `inits` maps an initialisation name to parameter values (name -> tensor in the method's shapes); omitted:
    the method's current parameters as the single initialisation. `method` itself is not modified; use
    `result.apply(method)`.
    """
    cfg = cfg or CalibConfig()
    t0 = time.perf_counter()
    train, val, copies, per_head = _prepare(method, inits, train, val, cfg)
    n_init, hq = len(copies), method.n_heads
    folded = _fold(list(copies.values())) if n_init > 1 else next(iter(copies.values()))
    best, best_val, best_step, steps, curves = _optimize(folded, train, val, cfg, per_head, n_init)
    results = {}
    for i, name in enumerate(copies):
        sl = slice(i * hq, (i + 1) * hq) if per_head else slice(0, 1)
        p_i = {n: (t[i * hq : (i + 1) * hq] if per_head else t) for n, t in best.items()}
        results[name] = (p_i, best_val[sl], best_step[sl], steps[sl], curves[sl])
    return _select(method, method.layer_idx if layer is None else layer, copies, results, per_head, t0)


def calibrate_layer_sequential(method: AttentionMethod, train: LayerData, val: LayerData,
                               cfg: CalibConfig | None = None, inits=None, *, layer: int | None = None,
                               ) -> LayerCalibration:
    """Reference: the same protocol, one initialisation and one head at a time (for tests and the benchmark)."""
    cfg = cfg or CalibConfig()
    t0 = time.perf_counter()
    train, val, copies, per_head = _prepare(method, inits, train, val, cfg)
    results = {}
    for name, m in copies.items():
        if not per_head:
            results[name] = _optimize(m, train, val, cfg, False)
            continue
        outs = [_optimize(_head(m, h), train.head(h, m.n_rep), val.head(h, m.n_rep), cfg, True)
                for h in range(m.n_heads)]
        best = {n: torch.cat([o[0][n] for o in outs]) for n in outs[0][0]}
        results[name] = (best, *(torch.cat([o[j] for o in outs]) for j in (1, 2, 3)),
                         [o[4][0] for o in outs])
    return _select(method, method.layer_idx if layer is None else layer, copies, results, per_head, t0)


# ----------------------------------------------------------------------------------------------- OAL and global


def global_inits(n_heads: int, cfg: CalibConfig) -> dict[str, dict[str, torch.Tensor]]:
    """Three starts for the learned global quadratic (G = 1), our choice (App. B leaves them open):
    Taylor 1 + s + s^2/2; the steeper quadratic 1 + s + s^2; Taylor with Gaussian perturbation."""
    from oal.ops.kernel import learned_global_from_coefficients, perturbed_factor, taylor_factor

    taylor = taylor_factor(n_heads, 1)
    steep = learned_global_from_coefficients(1.0, 1.0, 1.0).expand(n_heads, 2, 2).clone()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    return {"taylor": {"factor": taylor}, "quadratic": {"factor": steep},
            "taylor_perturbed": {"factor": perturbed_factor(taylor, cfg.perturb_std, gen)}}


def oal_inits(global_factor: torch.Tensor, n_groups: int, cfg: CalibConfig) -> dict[str, dict[str, torch.Tensor]]:
    """App. B's three OAL starts: learned global embedded, Taylor, learned global + Gaussian perturbation."""
    from oal.ops.kernel import global_embedded_factor, perturbed_factor, taylor_factor

    emb = global_embedded_factor(global_factor.detach().float(), n_groups)
    gen = torch.Generator().manual_seed(cfg.seed + 2)
    return {"global_embedded": {"factor": emb}, "taylor": {"factor": taylor_factor(emb.shape[0], n_groups)},
            "global_perturbed": {"factor": perturbed_factor(emb, cfg.perturb_std, gen)}}


def calibrate_oal_layer(train: LayerData, val: LayerData, groups: torch.Tensor, cfg: CalibConfig | None = None,
                        *, layer: int = 0, eps: float = 1e-6, sequential: bool = False,
                        pair: tuple[str, str] = ("global", "oal"), settings: Mapping | None = None,
                        ) -> tuple[LayerCalibration, LayerCalibration]:
    """The learned global baseline first (3 inits), then OAL (3 inits, one seeded by the global result).

    Returns (global, oal) calibrations; `groups` [Hq, d] are the layer's fixed dimension groups. `pair`
    ("global-swa", "oal-swa") with `settings` {"window": W} runs the same protocol for the sliding-window hybrid,
    each start fitted to softmax by the hybrid's own output (window and kernel together).
    """
    from oal.methods import build_method

    cfg = cfg or CalibConfig()
    hq, hkv, d = train.q.shape[1], train.k.shape[1], train.q.shape[-1]
    groups = torch.as_tensor(groups, dtype=torch.long)
    if groups.shape != (hq, d):
        raise ValueError(f"groups: expected shape [{hq}, {d}], got {tuple(groups.shape)}")
    run = calibrate_layer_sequential if sequential else calibrate_layer
    settings = dict(settings or {})
    glob = build_method(pair[0], hq, hkv, d, eps=eps, layer_idx=layer, **settings)
    g_res = run(glob, train, val, cfg, global_inits(hq, cfg), layer=layer)
    n_groups = int(groups.max()) + 1
    oal = build_method(pair[1], hq, hkv, d, groups=groups, n_groups=n_groups, eps=eps, layer_idx=layer, **settings)
    o_res = run(oal, train, val, cfg, oal_inits(g_res.params["factor"], n_groups, cfg), layer=layer)
    return g_res, o_res


def calibrate_methods(names: Sequence[str], train: LayerData, val: LayerData, *, layer: int,
                      groups: torch.Tensor | None = None, cfg: CalibConfig | None = None, seed: int = 0,
                      options: Mapping | None = None,
                      ) -> dict[str, tuple[AttentionMethod, LayerCalibration | None]]:
    """Build and calibrate every method of `names` on one layer's frozen data: the one driver behind `oal run`,
    `oal calibrate` and `oal diagnose`.

    `oal` and `oal-swa` need `groups` [Hq, d]. As in App. B the learned global is calibrated first, and it seeds
    one of OAL's three starts; the hybrid oal-swa is seeded the same way by its own G = 1 control global-swa
    (whose kernel, like the hybrid's, is weighed against the window's e^s, so the scale it learned carries over).
    `options`: the run's method settings ({"window": W, "sinks": S}); each method takes those it has
    (`AttentionMethod.settings`). A method without trainable parameters is returned as built, with None for its
    calibration. The methods are returned on the data's device.
    """
    from oal.methods import build_method, get_method
    from oal.methods.base import method_settings

    cfg = cfg or CalibConfig()
    hq, hkv, d = train.q.shape[1], train.k.shape[1], train.q.shape[-1]
    for name in names:
        if get_method(name).positional and not train.causal:
            raise ValueError(f"methods: {name!r} is a causal sliding window; this layer's data is non-causal")
    results: dict[str, LayerCalibration] = {}
    for glob_name, oal_name in (("global", "oal"), ("global-swa", "oal-swa")):
        settings = method_settings(glob_name, options)
        if oal_name in names:
            if groups is None:
                raise ValueError(f"groups: layer {layer} needs groups for {oal_name!r}")
            results[glob_name], results[oal_name] = calibrate_oal_layer(
                train, val, groups, cfg, layer=layer, pair=(glob_name, oal_name), settings=settings)
        elif glob_name in names:
            glob = build_method(glob_name, hq, hkv, d, layer_idx=layer, seed=seed, **settings)
            results[glob_name] = calibrate_layer(glob, train, val, cfg, global_inits(hq, cfg), layer=layer)
    out = {}
    for name in names:
        kwargs = method_settings(name, options)
        if get_method(name).uses_groups:
            kwargs.update(groups=groups, n_groups=int(groups.max()) + 1)
        # built where the layer's data lives, as a stage's methods are (random features and projections included)
        method = build_method(name, hq, hkv, d, layer_idx=layer, seed=seed, **kwargs).to(train.q.device)
        res = results.get(name)
        if res is None and method.trainable:
            res = calibrate_layer(method, train, val, cfg, layer=layer)
        if res is not None:
            res.apply(method)
        out[name] = (method.eval(), res)
    return out
