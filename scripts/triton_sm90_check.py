"""Compile the OAL Triton kernels for Hopper (sm_90) and Ampere (sm_80) without a GPU and report their resources.

For every (d, dv) with d and dv in --head-dims, every input dtype and every target, unless `oal.ops.triton.refusal`
refuses that shape (then it says why): each kernel at G = 5, Hq/Hkv = 7 and 64-token chunks, with the tiles and
launch options of `oal.ops.triton.function.tiles`; the output kernel also with every tile its autotuner may pick
(`tiles.FWD_CANDIDATES`), the parallel kernels with every config of theirs (`parallel.configs`), the two
decoding kernels and the device checks' kernel (`guard`). Reports compile time, shared memory, registers and spills
(ptxas -v, the ptxas bundled with triton) and the number of tensor-core MMA instructions in the PTX (wgmma on
sm_90, mma.sync on sm_80); with --sass also each kernel's hot loops' instruction mix (scripts/triton_sass.py).
Each kernel is compiled as a launch compiles it, with 16-byte aligned pointers and the head dims, length and chunk
counts divisible by 16 (`launch_hints`). Exits 1 when a kernel fails to compile or needs more shared memory than
one block of the target can have: 227 KB on H100/H200 (sm_90), 163 KB on A100 (sm_80; consumer sm_86 cards, 99
KB, are not covered). The full grid is 629 compilations (about 7 minutes on 2 free CPU cores, hours on a loaded
machine); CI (tests/test_triton_compile.py) compiles a few of them.

    PYTHONPATH=src python scripts/triton_sm90_check.py               # d = dv = 64, bf16 and fp32, sm_90 and sm_80
    PYTHONPATH=src python scripts/triton_sm90_check.py --head-dims 64,128 --dtypes bf16,fp16,fp32   # the full grid
    PYTHONPATH=src python scripts/triton_sm90_check.py --head-dims 128 --kernels dkv --jobs 2      # one kernel
    PYTHONPATH=src python scripts/triton_sm90_check.py --kernels fwd --dtypes bf16 --arch 90 --sass  # its hot loop
    PYTHONPATH=src python scripts/triton_sm90_check.py --kernels dq --head-dims 64 --arch 90 --sass-listing  # read it
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parent))
import triton_sass  # noqa: E402  (beside this script)

import oal.ops.triton as oal_triton
from oal.ops.triton import decode as D
from oal.ops.triton import function as F
from oal.ops.triton import guard as G
from oal.ops.triton import kernels as K
from oal.ops.triton import parallel as P
from oal.ops.triton import tiles as T
from oal.ops.triton import window_decode as W

C, REP, G1 = 64, 7, 6
SINKS, WIN = 4, 64  # the recipe's oal-swa window (methods.window)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


# Integer arguments a typical launch passes as multiples of 16 (head dims 64/128, lengths and chunk counts of the
# benchmark's 2k..128k tokens). Triton specialises a launch on them, and on 16-byte aligned pointers: without the
# same hints a compile here vectorises less and reports other registers, spills and pipelining than the GPU runs.
ALIGNED_INTS = frozenset({"N", "d", "dv", "n_c", "n_cs", "seg_len"})


def launch_hints(fn, sig: dict) -> dict:
    """`ASTSource` attrs as a launch sets them: every pointer 16-byte aligned, the ALIGNED_INTS divisible by 16."""
    return {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name, ty in sig.items()
            if ty.startswith("*") or name in ALIGNED_INTS}


def compile_one(fn, sig: dict, const: dict, options: dict, arch: int, sass: int = 0) -> dict:
    """Compile; with `sass` 1 also the hot loops' instruction mix, with 2 the largest loop's listing too."""
    src = ASTSource(fn=fn, signature={**sig, **{name: "constexpr" for name in const}}, constexprs=const,
                    attrs=launch_hints(fn, sig))
    t0 = time.time()
    # compile even when cached, and have triton print its own ptxas -v report, so ptxas runs once per kernel
    with knobs.compilation.scope(), knobs.nvidia.scope(), contextlib.redirect_stdout(io.StringIO()) as log:
        knobs.compilation.always_compile = True
        knobs.nvidia.dump_ptxas_log = True
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    info = log.getvalue()
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    mma = "wgmma.mma_async" if arch == 90 else "mma.sync"
    return {"s": time.time() - t0, "shared": compiled.metadata.shared, "regs": int(regs.group(1)) if regs else None,
            "spill": int(spill.group(1)) if spill else None, "mma": compiled.asm["ptx"].count(mma),
            "sass": (triton_sass.summary(compiled.asm["cubin"]) + (
                "\n" + triton_sass.listing(compiled.asm["cubin"]) if sass > 1 else "")) if sass else None}


def kernels(d: int, dv: int, dt: str, arch: int):
    """(name, kernel, signature, constexprs, launch options) as `function` launches them for these inputs."""
    # the library's own Config for such inputs (dot dtype: bf16 for fp16 too; per-chunk state dtype), on this target
    cfg = dataclasses.replace(F.config(torch.empty(0, dtype=DTYPES[dt]), torch.empty(1, G1, G1), C), arch=arch)
    half, dot = cfg.half, NAMES[cfg.dot_dtype]
    lay = F.layout(d)
    bv = max(16, F.next_pow2(dv))
    x, a = "*" + dt, "*fp32"
    st = "*" + NAMES[cfg.state_dtype]  # the keys scan's per-chunk states

    # the forward's own chunk (`tiles.fwd_chunk`; its output kernel at `tiles.fwd_warps`), the backward's C
    fc = T.fwd_chunk(half, max(d, dv) > 64, arch, C)

    def split(kernel, chunk=C, **extra):
        consts = F._consts(dataclasses.replace(cfg, chunk=chunk), kernel, d, dv)
        options = {name: consts.pop(name) for name in ("num_warps", "num_stages") if name in consts}
        if kernel == "fwd":
            options["num_warps"] = T.fwd_warps(chunk)
        return dict(consts, NB=lay.nb, C=chunk, BV=bv, NPAIR=lay.npair, **extra), options

    scan_sig = dict(X=x, Y=x, NW=a, A=a, BS=a, CS=a, PAIRS="*i32", ST=a, STN=a, TOT=a, TOTN=a, CARRY=a, CARRYN=a,
                    PREV=a, PREVN=a, N="i32", HX="i32", n_seg="i32", d="i32", dv="i32", R="i32", store="i32",
                    has_carry="i32", add_prev="i32")
    norm = dict(NORM_DOT=F._norm_dot(cfg))
    stn = "*" + dot if norm["NORM_DOT"] else a  # the keys scan's per-chunk normaliser (split: `_norm_store`)
    for chunk in dict.fromkeys((fc, C)):  # the forward's, then the backward's when they differ
        yield (f"scan keys C={chunk}" if fc != C else "scan keys", K._state_scan, dict(scan_sig, ST=st, STN=stn),
               *split("scan", chunk, SEG=16, REP=1, QUERY=False, REVERSE=False, **norm))
    yield ("scan query", K._state_scan, dict(scan_sig, Y="*" + dot),
           *split("scan", SEG=16, REP=REP, QUERY=True, REVERSE=True, **norm))
    big = dict(REP=REP, BD=lay.bd, GMAX=F._gmax(G1))
    fwd_sig = dict(Q=x, K=x, V=x, A=a, BS=a, CS=a, WS=a, L0=a, EPS=a, MULT=a, PAIRS="*i32", ST=st, STN=stn, O=x, DEN=a,
                   STATUS=a, N="i32", n_q="i32", n_cs="i32", d="i32", dv="i32", R="i32", g1="i32", NBKT="i32")
    # the output's check in the kernel, as on a GPU (deferred checks)
    big_fwd = dict(big, CHECK=True, PROD_DT=F._prod_dt(cfg), **norm)
    yield ("fwd", K._fwd_out, fwd_sig, *split("fwd", fc, **big_fwd))
    for rh, stages in T.FWD_CANDIDATES[half, max(d, dv) > 64, arch]:
        const, options = split("fwd", fc, **big_fwd)
        yield (f"fwd tuned RH={rh} st={stages}", K._fwd_out, fwd_sig, dict(const, RH=rh),
               dict(options, num_stages=stages))
    yield ("dq", K._bwd_dq, dict(Q=x, K=x, V=x, GO="*" + dot, DL=a, BS=a, CS=a, WS=a, L0=a, PAIRS="*i32", ST=st,
                                 STN=stn, DQ=x, PART=a, N="i32", n_q="i32", n_c="i32", n_cs="i32", d="i32", dv="i32",
                                 R="i32", P="i32", g1="i32"), *split("dq", **big, **norm))
    yield ("dkv", K._bwd_dkv, dict(Q=x, K=x, V=x, GO="*" + dot, DL=a, WS=a, L0=a, EPS=a, PAIRS="*i32", ST=a,
                                   STN=a, CARRY=a, CARRYN=a, DK=x, DV=x, N="i32", n_q="i32", n_cs="i32",
                                   seg_len="i32", n_seg="i32", d="i32", dv="i32", R="i32", g1="i32"),
           *split("dkv", **big))
    par = dict(REP=REP, GMAX=F._gmax(G1), BD=lay.bd, BV=bv, DOT_DT=F.tl_dtype(cfg.dot_dtype),
               ACC_DT=F.tl_dtype(torch.float32),
               PREC=F._consts(cfg, "fwd", d, dv)["PREC"], LOOP_FOR=True)
    tail = dict(N="i32", n_q="i32", d="i32", dv="i32", g1="i32", NBKT="i32")
    par_sigs = {
        "par fwd": (P._par_fwd, dict(Q=x, K=x, V=x, WS=a, L0=a, EPS=a, MULT=a, O=x, DEN=a, STATUS=a, **tail)),
        "par dq": (P._par_dq, dict(Q=x, K=x, V=x, GO="*" + dot, DL=a, WS=a, L0=a, MULT=a, DQ=x, PART=a, **tail)),
        "par dkv": (P._par_dkv, dict(Q=x, K=x, V=x, GO="*" + dot, DL=a, WS=a, L0=a, EPS=a, MULT=a, DK=x, DV=x,
                                     **tail)),
    }
    for name, (fn, sig) in par_sigs.items():
        for bm, bn, stages in P.configs(half, max(d, dv) > 64):
            extra = dict(CHECK=True) if name == "par fwd" else {}
            yield (f"{name} {bm}x{bn} st={stages}", fn, sig, dict(par, BM=bm, BN=bn, **extra),
                   dict(num_warps=P.NUM_WARPS, num_stages=stages))
    dec_sig = dict(Q=x, K=x, V=x, W=a, ROWR="*i32", ROWT="*i32", S=a, PART=a, PARTN=a, STATUS=a, EK=a, EU=a, LL=a,
                   F="i32", d="i32", dv="i32", n_q="i32", n_bq="i32", s_stride="i32", scale_abs="fp32",
                   s_limit="fp32")
    dec = dict(T=1, REP=REP, RB=D.rows_per_program(bv), BV=bv, BDQ=lay.bd, ACC_DT=F.tl_dtype(torch.float32))
    yield ("decode step", D._dec_step, dec_sig, dict(dec, EVICT=False), dict(num_warps=D.NUM_WARPS))
    yield ("decode step evict", D._dec_step, dec_sig, dict(dec, EVICT=True), dict(num_warps=D.NUM_WARPS))
    rows = F.next_pow2(SINKS + WIN + 1)  # the recipe's window, one new token
    win = dict(T=1, REP=REP, SINKS=SINKS, WIN=WIN, R=rows, BD=max(16, F.next_pow2(d)), BV=bv,
               ACC_DT=F.tl_dtype(torch.float32))
    win_sig = dict(Q=x, K=x, V=x, SL=a, O=x, M=a, ACC=a, ACCN=a, EK=a, EU=a, STATUS=a, size="i32", d="i32",
                   dv="i32", n_q="i32", scale="fp32")
    for evict in (False, True):
        yield (f"window step {'oal-swa' if evict else 'swa'}", W._win_step, win_sig, dict(win, EVICT=evict),
               dict(num_warps=W.num_warps(rows, bv)))
    yield ("window out", W._win_out, dict(M=a, ACC=a, ACCN=a, PART=a, PARTN=a, LL=a, O=x, STATUS=a, n_rows="i32",
                                          dv="i32"),
           dict(NBLK=-(-(1 + d + d * (d + 1) // 2) // D.rows_per_program(bv)), BV=bv), {})
    yield ("decode out", D._dec_out, dict(PART=a, PARTN=a, O=x, STATUS=a, n_rows="i32", dv="i32"),
           dict(NBLK=-(-(1 + d + d * (d + 1) // 2) // D.rows_per_program(bv)), BV=bv), {})
    guard_sig = dict(X0=x, X1=x, X2=x, X3=a, X4=a, X5=a, **{f"n{i}": "i32" for i in range(6)}, STATUS=a,
                     **{f"c{i}": "i32" for i in range(1, 6)}, total="i32", scale_abs="fp32", d="i32", s_limit="fp32")
    yield ("guard", G._guard, guard_sig, dict(FIRST=0, TICKET=14, MULTS=True, BLOCK=G.BLOCK), {})


KERNELS = ("scan keys", "scan query", "fwd", "fwd tuned", "dq", "dkv", "par fwd", "par dq", "par dkv", "decode step",
           "decode out", "window step", "window out", "guard")


def _selected(d: int, dv: int, dt: str, arch: int, names) -> list[int]:
    """Indices into `kernels(...)` of the kernels whose name starts with one of `names`."""
    rows = [name for name, *_ in kernels(d, dv, dt, arch)]
    return [i for i, row in enumerate(rows) if any(row == n or row.startswith(n + " ") for n in names)]


def _job(job):
    """Compile one kernel; a row of the report (in a worker process when --jobs > 1)."""
    d, dv, dt, arch, index, limit_kb, sass = job
    name, fn, sig, const, options = list(kernels(d, dv, dt, arch))[index]
    tile = f"RH={const['RH']:<2d}" if "RH" in const else ""
    head = f"sm_{arch} d={d:<3d} dv={dv:<3d} {dt:4s} {name:22s} {tile:5s} {options}"
    try:
        r = compile_one(fn, sig, const, options, arch, sass)
    except Exception as err:  # report every kernel, then fail
        return False, f"{head}: FAILED TO COMPILE: {type(err).__name__}: {str(err).splitlines()[-1]}"
    limit = limit_kb * 1024 if limit_kb else F.SHARED_LIMIT[arch]
    over = r["shared"] > limit
    return not over, (f"{head}: {r['s']:5.1f} s, shared {r['shared'] / 1024:5.1f} KB"
                      f"{f' (OVER {limit // 1024} KB)' if over else ''}, regs {r['regs']}, spill {r['spill']} B, "
                      f"mma {r['mma']}" + ("".join(f"\n    {line}" for line in r["sass"].splitlines()) if sass else ""))


def check(head_dims, dtypes, archs, jobs: int = 1, names=KERNELS, limit_kb: int | None = None, out=print,
          sass: int = 0) -> bool:
    """Compile the kernels (`names`, default all) the library would launch for these shapes; True when all fit the
    target's shared memory (or `limit_kb`). Prints one row each."""
    todo = []
    for arch in archs:
        for d in head_dims:
            for dv in head_dims:
                for dt in dtypes:
                    reason = oal_triton.refusal(d, dv, DTYPES[dt], arch)
                    if reason:
                        out(f"sm_{arch} d={d:<3d} dv={dv:<3d} {dt:4s} refused (auto runs chunked): {reason}")
                        continue
                    todo += [(d, dv, dt, arch, i, limit_kb, sass) for i in _selected(d, dv, dt, arch, names)]
    ok = True
    with ProcessPoolExecutor(jobs) if jobs > 1 else contextlib.nullcontext() as pool:
        for fits, row in (pool.map(_job, todo) if pool else map(_job, todo)):
            ok &= fits
            out(row, flush=True)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--head-dims", default="64", help="d and dv values; every pair (d, dv) is compiled")
    parser.add_argument("--dtypes", default="bf16,fp32", help="input dtypes: bf16, fp16, fp32")
    parser.add_argument("--arch", default="90,80", help="targets: 90 (H100/H200), 80 (A100), or both: 90,80")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"a subset of: {', '.join(KERNELS)}")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes")
    parser.add_argument("--shared-limit-kb", type=int, default=None,
                        help="fail above this many KB instead of the target's limit (to check that the check fails)")
    parser.add_argument("--sass", action="store_true",
                        help="also print each kernel's hot loops' instruction mix (scripts/triton_sass.py)")
    parser.add_argument("--sass-listing", action="store_true",
                        help="with the mix, the largest loop's instructions as cuobjdump prints them")
    args = parser.parse_args()
    dtypes = args.dtypes.split(",")
    archs = [int(a) for a in args.arch.split(",")]
    names = args.kernels.split(",")
    if bad := [dt for dt in dtypes if dt not in DTYPES] or [a for a in archs if a not in F.SHARED_LIMIT]:
        parser.error(f"--dtypes/--arch: unknown dtype or arch: {bad}")
    if bad := [n for n in names if n not in KERNELS]:
        parser.error(f"--kernels: unknown kernels {bad}; expected some of {', '.join(KERNELS)}")
    t0 = time.time()
    ok = check([int(x) for x in args.head_dims.split(",")], dtypes, archs, args.jobs, names, args.shared_limit_kb,
               sass=2 if args.sass_listing else int(args.sass))
    print(f"{'all kernels fit' if ok else 'SOME KERNELS DO NOT FIT'} ({time.time() - t0:.0f} s)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
