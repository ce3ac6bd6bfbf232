"""Chunked OAL: dense kernel inside each chunk, prefix state between chunks.

For chunk c with queries Q_c and the state S_{c-1} = sum_{j before c} psi(k_j)^T u_j:

    num_c = phi(Q_c) S_{c-1}  +  tril(kappa(Q_c, K_c)) U_c          (Eq. 5-6 across chunks, Eq. 7 inside)

Chunks are processed a block at a time, so that Python overhead is per block, not per chunk. Everything is
computed transposed (num^T = S^T phi^T), which lets one feature-major buffer serve every GEMM without a copy:
- features: per chunk and KV head a dense [F, rep * C] buffer of query features (rep = the KV head's query
  heads), and per KV head a [F, T] one of the block's key features. In this layout each pair block x_r * x[r:]
  is one contiguous stretch; the query heads' coefficients are folded into the pair products (phi = w * psi,
  Eq. 6), so phi is written once, and each chunk's readout operand is one dense matrix;
- state: the state before chunk c+1 is the one before chunk c plus psi(K_c)^T U_c, one GEMM per chunk that adds
  as it writes (Eq. 5), so each chunk state is written once;
- readout: S_{c-1}^T phi(Q_c)^T is one batched GEMM (Eq. 6), GQA without repeating K/V. Inference calls in fp32
  or bf16 whose chunk is whole vectors run the fused kernel `cpu_kernel.readout` instead, which forms phi in
  registers from the queries, so phi(Q) is never written (`_block_prefix` then skips `_query_features`); the
  torch GEMM stays the path under autograd, in fp64 and without a C++ compiler;
- intra-chunk: z_m(i, j) = L_0m + scale (q_i * w_m) . k_j with w_m[r] = L[g(r)+1, m], so kappa = eps + sum_m
  z_m^2 costs (G+1) small GEMMs against the shared keys (Eq. 7). The constant L_0m rides in the GEMM (a row of
  the query operand against a column of ones beside the keys), which saves a pass over z.
For bf16 inputs the features and the GEMMs over them stay in bf16 (fp32 accumulation inside the GEMM); the
running state, the intra-chunk kernel, the constant and linear readout rows and the numerator are fp32. The fused
kernel also writes the output itself (`cpu_kernel.readout`'s `final`) and builds the chunk states (`ops.cpu_chain`).
torch.compile is not used (compiling the feature map took 77 s on 2 cores, and was no faster). Under autograd every
block is checkpointed: only the block inputs and the running state are kept, and the d(d+1)/2-wide features are
recomputed. Inference reuses scratch buffers across blocks and calls (`clear_workspace` releases them).
"""

from __future__ import annotations

import math
import threading

import torch
import torch.nn.functional as F
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from oal.ops import cpu_chain, cpu_kernel, kernel, tuning, workers
from oal.ops.kernel import feature_dim, features, query_coefficients, weighted_features, weighted_pairs

# Tests set this to fill scratch buffers with NaN, so that a read of an unwritten entry shows up.
NAN_SCRATCH = False

# Below this length, a sequence with no initial state is one dense chunk: cheaper than building the
# d(d+1)/2-wide query features, and still O(N) memory per query row.
DENSE_MAX = 256
# The fixed defaults (`ops.tuning` measures the machine's own and caches them; OAL_NO_TUNE=1 keeps these).
# Tokens per chunk (fp32/fp64, bf16) and per block, chosen by measurement (1 thread, CPU clock): at N=16384, fp32
# chunks of 32 were 3.6% faster than 64 (intra-chunk work halves, prefix states double; 3 interleaved runs); in
# bf16, 64 beat 32 by 7% at N=8192 (`benchmarks.operator --sweep 8192`), and chunks of 128 were 15-25% slower in
# both. Blocks of 512 tokens: larger ones were no faster and need a larger workspace.
CHUNK, CHUNK_BF16, BLOCK = 32, 64, 512


def default_chunk(dtype: torch.dtype) -> int:
    return CHUNK_BF16 if dtype == torch.bfloat16 else CHUNK


