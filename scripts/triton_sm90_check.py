"""Compile the OAL Triton kernels for Hopper (sm_90) without a GPU and report their resources.

For each kernel, at the benchmark's shape (d = dv = 64, G = 5, Hq/Hkv = 7, 64-token chunks) and with the launch
options of `oal.ops.triton.function.LAUNCH`: compile time, shared memory, registers and spills (ptxas -v, the
ptxas bundled with triton), and the number of wgmma (Hopper tensor-core) instructions in the PTX. Exits 1 when a
kernel fails to compile or needs more shared memory than an H100/H200 block can have (227 KB). Slow: the fp32
kernels take minutes to compile on a small CPU.

    PYTHONPATH=src python scripts/triton_sm90_check.py                 # bf16 and fp32
    PYTHONPATH=src python scripts/triton_sm90_check.py --dtypes bf16
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from oal.ops.triton import function as F
from oal.ops.triton import kernels as K

MAX_SHARED = 227 * 1024
D, DV, C, REP = 64, 64, 64, 7


def compile_one(fn, sig: dict, const: dict, options: dict) -> dict:
    src = ASTSource(fn=fn, signature={**sig, **{name: "constexpr" for name in const}}, constexprs=const)
    t0 = time.time()
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        info = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", ptx, "-o", os.path.join(tmp, "k.o")],
                              capture_output=True, text=True).stderr
    regs = re.search(r"Used (\d+) registers", info)
    spill = re.search(r"(\d+) bytes spill stores", info)
    return {"s": time.time() - t0, "shared": compiled.metadata.shared, "regs": int(regs.group(1)) if regs else None,
            "spill": int(spill.group(1)) if spill else None, "wgmma": compiled.asm["ptx"].count("wgmma.mma_async")}


def kernels(dt: str):
    """(name, kernel, signature, constexprs, launch key) at the benchmark's shape, for input dtype `dt`."""
    half = dt != "fp32"
    dot = "bf16" if half else "fp32"
    lay = F.layout(D)
    cfg = F.Config(1e-6, 6, C, torch.bfloat16 if half else torch.float32, torch.float32)
    consts = F._consts(cfg, "fwd")  # the dtypes and the dot precision the library compiles with
    common = dict(DOT_DT=consts["DOT_DT"], ACC_DT=consts["ACC_DT"], PREC=consts["PREC"], NB=lay.nb, C=C, BV=DV)
    x, a = "*" + dt, "*fp32"
    scan_sig = dict(X=x, Y=x, NW=a, A=a, BS=a, CS=a, PAIRS="*i32", ST="*" + dot, STN=a, TOT=a, TOTN=a, CARRY=a,
                    CARRYN=a, N="i32", HX="i32", n_seg="i32", d="i32", dv="i32", R="i32", store="i32",
                    has_carry="i32")
    yield "scan keys", K._state_scan, scan_sig, dict(common, SEG=16, REP=1, NPAIR=lay.npair, QUERY=False,
                                                     REVERSE=False), "scan"
    yield "scan query", K._state_scan, dict(scan_sig, Y="*" + dot), dict(common, SEG=16, REP=REP, NPAIR=lay.npair,
                                                                          QUERY=True, REVERSE=True), "scan"
    big = dict(common, REP=REP, BD=lay.bd, NPAIR=lay.npair, GMAX=8)
    yield "fwd", K._fwd_out, dict(Q=x, K=x, V=x, A=a, BS=a, CS=a, WS=a, L0=a, PAIRS="*i32", ST="*" + dot, STN=a,
                                  O=x, DEN=a, N="i32", n_q="i32", n_cs="i32", d="i32", dv="i32", R="i32",
                                  eps="fp32", g1="i32"), big, "fwd"
    yield "dq", K._bwd_dq, dict(Q=x, K=x, V=x, GO="*" + dot, DL=a, BS=a, CS=a, WS=a, L0=a, PAIRS="*i32",
                                ST="*" + dot, STN=a, DQ=x, PART=a, N="i32", n_q="i32", n_c="i32", n_cs="i32",
                                d="i32", dv="i32", R="i32", P="i32", g1="i32"), big, "dq"
    dkv_sig = dict(Q=x, K=x, V=x, GO="*" + dot, DL=a, WS=a, L0=a, PAIRS="*i32", ST="*" + dot, STN=a, CARRY=a,
                   CARRYN=a, DK=x, DV=x, N="i32", n_q="i32", n_cs="i32", seg_len="i32", n_seg="i32", d="i32",
                   dv="i32", R="i32", eps="fp32", g1="i32")
    yield "dkv", K._bwd_dkv, dkv_sig, big, "dkv"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="bf16,fp32", help="input dtypes: bf16, fp16, fp32")
    args = parser.parse_args()
    bad = False
    for dt in args.dtypes.split(","):
        for name, fn, sig, const, key in kernels(dt):
            options = F.LAUNCH[key, dt != "fp32"]
            prec = const.get("PREC")
            try:
                r = compile_one(fn, sig, const, options)
            except Exception as err:  # report every kernel, then fail
                print(f"{dt:5s} {name:11s} FAILED TO COMPILE: {type(err).__name__}: {str(err).splitlines()[-1]}")
                bad = True
                continue
            over = r["shared"] > MAX_SHARED
            bad |= over
            print(f"{dt:5s} {name:11s} {options} dots {prec or 'default'}: compile {r['s']:5.1f} s, shared "
                  f"{r['shared'] / 1024:6.1f} KB{' (OVER 227 KB)' if over else ''}, regs {r['regs']}, spill "
                  f"{r['spill']} B, wgmma {r['wgmma']}", flush=True)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
