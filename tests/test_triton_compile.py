"""The Triton kernels compile for an H100/H200 (sm_90) and an A100 (sm_80) within one block's shared memory.

Runs scripts/triton_sm90_check.py (Triton's compiler and the ptxas it bundles; no GPU). The full grid (d, dv in
{64, 128}, bf16/fp16/fp32, both targets: 621 compilations with every autotuning candidate) takes 7 minutes on 2
free cores, so CI compiles the H200's main kernel, the output kernel at d = dv = 64 in bf16 with every tile its
autotuner may pick (101 KB at most), and the kernels closest to their target's limit: for sm_90 the fp32 parallel
dk/dv at d = dv = 64 (192 of 227 KB), for sm_80 dk/dv at d = dv = 128 in bf16 (153 of 163 KB) and in fp32 (160 of
163 KB), about 20-30 s of CPU each. The grid itself is run by hand (docs/design/gpu-kernels.md). The interpreter
setting of conftest.py is removed for the subprocess, since the interpreter does not compile.
"""

from __future__ import annotations

import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")  # in the dev extra on Linux; no other reason to skip

from oal.ops.triton.tiles import FWD_CANDIDATES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _check(kernel: str, head_dims: str, *args: str) -> tuple[int, list[str], str, list[str]]:
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, str(ROOT / "scripts" / "triton_sm90_check.py"), "--head-dims", head_dims,
           "--kernels", kernel, *args]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(res.stdout, f"compile check: {cpu1.ru_utime + cpu1.ru_stime - cpu0.ru_utime - cpu0.ru_stime:.1f} s of CPU")
    lines = res.stdout.splitlines()
    return res.returncode, [line for line in lines if line.startswith("sm_")], res.stderr, lines


@pytest.mark.slow
@pytest.mark.parametrize(("kernel", "head_dims", "dtype", "arch"),
                         [("fwd", "64", "bf16", "90"), ("par dkv", "64", "fp32", "90"), ("dkv", "128", "bf16", "80"),
                          ("dkv", "128", "fp32", "80")])
def test_largest_kernels_fit_their_target(kernel, head_dims, dtype, arch):
    rc, rows, err, _ = _check(kernel, head_dims, "--dtypes", dtype, "--arch", arch)
    assert rc == 0 and rows, (rows, err[-2000:])  # the output kernel: its table entry and every autotune candidate
    assert all("shared" in row and "OVER" not in row and f"sm_{arch}" in row for row in rows), rows


def test_the_check_compiles_with_a_launchs_alignment_hints():
    """Triton specialises a launch on 16-byte aligned pointers and integers divisible by 16; the check gives its
    compiles the same hints (without them the loads are not vectorised and ptxas reports other registers and
    spills than the GPU runs): every pointer, the head dims, the length and the chunk counts; not R (2625 rows at
    d = 64) nor the group count."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import triton_sm90_check as check
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    _, fn, sig, _, _ = next(row for row in check.kernels(64, 64, "bf16", 90) if row[0] == "fwd")
    hinted = {fn.arg_names[key[0]] for key in check.launch_hints(fn, sig)}
    assert {"Q", "ST", "STN", "O", "STATUS", "N", "d", "dv", "n_cs"} <= hinted
    assert not {"R", "g1", "n_q", "NBKT"} & hinted
    assert all(attrs == [["tt.divisibility", 16]] for attrs in check.launch_hints(fn, sig).values())



@pytest.mark.slow
def test_the_output_kernels_pair_loop_sums_nothing_across_lanes():
    """The normaliser of a half-precision forward is read out by a dot (`blocks._norm_cols`), not summed across
    the lanes of a warp: in every tile the autotuner may pick on sm_90, the output kernel's hot loop (its largest
    innermost one: the block-pair steps, or at 4 rows a step the intra-chunk loop) holds tensor-core MMAs and no
    lane shuffle. Summed in registers it held 130 shuffles of its 654 instructions at (RH 4, 3 stages), and issued
    about 5x its MMA time."""
    rc, rows, err, out = _check("fwd tuned", "64", "--dtypes", "bf16", "--arch", "90", "--sass-listing")
    assert rc == 0 and len(rows) == len(FWD_CANDIDATES[True, False, 90]), (rows, err[-2000:])
    heads = [i for i, line in enumerate(out) if line.startswith("sm_90")]
    hot = [out[i + 1] for i in heads]
    assert all(line.strip().startswith("loop of") for line in hot), out
    for line in hot:
        mma, shfl = (int(re.search(rf"{name} (\d+)", line)[1]) for name in ("mma", "shfl"))
        assert mma > 0 and shfl == 0, line
    # --sass-listing: the hot loop's instructions follow its mix, as many as the mix counts, its MMAs among them
    first = out[heads[0] + 1:heads[1]]
    listed = [line for line in first if re.match(r"\s+/\*[0-9a-f]+\*/", line)]
    assert len(listed) == int(re.search(r"loop of (\d+)", hot[0])[1]), first[:5]
    assert sum("HGMMA" in line for line in listed) == int(re.search(r"mma (\d+)", hot[0])[1])
