"""Which Triton kernels a call runs (no triton import: `oal.ops` asks before loading the kernels).

- a few tokens on a state, no gradient: the decoding kernels (`decode.py`), the state updated in place;
- a fresh sequence up to PARALLEL_MAX tokens whose final state is not asked for: the parallel kernels
  (`parallel.py`, no state);
- everything else: the chunked kernels (`kernels.py`).
"""

from __future__ import annotations

import torch

from oal.ops.triton.tiles import next_pow2

DECODE_TOKENS = 4  # at most this many new tokens on a state run the decoding kernels
# An estimate, not a measurement: at 2k tokens the parallel kernels do about 26 GFLOP (0.1 ms at FlashAttention-2
# rates) against the chunked kernels' fixed cost of scans and launches; their work grows as N^2, the chunked
# kernels' as N, and the FLOP counts cross near 4k. benchmarks.gpu times both (rows oal_parallel, oal_chunked) so
# that a GPU run can set it.
PARALLEL_MAX = 4096


WINDOW_TILE = 32768  # candidate rows x head columns of one window decoding program (`window_decode.py`)


def decodes(q, k, v, factor, initial_state) -> bool:
    """Whether a call runs the decoding kernels: a few new tokens on a state, no gradient. `factor` None: swa."""
    if initial_state is None or not 0 < q.shape[2] <= DECODE_TOKENS or q.shape[0] == 0:
        return False
    tensors = (q, k, v, factor, initial_state)
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def window_decodes(q, k, v, factor, initial_state, window: int, sinks: int) -> bool:
    """Whether a swa / oal-swa call runs the window decoding kernels: as `decodes`, and the sinks, the window
    and the new tokens fit one program's tile (a larger window runs the torch token loop)."""
    if not decodes(q, k, v, factor, initial_state):
        return False
    rows = next_pow2(sinks + window + q.shape[2])
    cols = max(16, next_pow2(max(q.shape[-1], v.shape[-1])))
    return rows * cols <= WINDOW_TILE


def parallel(n: int, initial_state, need_state: bool, chunk_size) -> bool:
    """Whether a call of n tokens runs the parallel kernels."""
    return initial_state is None and not need_state and chunk_size is None and 0 < n <= PARALLEL_MAX
