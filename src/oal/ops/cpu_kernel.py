"""The fused CPU kernel of the chunked operator (`csrc/readout.cpp`): readout and intra-chunk term, built for the
machine it runs on; and the decoding step of the token loop (`decode`: OAL's, and oal-swa's prefix state).

The torch path writes the query features phi(Q) to memory, 2145 values per query head and token at d = 64, and
reads them back in a GEMM; the fused kernel forms them in vector registers inside the GEMM's tiles instead (issue
36: features and readout were two thirds of a 16k-token call), and adds each chunk's own keys from a kappa block
built from the group sums (Eq. 7). It is plain C++ without torch headers, compiled with the system compiler
(`$CXX`, else `c++`, `g++`, `clang++`) and `-march=native` on first use, in about two seconds, into the user's
cache folder (`cache_root("kernels")`), keyed by the source, the flags, the compiler and the CPU. The build runs in a
locked temporary folder and only a finished library (0755 whatever the umask) is renamed into place, beside a
record of its SHA256; later processes load the built file only when its SHA256 is the recorded one (checked before
dlopen: a truncated or foreign file is built again, never loaded) and it has every symbol the kernel needs (else
this process runs the torch path and the file goes, so that the next one builds it again). `$OAL_CPU_MARCH` names
another target (e.g. x86-64-v3, AVX2, for the older machines of a mixed cluster). Called through ctypes, which
releases the GIL, so the operator's worker threads run it side by side (torch.utils.cpp_extension would compile
torch's headers too, a minute on 2 cores, and need ninja; the kernel only reads and writes float buffers).

It serves inference calls on CPU tensors in fp32 and bf16 (bf16 dot products where the CPU has AVX512_BF16, the
AMX tiles where it has AMX-BF16 and `OAL_CPU_AMX` is not 0) whose chunk is a multiple of the vector width, and
writes their normalised output itself; `ops.cpu_chain` builds the chain of chunk states with it. Everything else,
autograd and fp64 included, runs the torch path, which stays the reference (tests compare the two). Without a
compiler, or with `OAL_CPU_KERNEL=0`, the torch path runs everywhere (one log line says why).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path
from typing import NamedTuple

import torch

from oal.errors import env_flag
from oal.ops.kernel import feature_dim, row_maps
from oal.rundir.hashes import sha256_file
from oal.rundir.user_cache import SHARED_DIR, cache_root, checked_file, clean_stale, work_dir, write_record

__all__ = ["Heads", "Intra", "amx", "available", "bf16_dots", "build", "decode", "decodes", "describe", "enabled",
           "expected", "heads", "readout", "record", "supports", "vector_width", "window_decode"]

log = logging.getLogger("oal")

SOURCE = Path(__file__).with_name("csrc") / "readout.cpp"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
COMPILERS = ("c++", "g++", "clang++")
GMAX = 16  # groups + 1 that the intra-chunk term takes (GMAX in csrc/readout.cpp)

# bf16 queries run bf16 dot products where the CPU has them; False: the fp32 kernel on the widened queries (tests)
BF16_DOTS = True
# and their quadratic features on AMX tiles where the CPU has AMX-BF16 (`OAL_CPU_AMX=0`, or False: the dot products)
AMX = True

_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None = None
_TRIED = False
_STATUS = ""  # the built library's path, or why there is none
_SHA, _SAID_OFF = "", False  # the loaded library's SHA256 (`_load`); whether OAL_CPU_KERNEL=0 was said
DECODE_SPLIT = 1 << 20  # state entries (4 MB) per worker of a decoding call
SYMBOLS = ("oal_readout_vw", "oal_readout_bf16_dots", "oal_readout_amx", "oal_readout_f32", "oal_readout_bf16",
           "oal_states_bf16", "oal_states_f32", "oal_decode_f32", "oal_window_decode_f32")


def enabled() -> bool:
    """`OAL_CPU_KERNEL=0` turns the fused kernel off (the torch path then runs everywhere; one log line says so)."""
    global _SAID_OFF
    on = env_flag("OAL_CPU_KERNEL", True)
    if not on and not _SAID_OFF:
        _SAID_OFF = True
        log.info("OAL_CPU_KERNEL=0: the fused CPU kernel is off; the chunked operator runs its torch path")
    return on


def _flags() -> list[str]:
    return [*FLAGS, f"-march={os.environ.get('OAL_CPU_MARCH') or 'native'}"]


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return shutil.which(cxx)
    return next((path for path in map(shutil.which, COMPILERS) if path), None)


# ARM's /proc/cpuinfo has no model name or flags: these tell a Neoverse V1 (SVE) from an N1, which would run the
# V1's -march=native build into SIGILL (a cache in a home folder that a mixed cluster shares)
ARM_FIELDS = ("CPU implementer", "CPU architecture", "CPU variant", "CPU part", "CPU revision", "Features")


def _cpu_identity() -> str:
    """The CPU's model and every flag (-march=native compiles for all of them); on ARM its part and features."""
    model, flags, arm = "", "", {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = " ".join(sorted(value.split()))
            elif key in ARM_FIELDS and key not in arm:
                arm[key] = " ".join(sorted(value.split()))
    ident = f"{model}|{flags}" if model or flags else platform.processor()
    return ident + "".join(f"|{key}={arm[key]}" for key in ARM_FIELDS if key in arm)  # x86: unchanged


def _key(cxx: str) -> str:
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.split("\n")[0]
    parts = [SOURCE.read_bytes().hex(), " ".join(_flags()), version, _cpu_identity()]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _record(path: Path) -> Path:
    return path.with_suffix(".json")


def build(folder: Path | None = None) -> Path:
    """Compile the kernel for this machine once (a build of this key whose SHA256 is the recorded one is reused, another
    file there built again, with a warning); the library's path. RuntimeError: the compiler's first error line."""
    return _build(folder)[0]


def _build(folder: Path | None = None) -> tuple[Path, str]:
    """`build`, and the SHA256 of the library it checked or built (`_load` records it). Reused when its record names
    its key, flags, compiler (an earlier source's build copied in with its record has other signatures) and SHA256."""
    cxx = _compiler()
    if cxx is None and os.environ.get("CXX"):  # the user's choice is kept, not replaced by one found on PATH
        raise RuntimeError(f"CXX={os.environ['CXX']!r} is not a program on PATH (one word: the compiler); unset it "
                           f"to use one of {', '.join(COMPILERS)}")
    if cxx is None:
        raise RuntimeError(f"no C++ compiler found ($CXX, or one of {', '.join(COMPILERS)} on PATH)")
    folder = cache_root("kernels") if folder is None else folder
    key = _key(cxx)
    path = folder / f"readout-{key}.so"
    clean_stale(folder)  # what a killed build left, on every use
    problem, sha = checked_file(path, _record(path), key=key, flags=_flags(), compiler=cxx)
    if problem is None:
        return path, sha
    if problem != "missing":
        log.warning("%s: %s; building it again", path, problem)
    with work_dir(folder, path.stem) as tmp:  # only a finished library leaves it: never a half-written one
        out = tmp / path.name
        res = subprocess.run([cxx, *_flags(), "-o", str(out), str(SOURCE)], capture_output=True, text=True,
                             timeout=300)
        if res.returncode != 0 or not out.is_file():
            raise RuntimeError(f"{Path(cxx).name} failed on {SOURCE.name} (building into {folder}): "
                               f"{_first_error(res.stderr)}")
        os.chmod(out, SHARED_DIR)  # under umask 077 the compiler makes it 0700: no other user of the cache can load it
        sha = sha256_file(out)
        write_record(_record(path), {"sha256": sha, "key": key, "flags": _flags(), "compiler": cxx})
        os.replace(out, path)
    return path, sha


def _first_error(stderr: str) -> str:
    """The compiler's line that says why it failed. Not collect2's summary ("ld returned 1 exit status"): the
    linker's own line before it names the cause, such as a full cache ("final link failed: No space left on
    device")."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    summary = next((i for i, ln in enumerate(lines) if ln.startswith("collect2")), None)
    first = next((ln for ln in lines if "error" in ln), None)
    if summary is not None and first == lines[summary] and summary > 0:
        return lines[summary - 1]
    return first or (lines[0][:200] if lines else "no message")


class _NotTheKernel(OSError):
    """A library whose SHA256 is its record's but that lacks the kernel's functions (both put there by hand)."""


def _symbols(lib: ctypes.CDLL, path: Path) -> ctypes.CDLL:
    """`lib` with its functions' signatures set, or _NotTheKernel when one is missing (another library there)."""
    missing = [name for name in SYMBOLS if not hasattr(lib, name)]
    if missing:
        raise _NotTheKernel(f"{path} lacks {', '.join(missing)}: not the kernel this oal builds")
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    intra = [ptr] * 5 + [i32, f32]  # kb, ub, order, bounds, lower, groups, eps
    queries = [ptr, i64, i64, i64, i32]  # q, its batch, head and token strides, the batch
    final = [ptr, i64, i64, i64, i32]  # the normalised output, its strides, bf16 or not
    lib.oal_readout_vw.restype = lib.oal_readout_bf16_dots.restype = lib.oal_readout_amx.restype = i32
    lib.oal_readout_f32.argtypes = queries + [ptr] * 3 + [i64, i64] + [i32] * 5 + intra + final
    lib.oal_readout_bf16.argtypes = queries + [ptr] * 3 + [i64, i64] + [i32] * 6 + intra + final
    for chain in (lib.oal_states_bf16, lib.oal_states_f32):
        chain.restype = i32
        chain.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, i32, i64, i32, i32, i32, i32]
    lib.oal_decode_f32.argtypes = [ptr] * 7 + [i64, ptr, i64, i64] + [i32] * 5
    lib.oal_window_decode_f32.argtypes = [ptr] * 5 + [i64] + [ptr] * 4 + [i64, i64] + [i32] * 7 + [f32, f32]
    return lib


