"""Tile sizes and launch options of the Triton kernels per shape and target, and the inputs they refuse.

No triton import at load: `unsupported` (and so `auto`) reads this without loading the kernels (`tl_dtype` imports
triton.language when first called). `next_pow2` and `tl_dtype`: the host side of the launches.

RH is the number of rows of a 16 x 16 feature-block pair that one H2 dot takes (kernels.py): its operands are
[C, 16 RH] features and [16 RH, dv] state rows, so RH bounds the shared memory and registers of the pair loops.
Pipeline stages buffer the (fp32) state tiles in shared memory. Every entry was compiled for its target without a
GPU at d, dv in {64, 128} and bf16, fp16, fp32 inputs (scripts/triton_sm90_check.py, in CI through
tests/test_triton_compile.py); smaller head dims have smaller tiles (BD, BV are d, dv rounded up to a power of
two). Not tuned on a device: see docs/design/gpu-kernels.md.
"""

from __future__ import annotations

import functools

import torch


def next_pow2(n: int) -> int:
    """The next power of two >= n, on the host (triton.next_power_of_2 is a constexpr function: slow from Python)."""
    return 1 << max(0, (n - 1).bit_length())


def cdiv(n: int, block: int) -> int:
    """ceil(n / block) on the host (triton.cdiv is a constexpr function: about 2 µs a call from Python)."""
    return -(-n // block)


_TL = {}


def tl_dtype(dtype: torch.dtype):
    """The triton type of a torch dtype (triton imported on first use)."""
    if not _TL:
        import triton.language as tl

        _TL.update({torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32,
                    torch.float64: tl.float64})
    return _TL[dtype]


SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}  # shared memory of one block: H100/H200 (sm_90), A100 (sm_80)
# 4 warps (one warpgroup). Measured on the H200 (Triton 3.6.0, 2026-12-04): with 8 warps the backward kernels
# (_bwd_dq, _bwd_dkv) at 64-token chunks faulted with fp32 inputs (illegal memory access; tf32x3 dots) and
# gave wrong dq, dk with bf16 inputs at d = dv = 128 (relative error 0.4); the forward kernels were correct.
# With 4 warps every kernel test and the bf16 check at N = 16k pass there (benchmarks/reference/gpu_h200_summary.txt).
# Likely cause, not verified: 8 warps split a 64-row dot over two warpgroups, so the kernels' many 16-column dots
# become 8-column wgmma tiles (compare triton-lang/triton#10629). The speed at 4 warps is not yet measured.
NUM_WARPS = 4

# (half-precision dots, max(d, dv) > 64, arch) -> kernel -> (RH, pipeline stages)
# The half-precision tiles take the fewest register spills that ptxas reports (scripts/triton_sm90_check.py, 4 warps,
# Triton 3.6.0; bytes of spill stores per thread in the comments). A scan program's accumulator is [16 RH, dv] fp32,
# 128 registers a thread at RH 16 and dv 64 before anything else, so whole pairs spilled 3.7 KB (sm_90) to 19 KB
# (sm_80) in the scan's loop; pair steps of 4 rows (M = 64 for the scan's dot, Hopper's smallest MMA tile) spill
# 0-1.3 KB and run 4x as many programs, which a batch of one, with two KV heads, needs anyway. Chosen without a GPU:
# benchmarks.gpu on the H200 is what decides. Since 2026-12-05 (eighth session) sm_90 takes 8 rows in the scans and
# dq at d = dv = 64: by the SASS (scripts/triton_sm90_check.py --sass) a step of 8 rows issues fewer instructions a
# row than two of 4 (query scan 464 -> 378, key scan 364 -> 272, dq 455 -> 399 per 64 rows; dO/den, q's blocks and
# the normaliser weight are loaded once for twice the rows), and half the scan programs re-read them; in bf16 no
# spill in any loop (24 B a thread in the query scan, outside them; fp16's key scan spills 88 B, 4 local loads a
# step, and still issues 364 a 64 rows against 475). sm_80 keeps 4 (there 8 spills 24-60 B).
TILES = {
    (True, False, 90): dict(scan=(8, 2), fwd=(16, 3), dq=(8, 1), dkv=(8, 1)),  # spill 0 (query 24), -, 0, 20
    (True, False, 80): dict(scan=(4, 2), fwd=(16, 3), dq=(4, 1), dkv=(8, 2)),  # 0 (20), -, 120, 836
    (True, True, 90): dict(scan=(4, 2), fwd=(8, 2), dq=(4, 1), dkv=(4, 1)),  # 0 (12), -, 248, 784
    (True, True, 80): dict(scan=(4, 2), fwd=(8, 2), dq=(4, 2), dkv=(4, 3)),  # 0 (0), -, 668, 1340; 153 KB
    # fp32 inputs: tf32x3 dots, whose big and small halves each take an operand buffer
    (False, False, 90): dict(scan=(16, 1), fwd=(16, 1), dq=(16, 1), dkv=(16, 1)),
    (False, False, 80): dict(scan=(16, 1), fwd=(16, 1), dq=(16, 1), dkv=(16, 1)),
    (False, True, 90): dict(scan=(8, 1), fwd=(8, 1), dq=(8, 1), dkv=(8, 1)),  # RH 16: 320 KB
    (False, True, 80): dict(scan=(4, 1), fwd=(4, 1), dq=(4, 1), dkv=(4, 1)),  # RH 8: dq, dkv 192 KB
}


