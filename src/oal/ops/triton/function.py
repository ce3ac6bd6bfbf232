"""Host side of the Triton operator: coefficient tensors, state layouts, launches and the autograd Function.

Which kernels run (`triton_forward`, decided by `routes.py`): the decoding kernels (`decode.py`) for a few tokens on
a state, the parallel kernels (`parallel.py`) for a short fresh sequence, the chunked form below for the rest.

Chunked forward (causal):
  1. state scan: per-chunk prefix states of every KV head (`_state_scan`, keys mode). The sequence is split into
     segments so that enough programs run when B * Hkv is small: a first pass sums each segment, a second pass
     starts from the sums of the segments before it (added in the kernel) and stores the state before each chunk.
  2. output: intra-chunk Eq. 7 plus the readout of the chunk's prefix state (`_fwd_out`).
Backward: the states are recomputed (1.), the output gradient is divided by the normaliser, `_bwd_dq` gives dq
and the coefficient gradients, a reverse scan in query mode gives each chunk's state gradient, and `_bwd_dkv`
gives dk and dv. Coefficient gradients flow back to the factor through torch (`coefficients`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache, lru_cache

import torch
from torch.utils.weak import WeakIdKeyDictionary

import oal.ops.triton.kernels as K
from oal.ops import checks
from oal.ops.kernel import coefficients, feature_dim, version
from oal.ops.triton import decode, guard, parallel, routes
from oal.ops.triton.layout import (  # noqa: F401  (re-exported: the tests and scripts use them from here)
    Layout,
    _maps,
    blocks_to_state,
    layout,
    state_to_blocks,
)
from oal.ops.triton.tiles import (  # noqa: F401  (SHARED_LIMIT: for the compile check)
    FWD_CANDIDATES,
    SHARED_LIMIT,
    device_arch,
    fwd_chunk,
    fwd_warps,
    next_pow2,
    tiles,
    tl_dtype,
)


def interpreted() -> bool:
    """Whether the kernels were defined under Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""
    return type(K._fwd_out).__name__ == "InterpretedFunction"


# Tokens per chunk: Hopper's tensor-core MMAs want M >= 64 (gpu-notes).
CHUNK = 64

# Chunks per segment of the state scans; None picks it from the device's multiprocessor count. Tests set it to
# exercise the carry between segments on short sequences.
SEGMENT_CHUNKS: int | None = None  # tiles: tiles.py (imported here so tests can replace them)


@dataclass(frozen=True)
class Config:
    n_groups1: int  # G + 1
    chunk: int
    dot_dtype: torch.dtype
    acc_dtype: torch.dtype
    arch: int  # tile table target (device_arch)
    # the per-chunk prefix states the keys scan stores for `_fwd_out` and `_bwd_dq`: bf16 for half inputs, whose
    # dots read them rounded to bf16 anyway (half the bytes of the chunked route's largest tensor), else acc_dtype
    state_dtype: torch.dtype
    half: bool  # fp16 or bf16 inputs
    fwd_chunk: int | None = None  # the forward kernels' chunk where it differs from `chunk` (tiles.fwd_chunk)


def _consts(cfg: Config, kernel: str, d: int, dv: int):
    """Compile-time arguments shared by all kernels, and the tiles and launch options of `kernel`."""
    half = cfg.dot_dtype in (torch.float16, torch.bfloat16)
    # fp32 dots as three tf32 products on the tensor cores (tf32x3: about fp32 accuracy; plain tf32 would give
    # ~3e-4), fp64 exactly; half inputs use bf16 operands with fp32 accumulation (the default)
    prec = None if half else "tf32x3" if cfg.dot_dtype == torch.float32 else "ieee"
    return dict(DOT_DT=tl_dtype(cfg.dot_dtype), ACC_DT=tl_dtype(cfg.acc_dtype), PREC=prec,
                **tiles(kernel, d, dv, half, cfg.arch, cfg.chunk))