def _load() -> ctypes.CDLL | None:
    global _LIB, _TRIED, _STATUS, _SHA
    with _LOCK:
        if not _TRIED:
            _TRIED = True
            try:
                path, sha = _build()  # its SHA256 checked: a truncated file never reaches dlopen
                lib = _symbols(ctypes.CDLL(str(path)), path)
            except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                if isinstance(err, _NotTheKernel):  # this process keeps the torch path; the next builds it again
                    for stale in (path, _record(path)):
                        with contextlib.suppress(OSError):
                            stale.unlink()
                _STATUS = str(err)
                log.warning("oal: the fused CPU kernel is unavailable (%s); the chunked operator runs its torch "
                            "path", err)
            else:  # the SHA256 checked before dlopen is the one recorded: the file may go or change later
                _LIB, _STATUS, _SHA = lib, str(path), sha
        return _LIB


def available() -> bool:
    """Whether the fused kernel runs here (enabled, and built or buildable)."""
    return enabled() and _load() is not None


def expected() -> bool:
    """`available` without a build (before the first load: enabled and a compiler found), for `tuning.kernel_mode`."""
    return enabled() and (_LIB is not None if _TRIED else _compiler() is not None)


def record() -> dict:
    """What a run records of the kernel its numbers came from: whether it runs and, when it does, the library's
    file name (it holds the build key: source, flags, compiler, CPU), its SHA256 when loaded (the file may have gone
    since: a cache cleared under a long run) and the paths it takes; no local path."""
    if not available():
        return {"runs": False, "why": "OAL_CPU_KERNEL=0" if not enabled() else "unavailable"}
    path = Path(_STATUS)
    return {"runs": True, "library": path.name, "sha256": _SHA, "vector_width": vector_width(),
            "bf16": "amx" if amx() else "dots" if bf16_dots() else "fp32"}


