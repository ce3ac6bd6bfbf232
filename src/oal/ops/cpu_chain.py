"""The chain of chunk states of the chunked operator in the fused CPU kernel (`csrc/readout.cpp`, built and loaded by
`ops.cpu_kernel`): S_{c+1} = S_c + psi(K_c)^T U_c for every chunk of a block (Eq. 5), each chunk state read once and
written once. fp32 accumulates blocks of state rows in vector registers (`oal_states_f32`); bf16 runs on the AMX
tiles where the CPU has them (`oal_states_bf16`: the exact products summed onto the fp32 state in the tile). The
torch path (`chunked._chunk_states`) stays the reference and runs everywhere else.
"""

from __future__ import annotations

import torch

from oal.ops.cpu_kernel import _load, _split, amx, available, enabled, vector_width

__all__ = ["chains", "states"]


def chains(psi: torch.Tensor, state_dtype: torch.dtype, chunk: int) -> bool:
    """Whether `states` builds the chunk states of key features psi against a state of `state_dtype` here: an fp32
    state, no autograd, and fp32 features in chunks of whole vectors, or bf16 features on the AMX tiles (`amx`) in
    chunks of whole 32-token tile steps."""
    if psi.device.type != "cpu" or state_dtype != torch.float32 or torch.is_grad_enabled() and psi.requires_grad:
        return False
    if psi.dtype == torch.bfloat16:
        return chunk % 32 == 0 and enabled() and amx()
    return psi.dtype == torch.float32 and available() and chunk % vector_width() == 0


def states(psi: torch.Tensor, ug: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """The chain of chunk states (`chains`): prev[c+1] = prev[c] + psi(K_c)^T U_c for every chunk c (Eq. 5),
    written into prev [nc+1, B, Hkv, F, dv+1] fp32, whose prev[0] holds the state before the first chunk. psi
    [B, Hkv, F, nc * C] contiguous and ug [B, Hkv, nc * C, dv+1] with contiguous rows, both fp32 or both bf16. Each
    chunk state is read once and written once, its block of rows accumulated in registers (fp32) or in the AMX
    tiles (bf16: the products exact and summed onto the fp32 state; the torch path rounds each chunk's increment to
    bf16 first). With more than one torch thread the (batch row, KV head) items are split over the operator's
    workers."""
    lib = _load()
    bsz, n_kv, feats, t = psi.shape
    n_c, dv1 = prev.shape[0] - 1, prev.shape[-1]
    step = 32 if psi.dtype == torch.bfloat16 else vector_width()
    # the C side trusts these layouts: a wrong one would read or write out of bounds, not raise
    if psi.dtype not in (torch.float32, torch.bfloat16) or not psi.is_contiguous() or n_c < 1 or t % n_c \
            or t // n_c % step:
        raise ValueError(f"psi: expected contiguous float32 or bfloat16 features [B, Hkv, F, nc * C] with C a "
                         f"multiple of {step} for {n_c} chunks, got {psi.dtype} {list(psi.shape)}")
    if ug.dtype != psi.dtype or tuple(ug.shape) != (bsz, n_kv, t, dv1) or ug.stride(-1) != 1 \
            or ug.stride(-2) != dv1:
        raise ValueError(f"ug: expected {psi.dtype} values {[bsz, n_kv, t, dv1]} with contiguous rows, got "
                         f"{ug.dtype} {list(ug.shape)} strides {ug.stride()}")
    if prev.dtype != torch.float32 or tuple(prev.shape) != (n_c + 1, bsz, n_kv, feats, dv1) \
            or not prev.is_contiguous():
        raise ValueError(f"prev: expected a contiguous float32 tensor {[n_c + 1, bsz, n_kv, feats, dv1]}, got "
                         f"{prev.dtype} {list(prev.shape)}")
    items = bsz * n_kv
    args = (psi.data_ptr(), ug.data_ptr(), ug.stride(0), ug.stride(1), prev.data_ptr())
    dims = (n_kv, items, n_c, t // n_c, feats, dv1)
    chain = lib.oal_states_bf16 if psi.dtype == torch.bfloat16 else lib.oal_states_f32
    failed = []

    def run(begin: int, end: int) -> None:
        if chain(*args, begin, end, *dims):
            failed.append((begin, end))

    _split(run, items, min(torch.get_num_threads(), items))
    if failed:
        raise RuntimeError("the AMX tiles are not available to this process (see cpu_kernel.amx)")
    return prev
