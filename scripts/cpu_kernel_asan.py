"""Run the fused CPU kernel (src/oal/ops/csrc/readout.cpp) under AddressSanitizer at odd shapes.

The kernel reads and writes raw buffers from C; an off-by-one in a tile or pair loop would corrupt memory silently.
This builds it with -fsanitize=address into a temporary cache folder, re-executes Python with libasan preloaded,
and checks fp32 and bf16, causal and not, odd d and dv, GQA, 1 to 15 groups, and the decoding steps (OAL's and
the sliding windows'), against the float64 reference. Exit 0 when clean; ASan aborts the process on a bad access.

    python scripts/cpu_kernel_asan.py                     # -march=native
    python scripts/cpu_kernel_asan.py --march x86-64-v3   # the AVX2 build (8-wide), x86-64: the 4-wide one
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

# (B, Hq, Hkv, N, d, dv, chunk in vectors, groups)
SHAPES = [(1, 14, 2, 700, 64, 64, 2, 5), (2, 3, 1, 261, 5, 7, 1, 3), (1, 4, 2, 333, 17, 12, 3, 4),
          (1, 2, 2, 100, 1, 1, 1, 1), (1, 6, 3, 129, 9, 30, 4, 15), (2, 2, 1, 40, 3, 150, 1, 2),
          (2, 3, 1, 300, 5, 150, 2, 3)]  # the last: bf16's chain of states on AMX with a part of 5 rows, 7 columns


def _libasan() -> str:
    cxx = os.environ.get("CXX", "c++")
    path = subprocess.run([cxx, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not os.path.isabs(path):
        sys.exit(f"{cxx} has no libasan.so (install the compiler's AddressSanitizer runtime)")
    return path


def check() -> float:
    import torch

    from oal.ops import chunked, cpu_kernel, oal_attention, tuning
    from oal.ops.kernel import perturbed_factor, taylor_factor

    # -O1 (after the kernel's -O3, so it wins): every access the source makes is instrumented at any level, and the
    # build takes 8 s rather than 24 s at -O3 (the sanitizers' own advice for a usable build)
    cpu_kernel.FLAGS = (*cpu_kernel.FLAGS, "-O1", "-fsanitize=address", "-fno-omit-frame-pointer", "-g")
    if not cpu_kernel.available():
        sys.exit(cpu_kernel.describe())
    print(cpu_kernel.describe())
    chunked.NAN_SCRATCH = True
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for b, hq, hkv, n, d, dv, vectors, g in SHAPES:
        q, k, v = (torch.randn(b, h, n, dd, generator=gen) for h, dd in ((hq, d), (hkv, d), (hkv, dv)))
        groups = torch.randint(0, g, (hq, d), generator=gen)
        factor = perturbed_factor(taylor_factor(hq, g), 0.3, generator=gen)
        settings = tuning.Settings(vectors * cpu_kernel.vector_width(), 2)
        for dtype in (torch.float32, torch.bfloat16):
            for causal in (True, False):
                x = [t.to(dtype) for t in (q, k, v)]
                with torch.inference_mode(), tuning.forced(settings):
                    out = oal_attention(*x, groups, factor, backend="chunked", causal=causal)
                ref = oal_attention(*(t.double() for t in x), groups, factor.double(), backend="reference",
                                    causal=causal)
                err = float((out.double() - ref).norm() / ref.norm())
                limit = 1e-5 if dtype == torch.float32 else 2e-2
                if not (torch.isfinite(out).all() and err < limit):
                    sys.exit(f"B={b} Hq={hq} d={d} dv={dv} G={g} {dtype} causal={causal}: relative error {err:.2e}")
                worst = max(worst, err) if dtype == torch.float32 else worst
        worst = max(worst, _decode(q, k, v, groups, factor))
    return worst


def _decode(q, k, v, groups, factor) -> float:
    """The decoding steps (`oal_decode_f32`: 1, then 3 tokens on a state; `oal_window_decode_f32`: 4 tokens of
    oal-swa and of swa) against the reference's last outputs."""
    import torch

    from oal.ops import oal_attention

    n = q.shape[2]
    _, state = oal_attention(q[:, :, : n - 4], k[:, :, : n - 4], v[:, :, : n - 4], groups, factor,
                             output_final_state=True)
    worst = 0.0
    for t in (1, 3):
        span = slice(n - 4, n - 4 + t)
        with torch.inference_mode():
            out = oal_attention(q[:, :, span], k[:, :, span], v[:, :, span], groups, factor, initial_state=state,
                                backend="recurrent")
        ref = oal_attention(*(x[:, :, : n - 4 + t].double() for x in (q, k, v)), groups, factor.double(),
                            backend="reference")[:, :, -t:]
        err = float((out.double() - ref).norm() / ref.norm())
        if not (torch.isfinite(out).all() and err < 1e-5):
            sys.exit(f"decoding {t} tokens, d={q.shape[-1]} dv={v.shape[-1]}: relative error {err:.2e}")
        worst = max(worst, err)
    from oal.ops.window import window_attention

    for kw in (dict(window=5, sinks=2, groups=groups, factor=factor.float()), dict(window=3, sinks=0)):
        _, state = window_attention(q[:, :, : n - 4], k[:, :, : n - 4], v[:, :, : n - 4], output_final_state=True,
                                    **kw)
        with torch.inference_mode():  # `oal_window_decode_f32`
            out = window_attention(q[:, :, n - 4 :], k[:, :, n - 4 :], v[:, :, n - 4 :], initial_state=state, **kw)
        wide = {key: val.double() if key == "factor" else val for key, val in kw.items()}
        ref = window_attention(q.double(), k.double(), v.double(), backend="reference", **wide)[:, :, n - 4 :]
        err = float((out.double() - ref).norm() / ref.norm())
        if not (torch.isfinite(out).all() and err < 1e-5):
            sys.exit(f"window decoding, {sorted(kw)}, d={q.shape[-1]} dv={v.shape[-1]}: relative error {err:.2e}")
        worst = max(worst, err)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--march", default="native", help="the -march target to build for")
    args = parser.parse_args()
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # the runtime must be loaded before the interpreter
        with tempfile.TemporaryDirectory(prefix="oal-asan-") as cache:  # the instrumented build is not kept
            env = os.environ | {"LD_PRELOAD": _libasan(), "ASAN_OPTIONS": "detect_leaks=0", "OAL_CACHE_DIR": cache,
                                "OAL_CPU_MARCH": args.march}
            code = subprocess.run([sys.executable, *sys.argv], env=env).returncode
        sys.exit(code)
    worst = check()
    print(f"clean under AddressSanitizer; largest fp32 relative error {worst:.2e}")


if __name__ == "__main__":
    main()