def describe() -> str:
    """One line: whether the fused kernel runs here, how, and from which file (or why not)."""
    if not enabled():
        return "fused CPU kernel: off (OAL_CPU_KERNEL=0); the torch path runs"
    if _load() is None:
        return f"fused CPU kernel: unavailable ({_STATUS}); the torch path runs"
    dots = "bf16 widened to fp32"
    if bf16_dots():
        dots = "AMX tiles for bf16 (readout and chunk states)" if amx() else "bf16 dot products for bf16"
    return f"fused CPU kernel: {vector_width()}-wide fp32 vectors, {dots} ({_STATUS})"


def vector_width() -> int:
    lib = _load()
    return lib.oal_readout_vw() if lib is not None else 0


def bf16_dots() -> bool:
    """Whether bf16 queries run bf16 dot products here (the CPU has AVX512_BF16), rather than the fp32 kernel."""
    lib = _load()
    return BF16_DOTS and lib is not None and bool(lib.oal_readout_bf16_dots())


def amx() -> bool:
    """Whether bf16 queries run their quadratic features on AMX tiles here (the CPU has AMX-BF16 and Linux grants
    the tile registers; not with `OAL_CPU_AMX=0`), rather than the vector dot products (`bf16_dots`)."""
    lib = _load()
    return (bf16_dots() and AMX and env_flag("OAL_CPU_AMX", True)
            and bool(lib.oal_readout_amx()))