def current_settings(dtype: torch.dtype) -> tuning.Settings:
    """The settings a call in `dtype` runs with now: forced or tuned ones (`ops.tuning`), else the fixed defaults
    above (CHUNK, CHUNK_BF16, BLOCK; pipelined, automatic KV split)."""
    tuned = tuning.settings_for(dtype)
    return fixed_settings(dtype) if tuned is None else tuned


def fixed_settings(dtype: torch.dtype) -> tuning.Settings:
    chunk = default_chunk(dtype)
    return tuning.Settings(chunk, max(BLOCK // chunk, 1))


_WORKSPACE = threading.local()  # per thread: (device, dtype, name) -> flat buffer, kept between calls


def clear_workspace() -> None:
    """Release this thread's scratch buffers (they are kept between calls; see `_scratch`)."""
    _WORKSPACE.__dict__.clear()
    kernel.clear_plans()  # the cached views of the feature maps hold buffers too


def _scratch(ws: dict | None, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor | None:
    """A reusable buffer of `shape` (inference only: ws is None under autograd, and then so is the result).

    Buffers live in a per-thread workspace that is kept between calls: a fresh allocation of the block's
    temporaries costs first-touch page faults worth about ten times filling them, on every call and every
    converted layer. `clear_workspace()` releases them. With NAN_SCRATCH every acquisition is NaN-filled.
    """
    if ws is None:
        return None
    n = math.prod(shape)
    key = (str(device), dtype, name)
    buf = ws.get(key)
    if buf is None or buf.numel() < n:
        with torch.inference_mode(False):  # a normal tensor: usable both in and outside inference mode
            buf = ws[key] = torch.empty(n, dtype=dtype, device=device)
        kernel.clear_plans()  # views of the buffer this one replaces must not keep it alive
    if NAN_SCRATCH:
        buf.fill_(float("nan"))
    return buf[:n].view(shape)


def _pad_to(x: torch.Tensor, n: int) -> torch.Tensor:
    return x if x.shape[2] == n else F.pad(x, (0, 0, 0, n - x.shape[2]))


def _slots(x: torch.Tensor, n_kv: int, n_c: int, chunk: int) -> torch.Tensor:
    """x [B, Hkv * s, nc * C, d] -> the view [nc, B, Hkv, d, s, C] (head kv * s + i in slot i)."""
    bsz, heads, _, d = x.shape
    return x.view(bsz, n_kv, heads // n_kv, n_c, chunk, d).permute(3, 0, 1, 5, 2, 4)


def _feature_major(x: torch.Tensor, n_kv: int, n_c: int, chunk: int, ws, name: str) -> torch.Tensor:
    """x [B, Hkv * s, nc * C, d] -> a contiguous copy [nc, B, Hkv, d, s, C] (the scratch `name` when ws)."""
    xs = _slots(x, n_kv, n_c, chunk)
    return xs.contiguous() if ws is None else _scratch(ws, name, xs.shape, x.dtype, x.device).copy_(xs)


def _key_features(k, ws):
    """psi(K) feature-major [B, Hkv, F, T] of one block's keys k [B, Hkv, T, d] (Eq. 5).

    Rows 1..d hold k itself; each pair block x_r * x[r:] is one contiguous stretch over the block's tokens, and
    chunk c's operand psi(K_c) is the column slice [c*C, (c+1)*C) (one matrix, leading dimension T)."""
    xk = k.transpose(-1, -2)  # [B, Hkv, d, T]
    d = xk.shape[2]
    with record_function("oal.features"):
        feat = _scratch(ws, "featk", xk.shape[:2] + (feature_dim(d), xk.shape[3]), k.dtype, k.device)
        if feat is None:  # autograd: out of place
            return features(xk, dim=2)
        feat[:, :, 1 : 1 + d] = xk
        return features(feat[:, :, 1 : 1 + d], dim=2, out=feat, plan=True)


def _query_features(xq, weights, ws):
    """phi(Q_c) = w * psi(Q_c) feature-major [nc, B, Hkv, F, rep * C] from xq [nc, B, Hkv, d, rep, C] (Eq. 6).

    `weights`: (w, w in xq's dtype; a mixed-dtype multiply is several times slower). One buffer per block,
    contiguous, so that each chunk's readout operand is one dense matrix. The weights are folded into the pair
    products (`kernel.weighted_features`), so phi is written once. Returns (phi, phi_lin). For bf16 features phi
    holds only the quadratic rows [nc, B, Hkv, d(d+1)/2, rep * C], a buffer of their own (a slice of a full one
    made the bf16 GEMM copy it), and phi_lin the constant and linear rows [nc, B, Hkv, 1 + d, rep * C] in w's
    dtype (the state's), from the exact bf16 inputs (see `_readout`); otherwise phi_lin is None.
    """
    w, wg = weights[:2]  # wg is converted once per call: the feature maps' cached views are keyed by their tensors
    d = xq.shape[3]
    lin, dev = 1 + d, xq.device
    feats = feature_dim(d)
    with record_function("oal.features"):
        if xq.dtype == w.dtype:
            phi = _scratch(ws, "featq", xq.shape[:3] + (feats,) + xq.shape[4:], xq.dtype, dev)
            if phi is None:
                phi = features(xq, dim=3) * wg
            else:
                phi = weighted_features(xq, wg, 3, phi, tmp=_scratch(ws, "xw", xq.shape, xq.dtype, dev), plan=True)
            return phi.flatten(-2), None  # rep and C are adjacent: a view
        phi_lin = _scratch(ws, "phi_lin", xq.shape[:3] + (lin,) + xq.shape[4:], w.dtype, dev)
        phi = _scratch(ws, "featq", xq.shape[:3] + (feats - lin,) + xq.shape[4:], xq.dtype, dev)
        if phi_lin is None:  # autograd: out of place
            phi_lin = torch.cat([w[:, :1].expand(xq.shape[:3] + (1,) + xq.shape[4:]), xq.to(w.dtype) * w[:, 1:lin]],
                                dim=3)
            phi = (features(xq, dim=3) * wg)[:, :, :, lin:]
        else:
            phi_lin[:, :, :, :1] = w[:, :1]
            torch.mul(xq, w[:, 1:lin], out=phi_lin[:, :, :, 1:])
            weighted_pairs(xq, wg[:, lin:], 3, phi, tmp=_scratch(ws, "xw", xq.shape, xq.dtype, dev), plan=True)
    return phi.flatten(-2), phi_lin.flatten(-2)


def _chunk_states(start, psi, ug, chunk: int, ws=None):
    """The state before each chunk and after the last: prev [nc+1, B, Hkv, F, dv+1], prev[0] = start and
    prev[c+1] = prev[c] + psi(K_c)^T U_c (Eq. 5), in start's dtype.

    psi [B, Hkv, F, T] and ug [B, Hkv, T, dv+1] (T = nc * chunk) in the GEMM dtype. In the state's dtype each step
    is one GEMM that adds onto the previous state as it writes the next (baddbmm), so every chunk state is written
    once; with bf16 features the increment is a bf16 GEMM (fp32 accumulation, rounded to bf16) summed in fp32.
    Where the fused kernel runs (fp32; bf16 on AMX tiles) `ops.cpu_chain` builds the chain in one pass per state.
    """
    n_c = psi.shape[-1] // chunk
    bsz, n_kv, feats, dv1 = start.shape
    sdt = start.dtype
    with record_function("oal.state"):
        if NAN_SCRATCH and ws is not None:  # start may be a view of `prev` itself (`_block_step`): read it before
            start = start.clone()  # the acquisition NaN-fills the buffer
        prev = _scratch(ws, "prev", (n_c + 1, bsz, n_kv, feats, dv1), sdt, start.device)
        if prev is None:  # autograd: out of place
            incs = [psi[..., c * chunk : (c + 1) * chunk] @ ug[:, :, c * chunk : (c + 1) * chunk] for c in range(n_c)]
            return torch.cat([start.unsqueeze(0), start + torch.stack(incs).to(sdt).cumsum(0)])
        prev[0].copy_(start)
        if cpu_chain.chains(psi, sdt, chunk):  # the fused kernel: one pass per chunk state
            return cpu_chain.states(psi, ug, prev)
        inc = None if psi.dtype == sdt else _scratch(ws, "inc", start.shape, psi.dtype, start.device)
        for c in range(n_c):
            ps, us = psi[..., c * chunk : (c + 1) * chunk], ug[:, :, c * chunk : (c + 1) * chunk]
            if inc is None:
                torch.baddbmm(prev[c].flatten(0, 1), ps.flatten(0, 1), us.flatten(0, 1), out=prev[c + 1].flatten(0, 1))
            else:  # converting the bf16 increment in a copy, then adding, beat one mixed-dtype add by 10-15%
                prev[c + 1].copy_(torch.matmul(ps, us, out=inc)).add_(prev[c])
        return prev


def _increments(psi, ub):
    """psi [..., F, T] and ub [..., T, dv+1] -> psi(K)^T U [..., F, dv+1] (Eq. 5)."""
    return torch.matmul(psi, ub)


def _readout(phi, states, ws=None, phi_lin=None):
    """states [nc, B, Hkv, F, dv+1]^T phi [nc, B, Hkv, F, rep*C] -> num^T [nc, B, Hkv, dv+1, rep*C] (Eq. 6).

    The result is in the states' dtype. With bf16 phi (its quadratic rows only, `_query_features`), those are a
    bf16 GEMM (fp32 accumulation, output rounded to bf16) and the constant and linear rows `phi_lin` an fp32 GEMM,
    so that the bf16 rounding of the GEMM output only touches the quadratic part: about 1.3x less error, at the
    level of bf16 SDPA.
    """
    shape = phi.shape[:-2] + (states.shape[-1], phi.shape[-1])
    s_t = states.transpose(-1, -2)
    with record_function("oal.readout"):
        if phi_lin is None:
            return torch.matmul(s_t.to(phi.dtype), phi, out=_scratch(ws, "num", shape, phi.dtype, phi.device))
        lin = phi_lin.shape[-2]
        s_low = _scratch(ws, "s_low", states[..., lin:, :].shape, phi.dtype, phi.device)
        if s_low is None:
            low = states[..., lin:, :].to(phi.dtype).transpose(-1, -2) @ phi
        else:  # the bf16 GEMM runs 1.5x faster with its left operand row-major [dv+1, F]; converting and then
            s_low.copy_(states[..., lin:, :])  # transposing in bf16 was 1.6x cheaper than one transposing copy
            s_t_low = _scratch(ws, "s_t_low", s_low.shape[:-2] + s_low.shape[-1:] + s_low.shape[-2:-1], phi.dtype,
                               phi.device).copy_(s_low.transpose(-1, -2))
            low = torch.bmm(s_t_low.flatten(0, -3), phi.flatten(0, -3),
                            out=_scratch(ws, "num_low", shape, phi.dtype, phi.device).flatten(0, -3)).view(shape)
        if ws is None:
            return torch.baddbmm(low.to(states.dtype).flatten(0, -3), s_t[..., :lin].flatten(0, -3),
                                 phi_lin.flatten(0, -3)).view(shape)
        num = _scratch(ws, "num", shape, states.dtype, phi.device).copy_(low)
        num.flatten(0, -3).baddbmm_(s_t[..., :lin].flatten(0, -3), phi_lin.flatten(0, -3))
        return num


def _fused(q, chunk: int, sdt: torch.dtype, ws, heads) -> bool:
    """Whether this block's readout runs the fused CPU kernel (inference scratch, the heads' inputs built, and
    `cpu_kernel.supports`)."""
    return ws is not None and heads is not None and cpu_kernel.supports(q, sdt, chunk)


def _fused_readout(q, heads: cpu_kernel.Heads, states, ws, intra=None, final=None):
    """`_readout` in the fused kernel: q [B, Hq, nc * C, d], states [nc, B, Hkv, F, dv+1] -> num^T (Eq. 6); with
    intra = (kb, ub, eps) the chunks' own keys too (Eq. 7); with `final` (the output) the output written there."""
    n_c, bsz, n_kv = states.shape[:3]
    rep, c = q.shape[1] // n_kv, q.shape[2] // n_c
    shape = (n_c, bsz, n_kv, states.shape[-1], rep * c)
    num = None if final is not None else _scratch(ws, "num", shape, states.dtype, q.device)
    if intra is not None:
        intra = cpu_kernel.Intra(intra[0], intra[1], heads.order, heads.bounds, heads.lower, intra[2])
    with record_function("oal.readout"):
        return cpu_kernel.readout(q, heads.rows.view(n_kv, rep, -1), states, num, intra, final)


def _normalise(num_t, n_q: int, out=None, raw: bool = False):
    """num^T [nc, B, Hkv, dv+1, rep*C] -> out [B, Hq, nc*C, dv] = numerator / denominator (written into `out`).

    `raw`: out [B, Hq, nc*C, dv+1] is the numerator itself (the caller combines it with other terms first)."""
    n_c, bsz, n_kv, dv1, cols = num_t.shape
    rep = n_q // n_kv
    num_t = num_t.view(n_c, bsz, n_kv, dv1, rep, cols // rep)
    res = None if out is None else _slots(out, n_kv, n_c, cols // rep)
    if raw:
        res = num_t if res is None else res.copy_(num_t)
    else:
        res = torch.div(num_t[:, :, :, :-1], num_t[:, :, :, -1:], out=res)
    return out if out is not None else res.permute(1, 2, 4, 0, 5, 3).reshape(bsz, n_q, -1, res.shape[3])


def _block_prefix(q, k, u, w, wz, chunk: int, fresh: bool, ws=None):
    """First half of one causal block: features and the intra-chunk operands (Eq. 6-7), everything that does
    not need the state before the block. `_chunk_states` then builds the chunk states from it (parts["psi"],
    parts["ug"]). `fresh`: one chunk from a zero state, no features, no state.

    wz [Hkv, d+1, rep, G+1, 1]: rows 0..d-1 the intra-chunk query weights, row d the constants L_0m. The query
    operand qw [nc, B, Hkv, d+1, rep, G+1, C] gets them as its last row and the key operand kb [nc, B, Hkv, C,
    d+1] a column of ones, so that their product is z_m(i, j) with its constant (Eq. 7).
    """
    bsz, n_q, n, d = q.shape
    n_kv, dv1 = k.shape[1], u.shape[-1]
    rep, n_c = n_q // n_kv, -(-n // chunk)
    gdt, sdt, dev = q.dtype, wz.dtype, q.device
    # zero padding: padded keys have u = 0 (no value, no denominator), padded query rows are dropped
    q, k, u = (_pad_to(t, n_c * chunk) for t in (q, k, u))
    ub = u.view(bsz, n_kv, n_c, chunk, dv1).transpose(1, 2).transpose(0, 1)  # [nc, B, Hkv, C, dv+1]
    parts = {"ub": ub.to(sdt).contiguous(), "n_c": n_c, "prev": None, "phi": None}
    fused = not fresh and _fused(q, chunk, sdt, ws, w[2])
    own_intra = fused and w[2].order is not None  # the kernel also takes Eq. 7 and gathers its own queries
    xq = None if own_intra else _feature_major(q, n_kv, n_c, chunk, ws, "xq")  # [nc, B, Hkv, d, rep, C]
    with record_function("oal.intra"):
        n_m = wz.shape[-2]
        kc = k.view(bsz, n_kv, n_c, chunk, d).transpose(1, 2).transpose(0, 1)  # [nc, B, Hkv, C, d]
        kb = _scratch(ws, "kb", (n_c, bsz, n_kv, chunk, d + 1), sdt, dev)
        if kb is None:  # autograd: out of place
            qw = torch.cat([xq.unsqueeze(5) * wz[:, :d], wz[:, d:].expand(n_c, bsz, n_kv, 1, rep, n_m, chunk)], dim=3)
            kb = torch.cat([kc.to(sdt), torch.ones(kc.shape[:-1] + (1,), dtype=sdt, device=dev)], dim=-1)
        else:
            kb[..., :d].copy_(kc)
            kb[..., d:].fill_(1.0)
            qw = None  # the fused kernel builds its kappa blocks from q and kb itself
            if not own_intra:
                qw = _scratch(ws, "qw", (n_c, bsz, n_kv, d + 1, rep, n_m, chunk), sdt, dev)
                torch.mul(xq.unsqueeze(5), wz[:, :d], out=qw[:, :, :, :d])
                qw[:, :, :, d:].copy_(wz[:, d:].expand_as(qw[:, :, :, d:]))
    parts["qw"], parts["kb"] = qw, kb
    if not fresh:
        if fused:  # the readout forms phi(Q) itself (and, without qw, the chunks' own keys too)
            parts["q"], parts["fused"] = q, w[2]
        else:
            parts["phi"], parts["phi_lin"] = _query_features(xq, w, ws)
        parts["psi"] = _key_features(k, ws)
        parts["ug"] = u.to(gdt)  # [B, Hkv, T, dv+1]
    return parts


def _block_finish(parts, eps: float, chunk: int, n_q: int, raw: bool = False, out=None, ws=None):
    """Second half of one causal block: readout of the chunk states parts["prev"] (None for a fresh block), the
    intra-chunk kernel, and the normalised (or `raw`) output (Eq. 6-7)."""
    qw, kb, ub, n_c, prev = parts["qw"], parts["kb"], parts["ub"], parts["n_c"], parts["prev"]
    num = None
    if prev is not None and "q" in parts:
        intra = (kb, ub, eps) if qw is None else None  # None: the torch intra-chunk term below
        final = out if intra is not None and not raw else None  # the kernel writes the output itself
        num = _fused_readout(parts["q"], parts["fused"], prev[:n_c], ws, intra, final)
        if intra is not None:
            return num if final is not None else _normalise(num, n_q, out, raw)
    elif prev is not None:
        num = _readout(parts["phi"], prev[:n_c], ws, parts["phi_lin"])  # in the state's dtype, also for bf16 GEMMs
    _, bsz, n_kv, d1, rep, n_m, _ = qw.shape
    dv1, sdt, dev = ub.shape[-1], ub.dtype, qw.device
    num_shape = (n_c, bsz, n_kv, dv1, rep * chunk)
    # intra-chunk dense kernel (Eq. 7), transposed: kappa^T [C_j, rep, C_i], GQA by grouping query heads
    with record_function("oal.intra"):
        z = torch.matmul(kb, qw.reshape(n_c, bsz, n_kv, d1, -1),  # z_m(i, j) with its constant L_0m
                         out=_scratch(ws, "z", (n_c, bsz, n_kv, chunk, rep * n_m * chunk), sdt, dev))
        z = z.view(n_c, bsz, n_kv, chunk, rep, n_m, chunk)
        sq = z.square_() if ws is not None else z.square()
        kappa = torch.sum(sq, dim=5, out=_scratch(ws, "kappa", (n_c, bsz, n_kv, chunk, rep, chunk), sdt, dev))
        causal = torch.ones(chunk, chunk, dtype=torch.bool, device=dev).triu_().unsqueeze(1)  # key j <= query i
        if ws is not None:
            kappa = kappa.add_(eps).mul_(causal)
        else:
            kappa = (kappa + eps) * causal
        kappa = kappa.view(n_c, bsz, n_kv, chunk, rep * chunk)
        ub_t = ub.transpose(-1, -2)
        if num is None:
            num = torch.matmul(ub_t, kappa, out=_scratch(ws, "num", num_shape, sdt, dev))
        elif ws is not None:
            num.view(-1, dv1, rep * chunk).baddbmm_(ub_t.reshape(-1, dv1, chunk), kappa.view(-1, chunk, rep * chunk))
        else:
            num = num + ub_t @ kappa
    return _normalise(num, n_q, out, raw)


def _block_step(state, q, k, u, w, wz, eps: float, chunk: int, fresh: bool, raw: bool = False, out=None,
                ws=None):
    """Causal OAL over one block of tokens. Returns (out [B, Hq, m, dv], state after the block: with `ws` a view
    of the scratch buffer `prev`, valid until the next block's `_chunk_states` has read it).

    m is the block length rounded up to whole chunks (the caller drops padded rows). `fresh`: the block is one
    chunk starting from a zero state, so the state readout is skipped and no state is built (None). The features
    and their GEMMs run in q's dtype (bf16 for bf16 inputs); the state, the intra-chunk kernel and the numerator in
    the state's dtype (wz's).
    """
    parts = _block_prefix(q, k, u, w, wz, chunk, fresh, ws)
    after = None
    if not fresh:
        parts["prev"] = _chunk_states(state, parts["psi"], parts["ug"], chunk, ws)
        # with scratch buffers a view: the next block copies it into its first slot before it writes any other
        # (the caller clones the last one), which saves a copy of the state per block
        after = parts["prev"][parts["n_c"]]
    return _block_finish(parts, eps, chunk, q.shape[1], raw, out, ws), after


def _pipelined(state, q, k, u, w, wz, eps: float, chunk: int, block: int, raw: bool, out, threads: int,
               kv_groups: int = 0):
    """The causal blocks on `threads` single-threaded workers (`ops.workers`), inference only.

    Block b's item builds its features, takes the state before it (published by block b-1), builds its chunk
    states from it and publishes the state after it, then reads out. The chain of chunk states is the only serial
    part (about a seventh of a block's work, measured in FLOPs), so in steady state a worker finds the state
    before its block already published; the chunk states are written once, not built from zero and then
    offset. Items start in order, so a worker only ever waits for a block that another worker has already started. KV
    heads are split into groups (their own state chains) when there are too few blocks to keep the workers busy,
    or into `kv_groups` groups when that is given (a tuned layout: smaller items, each with its own heads' state).
    """
    n, n_kv = q.shape[2], k.shape[1]
    rep = q.shape[1] // n_kv
    starts = list(range(0, n, block))
    n_groups = min(n_kv, kv_groups or -(-2 * threads // len(starts)))
    bounds = [(g * n_kv // n_groups, (g + 1) * n_kv // n_groups) for g in range(n_groups)]
    chain = workers.Chain({(g, 0): state[:, a:b] for g, (a, b) in enumerate(bounds)})

    def item(g: int, i: int) -> None:
        (a, b), sl = bounds[g], slice(starts[i], starts[i] + block)
        heads = slice(a * rep, b * rep)
        ws = _WORKSPACE.__dict__
        wh = (w[0][a:b], w[1][a:b], None if w[2] is None else w[2].select(a * rep, b * rep))
        parts = _block_prefix(q[:, heads, sl], k[:, a:b, sl], u[:, a:b, sl], wh, wz[a:b], chunk, False, ws)
        prev = parts["prev"] = _chunk_states(chain.take((g, i)), parts["psi"], parts["ug"], chunk, ws)
        chain.put((g, i + 1), prev[parts["n_c"]].clone())  # not a view: this worker's next block reuses `prev`
        _block_finish(parts, eps, chunk, (b - a) * rep, raw, out[:, heads, sl], ws)

    workers.workers(threads).run(item, [(g, i) for i in range(len(starts)) for g in range(n_groups)], chain)
    return torch.cat([chain.take((g, len(starts))) for g in range(n_groups)], dim=1)


def _key_step(state, k, u, ws=None):
    """Non-causal pass 1: state + psi(K)^T U over one block of keys (Eq. 5)."""
    psi = _key_features(k, ws)
    with record_function("oal.state"):
        return state + _increments(psi, u.to(k.dtype)).to(state.dtype)


def _query_step(state, q, w, raw: bool = False, out=None, ws=None):
    """Non-causal pass 2: phi(Q) S for one block of queries (Eq. 6)."""
    if _fused(q, q.shape[2], state.dtype, ws, w[2]):
        num = _fused_readout(q, w[2], state.unsqueeze(0).contiguous(), ws)  # no intra-chunk term: not causal
    else:
        phi, phi_lin = _query_features(_feature_major(q, state.shape[1], 1, q.shape[2], ws, "xq"), w, ws)
        num = _readout(phi, state.unsqueeze(0), ws, phi_lin)
    return _normalise(num, q.shape[1], out, raw)


def chunked_attention(
    q, k, v, groups, factor, coeffs, *, eps, scale, causal, state, state_is_zero=False, need_state=True,
    chunk_size=None, block_chunks=None, raw=False, weights=None,
):
    """Returns (out, final_state). Inputs already validated; q, k, v in the GEMM dtype (the state's, or bf16)
    and `state` (the initial state) in the state dtype.

    `raw`: v [B, Hkv, N, dv+1] already holds the columns u_j to sum, its last one the denominator's weight (1 for
    a real key, 0 for an empty slot), and out [B, Hq, N, dv+1] is the numerator sum_j kappa_ij u_j itself, not
    normalised: the sliding-window hybrid (`ops.window`) adds its window terms before dividing. `weights`: the
    query coefficients already built from `coeffs` (`kernel.cached_coefficients`), or None to build them."""
    dtype = q.dtype
    bsz, n_q, n, d = q.shape
    n_kv = k.shape[1]
    rep = n_q // n_kv
    settings = current_settings(dtype)
    chunk = min(chunk_size or settings.chunk, max(n, 1))  # a short call (decoding) is one chunk
    block = chunk * (block_chunks or max(settings.chunk * settings.block_chunks // chunk, 1))
    u = v if raw else torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)
    # per-head weights of the query features (Eq. 6) and of the intra-chunk kernel (Eq. 7)
    w_rows = query_coefficients(*coeffs, scale) if weights is None else weights  # [Hq, F]
    w = w_rows.view(n_kv, rep, -1).transpose(1, 2).unsqueeze(-1)
    # also in the GEMM dtype, converted once per call, and what the fused kernel needs of the heads
    use_ckpt = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, factor, state))
    fusable = q.device.type == "cpu" and not use_ckpt and cpu_kernel.enabled()  # the fused kernel: inference only
    w = (w, w.to(dtype), cpu_kernel.heads(w_rows, groups, factor, scale) if fusable else None)
    lower = torch.tril(factor)
    wz = torch.gather(lower[:, 1:, :], 1, groups.long().unsqueeze(-1).expand(-1, -1, lower.shape[-1]))
    wz = (wz * scale).view(n_kv, rep, d, -1).transpose(1, 2).unsqueeze(-1)  # [Hkv, d, rep, G+1, 1]
    l0 = lower[:, 0, :].reshape(n_kv, 1, rep, -1, 1)  # [Hkv, 1, rep, G+1, 1]: the constants L_0m
    wz = torch.cat([wz, l0.to(wz.dtype)], dim=1)  # [Hkv, d+1, rep, G+1, 1] (see `_block_prefix`)
    ws = None if use_ckpt else _WORKSPACE.__dict__  # scratch buffers shared by blocks and calls (inference only)

    def run(fn, *args, out=None):
        if use_ckpt:
            return checkpoint(fn, *args, use_reentrant=False)
        return fn(*args, out=out, ws=ws) if out is not None else fn(*args, ws=ws)

    def state_of(state):  # the state after all keys, a block at a time
        for start in range(0, n, block):
            sl = slice(start, start + block)
            state = run(_key_step, state, k[:, :, sl], u[:, :, sl])
        return state

    if not causal:  # every key is visible: the state over all keys, then one readout per block of queries
        state = state_of(state)
        out = None if use_ckpt else torch.empty(bsz, n_q, n, v.shape[-1], dtype=dtype, device=q.device)
        outs = []
        for start in range(0, n, block):
            sl = slice(start, start + block)
            outs.append(run(_query_step, state, q[:, :, sl], w, raw, out=None if out is None else out[:, :, sl]))
        return (torch.cat(outs, dim=2) if out is None else out), state
    fresh = state_is_zero and n <= DENSE_MAX
    if fresh:
        chunk = block = n
    padded = -(-n // chunk) * chunk
    out = None if use_ckpt else torch.empty(bsz, n_q, padded, v.shape[-1], dtype=dtype, device=q.device)
    threads = torch.get_num_threads()
    pipelined = settings.pipeline and threads > 1 and q.device.type == "cpu" and workers.enabled()
    if not (use_ckpt or fresh) and n > block and pipelined:
        q, k, u = (_pad_to(t, padded) for t in (q, k, u))
        state = _pipelined(state, q, k, u, w, wz, eps, chunk, block, raw, out, threads, settings.kv_groups)
        return out[:, :, :n] if padded == n else out[:, :, :n].contiguous(), state
    outs, init = [], state
    for start in range(0, n, block):
        sl = slice(start, start + block)
        args = (state, q[:, :, sl], k[:, :, sl], u[:, :, sl], w, wz, eps, chunk, fresh, raw)
        o, state = run(_block_step, *args, out=None if out is None else out[:, :, start : start + block])
        outs.append(o)
    out = torch.cat(outs, dim=2) if out is None else out
    if ws is not None and state is not None:
        state = state.clone()  # a view of the scratch buffer `prev` (see `_block_step`)
    if fresh:
        state = state_of(init) if need_state else None
    return out[:, :, :n] if padded == n else out[:, :, :n].contiguous(), state