# What `triton.autotune` may pick for _fwd_out on a GPU, per table key as above: (RH, stages), the TILES entry first.
# Every candidate is compiled for its target by scripts/triton_sm90_check.py ("fwd tuned"; spills in bytes a thread
# as a launch compiles it, 2026-12-05, with the normaliser's operand stored split). On sm_90 in half precision the
# output kernel (with its output check) spills nothing at any candidate for d = dv = 64; 24 B at (8, 2), 4 at
# (4, 1), 0 at (4, 2) and (4, 3) for d = dv = 128. (4, 3) pipelines the state's rows three deep (47.5 KB of shared
# memory at d = 64; 87.5 KB at 128): added 2026-12-05 for the autotuner to weigh, not measured. (8, 1) and (8, 3)
# (eighth session): at the forward's 128-token chunks, 8 warps, a step of 8 rows issues 113 (unpipelined) and 152
# instructions a warp per 64 state rows, against 115 and 185 at RH 4 and 110-120 at RH 16 (121 KB of shared
# memory, where (8, 3) takes 97); no spill, at 64 tokens either.
FWD_CANDIDATES = {
    (True, False, 90): [(16, 3), (16, 2), (4, 1), (4, 3), (8, 1), (8, 3)],
    (True, False, 80): [(16, 3), (16, 2), (4, 1)],  # spill 0
    (True, True, 90): [(8, 2), (4, 2), (4, 1), (4, 3)],
    (True, True, 80): [(8, 2), (4, 3)],
    (False, False, 90): [(16, 1), (8, 2)],
    (False, False, 80): [(16, 1), (8, 2)],
    (False, True, 90): [(8, 1), (4, 2)],
    (False, True, 80): [(4, 1)],
}


# The chunked forward's tokens per chunk (its key scan and output kernel) where the call asks for none, per table key
# as above (absent: the backward's 64). At 128 tokens the output kernel runs 8 warps, one warpgroup per 64 rows
# (`fwd_warps`), so each warp does what it did at 64 (instructions per pair step, sm_90, bf16, d = dv = 64: 469 ->
# 482 at RH 16, 193 -> 185 at RH 4 with 3 stages; the intra-chunk loop about 45% more a token), and every program
# reads its chunk's state for twice the queries: half the state bytes from L2 and from memory, half the states to
# store and hold, and the key scan about a third fewer instructions a token (364 per 64 tokens -> 494 per 128).
# No spills (sm_90 and sm_80); at d or dv = 128 it spills 160-530 B, so those keep 64. The backward keeps 64 (its
# kernels at 8 warps were wrong on the H200, above). Not measured on a GPU.
FWD_CHUNK = {(True, False, 90): 128, (True, False, 80): 128}


def fwd_chunk(half: bool, big: bool, arch: int, default: int) -> int:
    """The forward's chunk for these inputs and target (FWD_CHUNK, else `default`)."""
    return FWD_CHUNK.get((half, big, arch), default)


def fwd_warps(chunk: int) -> int:
    """The output kernel's warps at `chunk` tokens: one warpgroup per 64 query rows (4 warps at 64, 8 at 128:
    each warp then holds what it holds at 64; 4 warps at 128 spill 0.7-1.6 KB a thread)."""
    return NUM_WARPS * max(1, chunk // 64) if chunk <= 128 else NUM_WARPS


def tiles(kernel: str, d: int, dv: int, half: bool, arch: int, chunk: int = 64) -> dict:
    """RH and the launch options of `kernel` ('scan', 'fwd', 'dq', 'dkv') for head dims (d, dv), half-precision
    dots or not, on `arch` (90 or 80), at `chunk` tokens. A scan past 64 tokens takes fewer rows a step, so that its
    feature operand [16 RH, chunk] keeps its size (the key scan at 128 tokens and RH 8 spills 240 B a thread)."""
    rh, stages = TILES[half, max(d, dv) > 64, arch][kernel]
    if kernel == "scan" and chunk > 64:
        rh = max(4, rh * 64 // chunk)
    return dict(RH=rh, num_warps=NUM_WARPS, num_stages=stages)


# cached: asked on every call of the kernels' path (`unsupported`, the tiles), and a device's properties do not change
@functools.cache
def device_arch(device: torch.device) -> int:
    """The target whose tiles a device uses: 90 for Hopper and later (checked for sm_90 only), else 80 (90 under
    the interpreter)."""
    if device.type != "cuda":
        return 90
    return 90 if torch.cuda.get_device_capability(device)[0] >= 9 else 80


@functools.cache
def device_shared(device: torch.device) -> tuple[str, int]:
    """(name, shared memory one block may opt in to, in bytes) of a CUDA device."""
    props = torch.cuda.get_device_properties(device)
    return props.name, getattr(props, "shared_memory_per_block_optin", SHARED_LIMIT[device_arch(device)])


def refusal(d: int, dv: int, dtype: torch.dtype, arch: int) -> str | None:
    """Why the kernels cannot take head dims (d, dv) and inputs in `dtype` on `arch` (None when they can).

    Every d, dv <= 128 fits both targets with the tiles above, so `arch` refuses nothing today; the compile
    check asks per target all the same.
    """
    if d > 128 or dv > 128:
        return f"q/v: the triton backend supports d, dv <= 128, got d={d}, dv={dv}"
    if dtype == torch.float64:  # fp64 pair tiles exceed the shared memory of every GPU
        return "q: the triton backend takes bf16, fp16 or fp32 on CUDA (fp64 runs on backend='chunked')"
    return None