def supports(q: torch.Tensor, state_dtype: torch.dtype, chunk: int) -> bool:
    """Whether `readout` takes queries q [B, Hq, N, d] in chunks of `chunk` tokens against a state of `state_dtype`:
    CPU, no autograd, an fp32 state, fp32 or bf16 queries whose last dim is contiguous, and a chunk that is a multiple
    of the vector width."""
    if not enabled() or q.device.type != "cpu" or state_dtype != torch.float32:
        return False
    if q.stride(-1) != 1 and q.shape[-1] > 1:  # a dim of size 1 has any stride
        return False
    if q.dtype not in (torch.float32, torch.bfloat16) or torch.is_grad_enabled() and q.requires_grad:
        return False
    vw = vector_width()
    return vw > 0 and chunk % vw == 0


class Intra(NamedTuple):
    """The intra-chunk term's inputs (Eq. 7 inside each chunk), for `readout`: kb [nc, B, Hkv, C, d+1] the chunk's
    keys token-major (the last column is not read), ub [nc, B, Hkv, C, dv+1] their values with the denominator's
    column, all fp32; per query head order [Hq, d] its dims sorted by group and bounds [Hq, G+1] where each group
    starts in that order (bounds[:, G] = d), int32; lower [Hq, G+1, G+1] fp32, L with rows 1..G times scale."""

    kb: torch.Tensor
    ub: torch.Tensor
    order: torch.Tensor
    bounds: torch.Tensor
    lower: torch.Tensor
    eps: float


class Heads(NamedTuple):
    """What the kernel needs of the query heads: rows [Hq, F] fp32, the query coefficients (Eq. 6), and for the
    intra-chunk term (`Intra`) order, bounds and lower, or None (more groups than it takes)."""

    rows: torch.Tensor
    order: torch.Tensor | None
    bounds: torch.Tensor | None
    lower: torch.Tensor | None

    def select(self, a: int, b: int) -> Heads:
        """Query heads a..b (a KV-head group of the operator's workers)."""
        return Heads(*(None if t is None else t[a:b] for t in self))


def heads(w_rows: torch.Tensor, groups: torch.Tensor, factor: torch.Tensor, scale: float) -> Heads:
    """`Heads` from the query coefficients w_rows [Hq, F], groups [Hq, d] and factor [Hq, G+1, G+1]."""
    rows = w_rows.detach().to(torch.float32).contiguous()
    g1 = factor.shape[-1]
    if g1 > GMAX:
        return Heads(rows, None, None, None)
    groups = groups.long()
    order = groups.argsort(dim=1, stable=True).to(torch.int32).contiguous()
    counts = torch.nn.functional.one_hot(groups, g1 - 1).sum(1)
    bounds = torch.cat([counts.new_zeros(counts.shape[0], 1), counts.cumsum(1)], dim=1).to(torch.int32)
    lower = torch.tril(factor.detach()).to(torch.float32).clone()
    lower[:, 1:] *= scale  # s_g carries the scale (Eq. 7)
    return Heads(rows, order, bounds.contiguous(), lower.contiguous())


