#!/usr/bin/env bash
# The next GPU session's run for issue 46 (speed), in one call of the `device` tool on the lent H200 (the issue's
# acceptance names the H200: ask for kind="nvidia-h200"; on another card the files below carry its tag instead):
#
#   run(command="bash scripts/gpu_perf.sh", kind="nvidia-h200", timeout_s=540)          # no carry needed
#
# Parts, each under its own `timeout` (a failing or timed-out part does not stop the next; the benchmarks write
# their JSON after every step, so a time-out keeps what finished):
#   env       (ENV_S)    versions and the device
#   tests     (TESTS_S)  the Triton kernels compiled on the GPU against the fp64 reference: tests/test_triton.py,
#                        tests/test_triton_paths.py (parallel and decoding kernels), tests/test_ops_deferred.py
#                        (the value checks on the device, here on real CUDA), tests/test_window_triton_decode.py
#                        (the swa / oal-swa decoding kernels), tests/test_ops_plans.py (decoding calls that run a
#                        kept plan, and their shared status copied to pinned memory), tests/test_ops_prefill_plans.py
#                        (fresh sequences that run a kept plan, the autotuned forward kernel's)
#   direct    (DIRECT_S) the plans' kernels launched through the compiled kernels' own launchers
#                        (OAL_TRITON_DIRECT_LAUNCH=1, `oal.ops.triton.launch`, opt-in until measured):
#                        tests/test_ops_plans.py, tests/test_ops_prefill_plans.py and
#                        tests/test_window_triton_decode.py with it, on real CUDA (the CPU runs
#                        tests/test_triton_launch.py, its stand-in)
#   bench     (BENCH_S)  benchmarks.gpu: OAL against torch's default SDPA (and forced flash, cuDNN), N = 2k..128k
#   generate  (GEN_S)    benchmarks.generate: tokens/s and peak memory, SmolLM2-135M and Qwen2.5-0.5B shapes,
#                        softmax / the preset's oal / the recipe's oal-swa, contexts 32k (the goal's) first, then
#                        64k and 8k, batch 1 and max
#   host      (HOST_S)   benchmarks.decode_host: host time per attention layer of a decoding step at batch 1,
#                        softmax against oal / oal-swa / swa layers in the same steps, each also with the direct
#                        launches (--direct-launch); and of one 2k prefill call against default SDPA's
#   bf16      (BF16_S)   tests/test_triton_gpu.py: bf16 dots at N = 16k, d = dv = 128, against fp64 and bf16 SDPA
#   profile   (PROF_S)   torch.profiler kernel tables of one OAL forward and one forward + backward at 16k (and
#                        with NCU=1, Nsight Compute's SpeedOfLight, SchedulerStats and Occupancy of the chunked
#                        kernels of one of each appended, NCU_S: whether each is bound by issue or by memory)
# A part whose limit is 0 is skipped. About 9 minutes at most with the defaults (the limits add up to 515 s),
# usually less. What comes back in $OUT (8 files, the device tool's limit): summary.txt, tests.log, bench.log,
# gpu_TAG.json, generate_TAG.json, decode_host_TAG.json, profile.txt and figures.tar (the PNG of each benchmark),
# where TAG names the card (h200, h100, ...: scripts/device_tag.py; cpu in a dry run; $GPU_TAG overrides it).
# Copy the JSON files and the PNGs (tar -xf figures.tar) to benchmarks/reference/ (the README cites them).
#
# The machine has python3 3.12, torch 2.11 (cu130), triton 3.6.0, transformers, peft, pytest, pytest-xdist; `oal`
# runs from src via PYTHONPATH (never pip install it there: it pins torch 2.13.0 and nothing can be downloaded).
#
# DEVICE=cpu (or DRY_RUN=1): every part at tiny sizes on the CPU, the kernels under Triton's interpreter, to test
# this script's logic without a GPU (tests/test_gpu_perf_script.py). Outside the device tool, OUT defaults to
# benchmarks/results/gpu_perf (ignored by git).
set -u
OUT="${OUT:-$PWD/benchmarks/results/gpu_perf}"
mkdir -p "$OUT"
[ "${DRY_RUN:-0}" = "1" ] && DEVICE=cpu
DEVICE="${DEVICE:-cuda}"
ENV_S="${ENV_S:-20}"
TESTS_S="${TESTS_S:-100}"
DIRECT_S="${DIRECT_S:-25}"
BENCH_S="${BENCH_S:-110}"
GEN_S="${GEN_S:-130}"
HOST_S="${HOST_S:-40}"
BF16_S="${BF16_S:-50}"
PROF_S="${PROF_S:-40}"
NCU_S="${NCU_S:-60}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
rm -f "$OUT/figures.tar"  # the figures are appended part by part: never to an earlier run's

note() { echo "$*" | tee -a "$SUMMARY"; }

