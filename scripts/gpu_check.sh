#!/usr/bin/env bash
# GPU check for the Triton operator (issues 10, 24): the kernel tests compiled on the real GPU, the bf16 accuracy
# check at N = 16k (tests/test_triton_gpu.py: the kernels' bf16 arithmetic against fp64, beside bf16 SDPA), the
# benchmark against SDPA, and a short `oal run` on CUDA. Made for one call of the `device` tool on the lent H200
# (see README "GPU"):
#
#   run(command="bash scripts/gpu_check.sh", timeout_s=560)          # no carry needed
#
# The parts share 8.2 minutes at most (env <= 60 s, usually seconds; TESTS_S + BF16_S + BENCH_S + RUN_S below).
# Each is guarded by `timeout`, logs to $OUT, and a failing part does not stop the next. What comes back in $OUT
# (9 files at most): summary.txt, env.log, tests.log, bf16.log, bench.log, gpu.json, gpu.png, run.log,
# run_metrics.json.
#
# That machine has python3 3.12 with torch 2.11 (cu130), triton 3.6.0 (the version pyproject pins), transformers
# 5.17, peft, accelerate, safetensors, typer, rich, matplotlib, pytest and pytest-xdist. `oal` runs from src via
# PYTHONPATH: do not pip install it there (it pins torch 2.13.0 and nothing can be downloaded). `datasets` is
# absent; the default run (builtin corpus) does not import it. If some package is missing, carry wheels: here,
# `echo /.whl/ >> .git/info/exclude` and `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux_2_28_x86_64 -d .whl NAME==VERSION` (recipe in the device README), then
# call run(..., carry=[".whl"]): this script installs .whl/*.whl into /tmp/site first.
#
# Outside the device tool, OUT defaults to benchmarks/results/gpu_check (ignored by git).
set -u
OUT="${OUT:-$PWD/benchmarks/results/gpu_check}"
mkdir -p "$OUT"
TESTS_S="${TESTS_S:-150}"
BF16_S="${BF16_S:-120}"
BENCH_S="${BENCH_S:-140}"
RUN_S="${RUN_S:-80}"
PY="${PYTHON:-python3}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OAL_TEST_DEVICE=cuda
unset TRITON_INTERPRET
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }

# part NAME SECONDS CMD...: run CMD under a time limit, log to $OUT/NAME.log, record the outcome, never abort
part() {
    local name="$1" limit="$2"
    shift 2
    local t0=$SECONDS rc
    echo "== $name (limit ${limit}s): $*"
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    if [ "$rc" -eq 0 ]; then
        note "$name: ok ($((SECONDS - t0)) s)"
    elif [ "$rc" -eq 124 ] || [ "$rc" -eq 130 ] || [ "$rc" -eq 137 ]; then
        note "$name: TIMED OUT after $((SECONDS - t0)) s (rc $rc); partial log in $name.log"
    else
        note "$name: FAILED rc $rc ($((SECONDS - t0)) s)"
    fi
    tail -n 25 "$OUT/$name.log"
    return 0
}

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

cat >/tmp/oal_gpu_env.py <<'EOF'
import importlib
import sys

import torch

print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("triton", "transformers", "peft", "accelerate", "safetensors", "typer", "rich", "matplotlib",
             "pytest", "xdist", "datasets"):
    try:
        print(f"{name:13s}", getattr(importlib.import_module(name), "__version__", "present"))
    except ImportError as err:
        print(f"{name:13s} ABSENT ({err})")
import oal.ops.triton as oal_triton  # noqa: E402

print("oal.ops.triton available:", oal_triton.available())
EOF
part env 60 bash -c "nvidia-smi -L; $PY /tmp/oal_gpu_env.py"

# the kernel tests, compiled (not the interpreter); xdist spreads the Triton compilations over the CPU cores
XDIST=()
if "$PY" -c "import xdist" 2>/dev/null; then XDIST=(-n 8); fi
part tests "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider "${XDIST[@]}" tests/test_triton.py -rA --durations=10

# bf16 dots at N = 16k, d = dv = 128 against fp64 and against bf16 SDPA's error (compiles the d = 128 kernels)
part bf16 "$BF16_S" "$PY" -m pytest -q -s -p no:cacheprovider tests/test_triton_gpu.py -rA

# the benchmark writes gpu.json after every length, so a time-out still leaves the lengths it finished
part bench "$BENCH_S" "$PY" -m benchmarks.gpu --out "$OUT" --warmup 2 --repeats 5

# a short end-to-end run on CUDA (embedded default model, builtin corpus): attention through the Triton kernels
rm -rf /tmp/oal_gpu_run
part run "$RUN_S" "$PY" -m oal run --out /tmp/oal_gpu_run --device cuda --steps 20 --methods oal,softmax \
    --no-progress
if [ -f /tmp/oal_gpu_run/metrics.json ]; then cp /tmp/oal_gpu_run/metrics.json "$OUT/run_metrics.json"; fi

echo "== summary"
cat "$SUMMARY"
if [ -f "$OUT/bench.log" ]; then
    # the benchmark's table and goal lines
    sed -n '/Causal attention/,$p' "$OUT/bench.log" | tee -a "$SUMMARY"
fi
if [ -f "$OUT/bf16.log" ]; then
    grep -A4 "relative error against fp64" "$OUT/bf16.log" | tee -a "$SUMMARY"
fi