def _norm_dot(cfg: Config) -> bool:
    """Whether the key scan and the output kernel sum the normaliser rows by a dot (`blocks._norm_cols`): for half
    inputs (under the interpreter too, whose dots are fp32) unless NORM_DOTS is off; else in registers."""
    return cfg.half and NORM_DOTS


def _prod_dt(cfg: Config):
    """The type of the output kernel's feature products q_r q_t C_rt: bf16 (two an instruction) for half inputs
    unless HALF_PRODUCTS is off, rounding q_r q_t and C_rt too (output error 1.16-1.60e-3 -> 1.43-1.90e-3 in
    `scripts/normaliser_rounding.py`); else the accumulation type (also under the interpreter, as its dots)."""
    return tl_dtype(cfg.dot_dtype if cfg.half and HALF_PRODUCTS else cfg.acc_dtype)


def _gmax(n_groups1: int) -> int:
    """Loop bound over the columns of L: G + 1 rounded up to 8, so one compiled variant serves G <= 7."""
    return 8 * -(-n_groups1 // 8)


def _segments(n_chunks: int, programs_per_segment: int, device: torch.device) -> tuple[int, int]:
    """(chunks per segment, segments). Enough programs to fill the device; one segment under the interpreter.

    The segment length is a power of four: it is a compile-time constant of `_state_scan` (a loop bound; the
    interpreter cannot loop to a run-time bound), so few variants are compiled: 1, 4, 16, 64.
    """
    if SEGMENT_CHUNKS is not None:
        seg_len = SEGMENT_CHUNKS
    elif device.type == "cuda":
        target = 4 * _multiprocessors(device)
        seg_len = -(-n_chunks // max(1, target // programs_per_segment))
    else:
        seg_len = n_chunks
    seg_len = 1 << 2 * ((max(1, min(seg_len, n_chunks)).bit_length() - 1) // 2)  # largest power of 4 <= it
    return seg_len, -(-n_chunks // seg_len)


@cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@cache
def _device_maps(d: int, device: torch.device):
    """`_maps(d)` on `device`, copied there once (a copy per call was a host-to-device transfer per call)."""
    return tuple(t.to(device) for t in _maps(d))


def _scan(x, y, nw, coefs, cfg: Config, lay: Layout, n_kv: int, *, query: bool, reverse: bool, carry, two_pass):
    """Run `_state_scan`. Returns (per-chunk states [B*Hkv, n_cs, R, dv], normaliser, segment ends, seg_len).

    n_cs = segments x chunks per segment >= the number of chunks; the chunks past the sequence are empty.
    The per-chunk states are in `cfg.state_dtype` in keys mode, fp32 in query mode (`_bwd_dkv` adds the carry to
    them before it rounds); their normaliser fp32 [.., R], or in keys mode with `_norm_dot` its dot operand's two
    columns ([.., R, 2] in the dot type, `_norm_store`). The segment ends are fp32 (acc_dtype).

    two_pass: the per-chunk states include everything before the segment (forward); otherwise they are local to
    their segment and the consumer adds the carry (backward).
    """
    bsz, n_x, n, _ = x.shape
    dv = y.shape[-1]
    n_c = -(-n // cfg.chunk)
    consts = _consts(cfg, "scan", lay.d, dv)
    blocks = lay.npair * (16 // consts["RH"]) + lay.nb + 1  # H2 steps, H1 blocks, H0
    seg_len, n_seg = _segments(n_c, blocks * bsz * n_kv, x.device)
    st_dtype = cfg.acc_dtype if query else cfg.state_dtype
    st = torch.empty(bsz * n_kv, n_seg * seg_len, lay.rows, dv, dtype=st_dtype, device=x.device)
    split = not query and _norm_dot(cfg)  # each normaliser row as `_norm_cols`'s two columns (`_norm_store`)
    stn = torch.empty(bsz * n_kv, n_seg * seg_len, lay.rows, *((2,) if split else ()),
                      dtype=cfg.dot_dtype if split else cfg.acc_dtype, device=x.device)
    tot = torch.empty(bsz * n_kv, n_seg, lay.rows, dv, dtype=cfg.acc_dtype, device=x.device)
    totn = torch.empty(bsz * n_kv, n_seg, lay.rows, dtype=cfg.acc_dtype, device=x.device)
    a, bs, cs = coefs
    pairs = _device_maps(lay.d, x.device)[0]
    bv = max(16, next_pow2(dv))
    init = carry if carry is not None else (tot, totn)  # placeholders where there is no initial state

    def launch(store, add_prev, out, outn, with_carry=carry is not None):
        K._state_scan[(blocks, n_seg, bsz * n_kv)](
            x, y, nw if nw is not None else y, a, bs, cs, pairs, st, stn, out, outn, *init, tot, totn,
            n, n_x, n_seg, lay.d, dv, lay.rows, int(store), int(with_carry), int(add_prev),
            NB=lay.nb, SEG=seg_len, REP=n_x // n_kv, C=cfg.chunk, BV=bv, NPAIR=lay.npair, QUERY=query,
            REVERSE=reverse, NORM_DOT=_norm_dot(cfg), **consts,
        )

    if not two_pass or n_seg == 1:
        launch(True, False, tot, totn)
        return st, stn, tot, totn, seg_len
    # pass 1: the segment sums; pass 2 starts each segment from the sums before it and writes the running totals
    launch(False, False, tot, totn, with_carry=False)
    run, runn = torch.empty_like(tot), torch.empty_like(totn)
    launch(True, True, run, runn)
    return st, stn, run, runn, seg_len


def _params(factor, groups, eps, scale, lay: Layout, acc_dtype):
    """Per-head coefficient tensors read by the kernels, differentiable in `factor` (Section 4.3)."""
    factor = factor.to(acc_dtype)
    a, b, c = coefficients(factor, groups, eps)
    pad = lay.d16 - lay.d
    bs = torch.nn.functional.pad(b * scale, (0, pad))
    cs = torch.nn.functional.pad(c * scale * scale, (0, pad, 0, pad))
    lower = torch.tril(factor)
    w = torch.gather(lower[:, 1:, :], 1, groups.long().unsqueeze(-1).expand(-1, -1, lower.shape[-1]))
    ws = torch.nn.functional.pad(w.transpose(1, 2) * scale, (0, lay.bd - lay.d))  # [Hq, G+1, BD]
    return a.contiguous(), bs.contiguous(), cs.contiguous(), ws.contiguous(), lower[:, 0, :].contiguous()


def _fwd_out(q, d: int, dv: int, cfg: Config):
    """`_fwd_out` and its compile-time arguments: autotuned over tiles.FWD_CANDIDATES on a GPU (the first call per
    head dims, G, dtypes and length bucket benchmarks them), the table's first entry under the interpreter."""
    consts = _consts(cfg, "fwd", d, dv)
    if q.device.type != "cuda":
        return K._fwd_out, consts
    half = cfg.dot_dtype in (torch.float16, torch.bfloat16)
    for name in ("RH", "num_warps", "num_stages"):
        del consts[name]
    return _tuned_fwd_out(half, max(d, dv) > 64, cfg.arch, cfg.chunk), consts


@cache
def _tuned_fwd_out(half: bool, big: bool, arch: int, chunk: int = CHUNK):
    """The autotuned output kernel, one per chunk size (whose warps differ: `tiles.fwd_warps`)."""
    import triton

    configs = [triton.Config({"RH": rh}, num_warps=fwd_warps(chunk), num_stages=st)
               for rh, st in FWD_CANDIDATES[half, big, arch]]
    return triton.autotune(configs, key=["d", "dv", "g1", "NBKT"], do_bench=parallel.short_bench)(K._fwd_out)


def tuning_record(d: int, dv: int, arch: int) -> dict:
    """The tiles the chunked kernels use for half-precision inputs of head dims (d, dv) on `arch`, and what the
    autotuners (the output kernel's, the parallel kernels') have picked in this process, per key: what a benchmark
    records beside its timings, so that a measurement says which tiles it measured."""
    big = max(d, dv) > 64
    chunk = fwd_chunk(True, big, arch, CHUNK) if FWD_CHUNKS else CHUNK
    tuners = {"fwd": _tuned_fwd_out(True, big, arch, chunk)}
    tuners |= {name: parallel.tuned(getattr(parallel, name), True, big) for name in ("_par_fwd", "_par_dq", "_par_dkv")}
    fwd = {"scan_fwd": tiles("scan", d, dv, True, arch, chunk),  # the forward's key scan and output kernel
           "fwd": dict(tiles("fwd", d, dv, True, arch, chunk), num_warps=fwd_warps(chunk))}
    return {"fwd_chunk": chunk, "chunk": CHUNK,
            "tiles": {kernel: tiles(kernel, d, dv, True, arch) for kernel in ("scan", "dq", "dkv")} | fwd,
            "autotuned": {name: {str(key): str(config) for key, config in tuner.cache.items()}
                          for name, tuner in tuners.items()}}


def _forward(q, k, v, a, bs, cs, ws, l0, eps_t, init, cfg: Config, lay: Layout, status, mult):
    """Forward of the chunked kernels: (out, normaliser, final state in block layout and its normaliser). `mult`:
    the overflow multipliers `_fwd_out` applies itself (`checks.device_rescale`; all 1 where the inputs come
    rescaled, as autograd's path needs them)."""
    bsz, n_q, n, d = q.shape
    n_kv, dv = k.shape[1], v.shape[-1]
    cfg = replace(cfg, chunk=cfg.fwd_chunk) if cfg.fwd_chunk else cfg  # the backward keeps `chunk`
    n_c = -(-n // cfg.chunk)
    st, stn, tot, totn, _ = _scan(k, v, None, (a, bs, cs), cfg, lay, n_kv, query=False, reverse=False,
                                  carry=init, two_pass=True)
    o = torch.empty(bsz, n_q, n, dv, dtype=q.dtype, device=q.device)
    den = torch.empty(bsz, n_q, n, dtype=cfg.acc_dtype, device=q.device)
    pairs = _device_maps(d, q.device)[0]
    kernel, consts = _fwd_out(q, d, dv, cfg)
    kernel[(n_q, n_c, bsz)](
        q, k, v, a, bs, cs, ws, l0, eps_t, mult, pairs, st, stn, o, den, eps_t if status is None else status, n, n_q,
        st.shape[1], d, dv, lay.rows, cfg.n_groups1, parallel.bucket(n),
        NB=lay.nb, REP=n_q // n_kv, C=cfg.chunk, BD=lay.bd, BV=max(16, next_pow2(dv)), NPAIR=lay.npair,
        GMAX=_gmax(cfg.n_groups1), CHECK=status is not None, NORM_DOT=_norm_dot(cfg), PROD_DT=_prod_dt(cfg),
        **consts,
    )
    return o, den, tot[:, -1], totn[:, -1]


def _backward(q, k, v, a, bs, cs, ws, l0, eps_t, init, o, den, do, dfin, cfg: Config, lay: Layout):
    bsz, n_q, n, d = q.shape
    n_kv, dv = k.shape[1], v.shape[-1]
    n_c = -(-n // cfg.chunk)
    bv = max(16, next_pow2(dv))
    consts = dict(NB=lay.nb, REP=n_q // n_kv, C=cfg.chunk, BD=lay.bd, BV=bv, NPAIR=lay.npair,
                  GMAX=_gmax(cfg.n_groups1))
    pairs = _device_maps(d, q.device)[0]
    do = do.to(cfg.acc_dtype)
    go = (do / den[..., None]).to(cfg.dot_dtype).contiguous()  # gradient of the numerator
    dl = ((do * o.to(cfg.acc_dtype)).sum(-1) / den).contiguous()  # minus the gradient of the normaliser
    st, stn, *_ = _scan(k, v, None, (a, bs, cs), cfg, lay, n_kv, query=False, reverse=False, carry=init,
                        two_pass=True)
    n_part = 1 + lay.d16 + 256 * lay.npair + cfg.n_groups1 * lay.bd + cfg.n_groups1
    part = torch.empty(bsz, n_c, n_q, n_part, dtype=cfg.acc_dtype, device=q.device)
    dq = torch.empty_like(q)
    K._bwd_dq[(n_q, n_c, bsz)](
        q, k, v, go, dl, bs, cs, ws, l0, pairs, st, stn, dq, part, n, n_q, n_c, st.shape[1], d, dv, lay.rows,
        n_part, cfg.n_groups1, **consts, **_consts(cfg, "dq", d, dv), NORM_DOT=_norm_dot(cfg)
    )
    del st, stn
    # state gradients: chunk c's readout sends phi(Q_c)^T [go, -dl] to every earlier key (reverse scan)
    gst, gstn, gtot, gtotn, seg_len = _scan(q, go, -dl, (a, bs, cs), cfg, lay, n_kv, query=True, reverse=True,
                                            carry=None, two_pass=False)
    # carry into segment s: the later segments' sums plus the gradient of the final state
    carry = torch.flip(torch.cumsum(torch.flip(gtot, [1]), 1), [1]) - gtot
    carryn = torch.flip(torch.cumsum(torch.flip(gtotn, [1]), 1), [1]) - gtotn
    if dfin is not None:
        carry, carryn = carry + dfin[0][:, None], carryn + dfin[1][:, None]
    dinit = None
    if init is not None:
        dinit = (carry[:, 0] + gtot[:, 0], carryn[:, 0] + gtotn[:, 0])
    dk, dv_ = torch.empty_like(k), torch.empty_like(v)
    n_seg = gtot.shape[1]
    K._bwd_dkv[(n_kv, n_c, bsz)](
        q, k, v, go, dl, ws, l0, eps_t, pairs, gst, gstn, carry.contiguous(), carryn.contiguous(), dk, dv_,
        n, n_q, gst.shape[1], seg_len, n_seg, d, dv, lay.rows, cfg.n_groups1, **consts,
        **_consts(cfg, "dkv", d, dv)
    )
    grads = _coef_grads(part.sum((0, 1)), cfg, lay)
    return dq, dk, dv_, grads, dinit


def _coef_grads(part: torch.Tensor, cfg: Config, lay: Layout):
    """Split the summed partials [Hq, P] into gradients shaped like (a, bs, cs, ws, l0)."""
    n_q, g1 = part.shape[0], cfg.n_groups1
    sizes = [1, lay.d16, 256 * lay.npair, g1 * lay.bd, g1]
    da, dbs, dcs_blocks, dws, dl0 = torch.split(part, sizes, dim=1)
    pairs = _maps(lay.d)[0].long()
    f = torch.arange(256)
    rr = (pairs[:, :1] * 16 + f // 16).reshape(-1).to(part.device)
    tt = (pairs[:, 1:] * 16 + f % 16).reshape(-1).to(part.device)
    dcs = part.new_zeros(n_q, lay.d16, lay.d16)
    dcs[:, rr, tt] = dcs_blocks
    dws = dws.reshape(n_q, g1, lay.bd)
    return da[:, 0], dbs, dcs, dws, dl0


class OALTriton(torch.autograd.Function):
    """Causal OAL attention on the Triton kernels; gradients for q, k, v, the coefficients and the initial state."""

    @staticmethod
    def forward(ctx, q, k, v, a, bs, cs, ws, l0, eps_t, init_blk, init_n, cfg: Config, status, mult):
        lay = layout(q.shape[-1])
        init = (init_blk, init_n) if init_blk is not None else None
        o, den, fin, finn = _forward(q, k, v, a, bs, cs, ws, l0, eps_t, init, cfg, lay, status, mult)
        ctx.save_for_backward(q, k, v, a, bs, cs, ws, l0, eps_t, init_blk, init_n, o, den)
        ctx.cfg = cfg
        ctx.set_materialize_grads(False)
        return o, fin, finn

    @staticmethod
    def backward(ctx, do, dfin, dfinn):
        q, k, v, a, bs, cs, ws, l0, eps_t, init_blk, init_n, o, den = ctx.saved_tensors
        cfg = ctx.cfg
        lay = layout(q.shape[-1])
        init = (init_blk, init_n) if init_blk is not None else None
        if do is None:
            do = torch.zeros_like(o)
        dfinal = None
        if dfin is not None or dfinn is not None:  # the final state was used: its gradient reaches every key
            shape = (q.shape[0] * k.shape[1], lay.rows)
            dfin = dfin if dfin is not None else o.new_zeros(*shape, v.shape[-1], dtype=cfg.acc_dtype)
            dfinn = dfinn if dfinn is not None else o.new_zeros(*shape, dtype=cfg.acc_dtype)
            dfinal = (dfin.to(cfg.acc_dtype), dfinn.to(cfg.acc_dtype))
        dq, dk, dv, (da, dbs, dcs, dws, dl0), dinit = _backward(
            q, k, v, a, bs, cs, ws, l0, eps_t, init, o, den, do.contiguous(), dfinal, cfg, lay
        )
        di, din = dinit if dinit is not None else (None, None)
        return dq, dk, dv, da, dbs, dcs, dws, dl0, None, di, din, None, None, None


_PARAMS = WeakIdKeyDictionary()  # factor -> (key, params): inference calls on deferred devices (see `_cached_params`)


def _cached_params(factor, groups, eps, scale, lay: Layout, acc_dtype):
    """`_params`, built once per kernel where no gradient must reach the factor and the device is `deferred`
    (keyed on the tensors' identities and version counters, as `kernel.cached_coefficients` does there: a
    comparison by value would be a host read per call). About 25 small launches saved per call."""
    if (torch.is_grad_enabled() and factor.requires_grad) or not checks.deferred(factor):
        return _params(factor, groups, eps, scale, lay, acc_dtype)
    key = (eps, scale, acc_dtype, version(factor), id(groups), version(groups), torch.is_inference_mode_enabled())
    hit = _PARAMS.get(factor)
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = _PARAMS[factor] = (key, _params(factor, groups, eps, scale, lay, acc_dtype), groups)
    return hit[1]


@lru_cache(maxsize=64)
def _constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A one-element device tensor holding `value` (eps for the kernels), made once: no operator per call. Read
    only; a normal tensor even when first asked for in inference mode (autograd saves it for backward)."""
    with torch.inference_mode(False):
        return torch.full((1,), value, dtype=dtype, device=device)


@lru_cache(maxsize=16)
def _unit(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The guard's multiplier vector when nothing is rescaled on the device (all 1; see `checks.device_rescale`)."""
    with torch.inference_mode(False):
        return torch.ones(6, dtype=dtype, device=device)


def _dtypes(q):
    """(dot dtype, accumulation dtype) for inputs like q."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    dot = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.bfloat16  # fp16 sums overflow: use bf16
    if dot == torch.bfloat16 and interpreted():
        dot = torch.float32  # Triton's interpreter multiplies bf16 as raw bits; the GPU check covers bf16 dots
    return dot, acc


# Half inputs: per-chunk state dtype (`Config.state_dtype`), normaliser by dots (`_norm_dot`), bf16 products
# (`_prod_dt`). benchmarks.gpu sets float32, False, False (the kernels before 2026-12-05) to time both in one run.
HALF_STATES = torch.bfloat16
NORM_DOTS = True
HALF_PRODUCTS = True  # `_prod_dt`
FWD_CHUNKS = True  # the forward's own chunk where the call asks for none (`tiles.fwd_chunk`)


def config(q, factor, chunk: int) -> Config:
    """The chunked kernels' `Config` for inputs like q. The states are stored in bf16 for half inputs even under
    the interpreter (which stores bf16 by truncation where a GPU rounds to nearest): the tests run that path."""
    dot, acc = _dtypes(q)
    half = q.dtype in (torch.float16, torch.bfloat16)
    return Config(factor.shape[-1], chunk, dot, acc, device_arch(q.device), HALF_STATES if half else acc, half)


def triton_forward(q, k, v, groups, factor, *, eps, scale, initial_state, chunk_size=None, need_state=True,
                   rescale=None, inplace=False, status=None):
    """Causal OAL on validated inputs in their own dtype. Returns (out [B,Hq,N,dv], final state [B,Hkv,F,dv+1] or
    None when not `need_state` and no initial state was given).

    `rescale`: the device multipliers of `checks.device_rescale` (None: q, factor, eps and scale are already
    rescaled on the host). `inplace`: the initial state may be updated in place (the generation cache's own).
    `status`: where the decoding kernels put their value checks (`checks.start_decode`), and the forward kernels
    their output's (`checks.start`; None: the host checks the output)."""
    bsz, n_q, n, d = q.shape
    n_kv, dv = k.shape[1], v.shape[-1]
    if routes.decodes(q, k, v, factor, initial_state):
        return _decode(q, k, v, groups, factor, eps, scale, initial_state, inplace, status)
    lay = layout(d)
    cfg = config(q, factor, chunk_size or CHUNK)
    if chunk_size is None and FWD_CHUNKS:  # the forward's own chunk (the backward keeps CHUNK)
        cfg = replace(cfg, fwd_chunk=fwd_chunk(cfg.half, max(d, dv) > 64, cfg.arch, CHUNK))
    acc = cfg.acc_dtype
    q, k, v = (t.contiguous() for t in (q, k, v))
    a, bs, cs, ws, l0 = _cached_params(factor, groups, eps, scale, lay, acc)
    if n == 0 or bsz == 0:
        out = q.new_zeros(bsz, n_q, n, dv)
        fin = initial_state.to(acc) if initial_state is not None else q.new_zeros(bsz, n_kv, feature_dim(d), dv + 1,
                                                                                  dtype=acc)
        return out, fin
    if routes.parallel(n, initial_state, need_state, chunk_size):  # the kernels apply the rescaling themselves
        mult = _unit(acc, q.device) if rescale is None else rescale
        return parallel.attention(q, k, v, ws, l0, _constant(eps, acc, q.device), mult, _consts(cfg, "fwd", d, dv),
                                  _gmax(cfg.n_groups1), status), None
    eps_t, mult = _constant(eps, acc, q.device), _unit(acc, q.device)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (q, k, v, factor, initial_state))
    if rescale is not None and not grad:  # the output kernel applies the multipliers itself: no torch operator
        mult = rescale
    elif rescale is not None:  # for autograd, through torch (exact for any multipliers, see checks.device_rescale)
        qs, m_a, m_b, m_c, m_w, m_l0 = rescale.to(acc).split(1)
        q, a, bs, cs, ws, l0, eps_t = q * qs, a * m_a, bs * m_b, cs * m_c, ws * m_w, l0 * m_l0, m_a * eps
    init_blk = init_n = None
    if initial_state is not None:
        init_blk, init_n = state_to_blocks(initial_state.to(acc), d)
    if grad:
        o, fin, finn = OALTriton.apply(q, k, v, a, bs, cs, ws, l0, eps_t, init_blk, init_n, cfg, status, mult)
    else:  # no gradient to compute: no autograd bookkeeping (as `parallel.attention`)
        init = (init_blk, init_n) if init_blk is not None else None
        o, _, fin, finn = _forward(q, k, v, a, bs, cs, ws, l0, eps_t, init, cfg, lay, status, mult)
    if not need_state and initial_state is None:
        return o, None  # no packed state asked for: none made (a gather and a concatenation of the final state)
    return o, blocks_to_state(fin, finn, bsz, d)


def _decode(q, k, v, groups, factor, eps, scale, state, inplace, status):
    """A few tokens on a state: the decoding kernels (`decode.py`), the state updated in place (a copy of it unless
    `inplace`). Their value checks land in `status` (a scratch buffer when the host checked already)."""
    if status is None:
        status = torch.zeros(guard.SLOTS, dtype=torch.float32, device=q.device)
    plan = decode.Plan(q, k, v, groups, factor, eps, scale, state, inplace)
    return plan(q.contiguous(), k.contiguous(), v.contiguous(), state, status)