# the figures in one file, after every part: the device tool returns at most 8 files, and a call cut off at its
# limit returns what is there, so the PNGs must never stand loose beside the 7 other files
pack_figures() {
    (cd "$OUT" && ls ./*.png >/dev/null 2>&1 && tar -rf figures.tar ./*.png && rm -f ./*.png) || true
}

# part NAME LOG SECONDS CMD...: run CMD under a time limit, append to $OUT/LOG, record the outcome, never abort
part() {
    local name="$1" log="$OUT/$2" limit="$3"
    shift 3
    local t0=$SECONDS rc
    if [ "$limit" = "0" ]; then  # `timeout 0` would mean no limit at all
        note "$name: skipped (limit 0)"
        return 0
    fi
    echo "== $name (limit ${limit}s): $*" | tee -a "$log"
    timeout --signal=INT --kill-after=15 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    pack_figures  # before the outcome's line: once a part is recorded, its figure is packed
    if [ "$rc" -eq 0 ]; then
        note "$name: ok ($((SECONDS - t0)) s)"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 130 ] || [ "$rc" -eq 137 ]; then
        note "$name: TIMED OUT after $((SECONDS - t0)) s (rc $rc); partial output in $(basename "$log")"
    else
        note "$name: FAILED rc $rc ($((SECONDS - t0)) s); see $(basename "$log")"
    fi
    return 0
}

if [ "$DEVICE" = "cpu" ]; then  # tiny sizes, the interpreter
    export TRITON_INTERPRET=1 OAL_TEST_DEVICE=cpu OPENBLAS_NUM_THREADS=1
    TESTS=(tests/test_triton_paths.py -k "N1 or T1")
    XDIST=()
    # the sanity check runs the chunked kernels (forward and backward); their timed forward would add 20 s here
    BENCH=(--device cpu --lengths 32 --repeats 1 --warmup 0 --sanity-n 32 --methods oal,sdpa)
    GEN=(--device cpu --shapes smollm2-135m --contexts 128 --batches 1 --tokens 1 --warmup 0 --prompt 80)
    PROF=(--device cpu --profile 64)
    HOST=(--device cpu --methods oal,swa --steps 5 --warmup 1 --prompt 8)
    # one case: the dry run checks this part's plumbing; the test suite runs every case of the file
    DIRECT=("tests/test_triton_launch.py::test_direct_launches_give_the_planned_results_bit_for_bit[oal-swa-11]")
else
    unset TRITON_INTERPRET
    export OAL_TEST_DEVICE=cuda
    TESTS=(tests/test_triton.py tests/test_triton_paths.py tests/test_ops_deferred.py tests/test_window_triton_decode.py
           tests/test_ops_plans.py tests/test_ops_prefill_plans.py)
    XDIST=()
    if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi  # spreads the compilations over the CPU cores
    BENCH=(--repeats 10 --warmup 3)
    GEN=(--tokens 8 --warmup 2 --contexts 32768,65536,8192)
    PROF=(--profile 16384)
    HOST=(--steps 200 --warmup 20 --direct-launch)
    DIRECT=(tests/test_ops_plans.py tests/test_ops_prefill_plans.py tests/test_window_triton_decode.py)
fi

part env summary.txt "$ENV_S" "$PY" -c "
import sys, torch, triton, transformers
print('python', sys.version.split()[0], '| torch', torch.__version__, '| cuda', torch.version.cuda, '| triton',
      triton.__version__, '| transformers', transformers.__version__, '| device',
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"

TAG=$("$PY" scripts/device_tag.py 2>/dev/null) || TAG=unknown
note "files tagged: $TAG"

part tests tests.log "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" "${TESTS[@]}" -rfE --durations=8

part direct tests.log "$DIRECT_S" env OAL_TRITON_DIRECT_LAUNCH=1 "$PY" -m pytest -q -p no:cacheprovider "${DIRECT[@]}" \
    -rfE

part bench bench.log "$BENCH_S" "$PY" -m benchmarks.gpu "${BENCH[@]}" --out "$OUT/gpu_$TAG.json"

part generate bench.log "$GEN_S" "$PY" -m benchmarks.generate "${GEN[@]}" --out "$OUT/generate_$TAG.json"

part host bench.log "$HOST_S" "$PY" -m benchmarks.decode_host "${HOST[@]}" --out "$OUT/decode_host_$TAG.json"

if [ "$DEVICE" = "cpu" ]; then
    note "bf16: skipped (needs CUDA)"
else
    part bf16 tests.log "$BF16_S" "$PY" -m pytest -q -s -p no:cacheprovider tests/test_triton_gpu.py -rfE
fi

part profile bench.log "$PROF_S" "$PY" -m benchmarks.gpu "${PROF[@]}" --profile-out "$OUT/profile.txt"
if [ "${NCU:-0}" = "1" ] && [ "$DEVICE" != "cpu" ] && command -v ncu >/dev/null; then
    # the chunked kernels of one forward and one forward + backward at 16k, after their compiles and autotuning
    # (the NVTX range): compute against memory throughput (SpeedOfLight), issue slots (SchedulerStats), occupancy
    part ncu bench.log "$NCU_S" bash -c "ncu --nvtx --nvtx-include 'oal_ncu/' -k 'regex:^_(state_scan|fwd_out|bwd_)' \
        --section SpeedOfLight --section SchedulerStats --section Occupancy \
        $PY -m benchmarks.gpu --profile 16384 --ncu-only >>'$OUT/profile.txt' 2>&1"
elif [ "${NCU:-0}" = "1" ]; then
    note "ncu: skipped (no ncu here, or DEVICE=cpu)"
fi

echo "== summary"
cat "$SUMMARY"
# the benchmarks' tables and goal lines, for a reader of summary.txt alone
grep -hE "^(goal|sanity|default SDPA)|│|┃" "$OUT/bench.log" 2>/dev/null | tee -a "$SUMMARY" >/dev/null
echo "files in $OUT:"
ls -1 "$OUT"