def readout(q: torch.Tensor, w: torch.Tensor, states: torch.Tensor, out: torch.Tensor | None,
            intra: Intra | None = None, final: torch.Tensor | None = None) -> torch.Tensor:
    """num^T = S^T phi(Q)^T for every (chunk, batch, KV head), written into `out` (Eq. 6), phi(Q) = w * psi(Q);
    with `intra` plus each chunk's own keys, sum_{l <= i in the chunk} kappa(i, l) u_l (Eq. 7), so that `out` is
    the whole numerator. With `final` the kernel divides each item's numerator by its denominator itself and writes
    the output there instead (then `out` is None and `final` is returned): final [B, Hq, nc * C, dv] fp32 or
    bf16, dv contiguous (a view of the operator's output).

    q [B, Hkv * rep, nc * C, d] (fp32 or bf16, its last dim contiguous: the operator's queries, each item gathers
    its own), w [Hkv, rep, F] fp32, states [nc, B, Hkv, F, dv+1] fp32 and out [nc, B, Hkv, dv+1, rep * C] fp32
    contiguous (`supports`); C = N / nc. bf16 q runs bf16 dot products for the quadratic features where the CPU
    has them (`bf16_dots`; on AMX tiles where it has those, `amx`), else the fp32 kernel on q widened exactly.
    With more than one torch thread the items are split over the operator's workers (`ops.workers`)."""
    lib = _load()
    n_kv, rep, feats = w.shape
    n_c, bsz, dv1 = states.shape[0], states.shape[1], states.shape[-1]
    d, c = q.shape[-1], q.shape[2] // max(n_c, 1)
    # the C side trusts these layouts: a wrong one would read or write out of bounds, not raise
    if (q.dtype not in (torch.float32, torch.bfloat16) or q.dim() != 4 or (q.stride(-1) != 1 and q.shape[-1] > 1)
            or tuple(q.shape[:3]) != (bsz, n_kv * rep, n_c * c) or c % vector_width() or q.device.type != "cpu"):
        raise ValueError(f"q: expected float32 or bfloat16 queries [{bsz}, {n_kv * rep}, nc * C, d] for {n_c} chunks "
                         f"of a multiple of {vector_width()} tokens, last dim contiguous, got {q.dtype} "
                         f"{list(q.shape)}")
    checks = [("w", w, (n_kv, rep, feature_dim(d))), ("states", states, (n_c, bsz, n_kv, feature_dim(d), dv1))]
    if (out is None) == (final is None):
        raise ValueError("readout: pass exactly one of out (the numerator) and final (the output)")
    if out is not None:
        checks.append(("out", out, (n_c, bsz, n_kv, dv1, rep * c)))
    for name, t, shape in checks:
        if t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"{name}: expected a contiguous float32 CPU tensor of shape {list(shape)}, got "
                             f"{t.dtype} {list(t.shape)}{'' if t.is_contiguous() else ' (not contiguous)'}")
    fin = (None, 0, 0, 0, 0)
    if final is not None:
        shape = (bsz, n_kv * rep, n_c * c, dv1 - 1)
        if (final.dtype not in (torch.float32, torch.bfloat16) or tuple(final.shape) != shape
                or (final.stride(-1) != 1 and final.shape[-1] > 1) or final.device.type != "cpu"):
            raise ValueError(f"final: expected a float32 or bfloat16 CPU tensor of shape {list(shape)} whose last "
                             f"dim is contiguous, got {final.dtype} {list(final.shape)} strides {final.stride()}")
        fin = (final.data_ptr(), *final.stride()[:3], int(final.dtype == torch.bfloat16))
    extra = (None, None, None, None, None, 0, 0.0)
    if intra is not None:
        g1 = intra.lower.shape[-1]
        for name, t, shape, dtype in (("kb", intra.kb, (n_c, bsz, n_kv, c, d + 1), torch.float32),
                                      ("ub", intra.ub, (n_c, bsz, n_kv, c, dv1), torch.float32),
                                      ("order", intra.order, (n_kv * rep, d), torch.int32),
                                      ("bounds", intra.bounds, (n_kv * rep, g1), torch.int32),
                                      ("lower", intra.lower, (n_kv * rep, g1, g1), torch.float32)):
            if t.dtype != dtype or tuple(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
                raise ValueError(f"intra.{name}: expected a contiguous {dtype} CPU tensor of shape {list(shape)}, "
                                 f"got {t.dtype} {list(t.shape)}")
        if not 2 <= g1 <= GMAX:
            raise ValueError(f"intra.lower: 1 to {GMAX - 1} groups, got {g1 - 1}")
        extra = (*(t.data_ptr() for t in intra[:5]), g1 - 1, float(intra.eps))
    items = n_c * bsz * n_kv
    dims = (n_kv, d, rep, c, dv1)
    ptrs = (q.data_ptr(), *q.stride()[:3], bsz, w.data_ptr(), states.data_ptr(),
            None if out is None else out.data_ptr())
    mode = 2 if amx() else int(bf16_dots())  # oal_readout_bf16's mode

    def run(begin: int, end: int) -> None:
        if q.dtype == torch.float32:
            lib.oal_readout_f32(*ptrs, begin, end, *dims, *extra, *fin)
        else:
            lib.oal_readout_bf16(*ptrs, begin, end, *dims, mode, *extra, *fin)

    _split(run, items, min(torch.get_num_threads(), items))
    return out if final is None else final


def decodes(state: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """Whether `decode` takes a decoding call on `state` [B, Hkv, F, dv+1] (or `window_decode` on a window state
    [B, Hkv, size]): CPU, fp32, each head's rows contiguous, no autograd through it or `tensors`, and the kernel
    built."""
    if not enabled() or state.device.type != "cpu" or state.dtype != torch.float32:
        return False
    if state.dim() == 3:  # a window state: `window_decode` reads it whole
        rows = state.is_contiguous()
    else:
        rows = state.stride(-1) == 1 and state.stride(-2) == state.shape[-1] and \
            state.stride(0) == state.shape[1] * state.stride(1)
    if not rows:
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (state, *tensors)):
        return False
    return _load() is not None


def decode(k: torch.Tensor, u: torch.Tensor, q: torch.Tensor, w: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """T tokens of the token loop on `state`, updated in place (Eq. 5: S += psi(k_t) u_t; `decodes`), and the
    numerators num [B, Hq, T, dv+1] of each token's queries after its own update (Eq. 6: phi(q) S, phi = w psi).

    k [B, Hkv, T, d], u [B, Hkv, T, dv+1] (the rows added: [v, 1], or a window's evicted [v, w]), q [B, Hq, T, d],
    w [Hq, F] the query coefficients; any float dtype (made fp32 contiguous here). One pass over the state for all
    T tokens, in C (`oal_decode_f32`); with more than one torch thread the (batch row, KV head) items are split over
    the operator's workers."""
    lib = _load()
    bsz, n_kv, n_t, d = k.shape
    n_q, dv1 = q.shape[1], state.shape[-1]
    feats = feature_dim(d)
    # the C side trusts these shapes: a wrong one would read or write out of bounds, not raise
    want = {"u": (bsz, n_kv, n_t, dv1), "q": (bsz, n_q, n_t, d), "w": (n_q, feats), "state": (bsz, n_kv, feats, dv1)}
    for name, t in (("u", u), ("q", q), ("w", w), ("state", state)):
        if tuple(t.shape) != want[name]:
            raise ValueError(f"{name}: expected shape {list(want[name])}, got {list(t.shape)}")
    if n_q % n_kv:
        raise ValueError(f"q: {n_q} query heads is not a multiple of k's {n_kv} KV heads")
    k, u, q, w = (t.detach().to(torch.float32).contiguous() for t in (k, u, q, w))
    rowr, rowt = row_maps(d, torch.device("cpu"))
    num = q.new_empty(bsz, n_q, n_t, dv1)
    items = bsz * n_kv
    ptrs = (k.data_ptr(), u.data_ptr(), q.data_ptr(), w.data_ptr(), rowr.data_ptr(), rowt.data_ptr(),
            state.data_ptr(), state.stride(1), num.data_ptr())
    dims = (n_kv, d, n_q // n_kv, n_t, dv1)

    def run(begin: int, end: int) -> None:
        lib.oal_decode_f32(*ptrs, begin, end, *dims)

    _split(run, items, _decode_threads(items, state[0, 0].numel()))
    return num


def _decode_threads(items: int, per_item: int) -> int:
    """Workers of a decoding call: the operator's workers cost about 0.1 ms a call (measured on 2 cores), worth it
    from a few MB of state (DECODE_SPLIT entries each), not at batch 1."""
    return min(torch.get_num_threads(), items, max(1, per_item * items // DECODE_SPLIT))


def _split(run, items: int, threads: int) -> None:
    """run(begin, end) over the items, split evenly over `threads` of the operator's workers (one: in this
    thread)."""
    if threads <= 1:
        run(0, items)
        return
    from oal.ops import workers

    workers.workers(threads).run(run, [(i * items // threads, (i + 1) * items // threads) for i in range(threads)])


def window_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, *, window: int, sinks: int,
                  scale: float, kernel=None) -> torch.Tensor:
    """T tokens of swa / oal-swa on `state` [B, Hkv, size] (`oal.ops.window.state`; fp32, contiguous), updated in
    place, in C (`oal_window_decode_f32`, the token loop of `window.recurrent`); returns out [B, Hq, T, dv] fp32.
    `kernel`: oal-swa's (kq, weights [Hq, F], log_lam: a number) of `window.Kernel`, or None (swa)."""
    lib = _load()
    bsz, n_q, n_t, d = q.shape
    n_kv, dv = k.shape[1], v.shape[-1]
    from oal.ops.window.state import window_state_size

    size = window_state_size(d, dv, window, sinks, kernel is not None)
    if tuple(state.shape) != (bsz, n_kv, size) or state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"state: expected a contiguous float32 tensor of shape {[bsz, n_kv, size]}, got "
                         f"{state.dtype} {list(state.shape)}")
    q, k, v = (t.detach().to(torch.float32).contiguous() for t in (q, k, v))
    kq, w, log_lam = q, None, 0.0
    if kernel is not None:
        kq, w, log_lam = kernel
        feats = feature_dim(d)
        if tuple(w.shape) != (n_q, feats) or tuple(kq.shape) != tuple(q.shape):
            raise ValueError(f"kernel: expected queries {list(q.shape)} and weights {[n_q, feats]}, got "
                             f"{list(kq.shape)} and {list(w.shape)}")
        kq, w = (t.detach().to(torch.float32).contiguous() for t in (kq, w))
    rowr, rowt = row_maps(d, torch.device("cpu"))
    out = q.new_empty(bsz, n_q, n_t, dv)
    ptrs = (q.data_ptr(), kq.data_ptr(), k.data_ptr(), v.data_ptr(), state.data_ptr(), size,
            None if w is None else w.data_ptr(), rowr.data_ptr(), rowt.data_ptr(), out.data_ptr())
    dims = (n_kv, d, dv, n_q // n_kv, n_t, sinks, window, float(scale), float(log_lam))

    def run(begin: int, end: int) -> None:
        lib.oal_window_decode_f32(*ptrs, begin, end, *dims)

    _split(run, bsz * n_kv, _decode_threads(bsz * n_kv, size))
    return out
