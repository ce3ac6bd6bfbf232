"""The state's block layout of the chunked kernels (`kernels.py`'s docstring describes it): its sizes, the block
pairs in the order the kernels take them, and the maps between it and the packed state of the operator's contract."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from oal.ops.kernel import feature_dim
from oal.ops.triton.kernels import BLK
from oal.ops.triton.tiles import next_pow2


@dataclass(frozen=True)
class Layout:
    d: int
    d16: int  # d rounded up to the feature block width
    nb: int  # feature blocks
    npair: int  # block pairs I <= J
    rows: int  # R: 1 + d16 + 256 * npair
    bd: int  # power-of-two tile width >= d


@cache
def layout(d: int) -> Layout:
    nb = -(-d // BLK)
    npair = nb * (nb + 1) // 2
    return Layout(d, nb * BLK, nb, npair, 1 + nb * BLK + 256 * npair, max(16, next_pow2(d)))


@cache
def _maps(d: int):
    """(pairs [NPAIR, 2] int32, block row -> packed feature index or -1 [R], packed index -> block row [F])."""
    lay = layout(d)
    # the diagonal pairs first: `kernels._fwd_out` counts the others twice from the first one on
    pairs = [(i, i) for i in range(lay.nb)] + [(i, j) for i in range(lay.nb) for j in range(i + 1, lay.nb)]
    to_packed = [-1] * lay.rows
    to_block = [0] * feature_dim(d)
    to_packed[0] = 0
    for r in range(d):
        to_packed[1 + r] = 1 + r
        to_block[1 + r] = 1 + r

    def packed(r, t):  # row-major upper triangle, as kernel.packed_pairs
        return 1 + d + r * d - r * (r - 1) // 2 + (t - r)

    for p, (i, j) in enumerate(pairs):
        for f in range(256):
            r, t = i * 16 + f // 16, j * 16 + f % 16
            if r < d and t < d:
                row = 1 + lay.d16 + 256 * p + f
                to_packed[row] = packed(min(r, t), max(r, t))
                if r <= t:
                    to_block[packed(r, t)] = row
    return torch.tensor(pairs, dtype=torch.int32), torch.tensor(to_packed), torch.tensor(to_block)


def state_to_blocks(state: torch.Tensor, d: int):
    """Packed state [B, Hkv, F, dv+1] -> (block layout [B*Hkv, R, dv], normaliser [B*Hkv, R]); differentiable."""
    _, to_packed, _ = _maps(d)
    to_packed = to_packed.to(state.device)
    valid = (to_packed >= 0).to(state.dtype)[:, None]
    blk = state.flatten(0, 1)[:, to_packed.clamp_min(0)] * valid
    return blk[..., :-1].contiguous(), blk[..., -1].contiguous()


def blocks_to_state(blk: torch.Tensor, blkn: torch.Tensor, batch: int, d: int):
    """Inverse of `state_to_blocks`: [B*Hkv, R, dv], [B*Hkv, R] -> [B, Hkv, F, dv+1]."""
    _, _, to_block = _maps(d)
    to_block = to_block.to(blk.device)
    full = torch.cat([blk, blkn[..., None]], dim=-1)[:, to_block]
    return full.view(batch, -1, *full.shape[1:])
