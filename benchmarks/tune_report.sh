#!/usr/bin/env bash
# Issue 36's acceptance numbers on this machine, quiet: the chunked operator against SDPA, causal forward at the Qwen
# head shape, 2 threads, wall clock, fp32 and bf16, first with the fixed defaults (the first machine's choice),
# then tuned to this machine. Takes about 10-15 minutes on a 2-core machine (fp32 SDPA at 32k dominates).
#
#   benchmarks/tune_report.sh                       # from the repository root
#   PYTHON=/path/to/python LENGTHS=4096,16384 benchmarks/tune_report.sh
#
# Writes benchmarks/results/operator_fixed.{json,png}, operator_tuned.{json,png} and operator_tuning.md (the
# table for the README: CPU model and flags, settings, sdpa/oal and % of GEMM, fixed vs tuned, and the goals).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
LENGTHS=${LENGTHS:-4096,16384,32768}
THREADS=${THREADS:-2}
OUT=${OUT:-benchmarks/results}
export HF_HUB_OFFLINE=1
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg) (quiet means below 0.3)"
# 1. tune to this machine, measured again now (cached in ${XDG_CACHE_HOME:-~/.cache}/oal/cpu_tuning.json)
time "$PYTHON" -m oal tune-cpu --threads "$THREADS" --dtypes float32,bfloat16 --force
# 2. the fixed defaults
"$PYTHON" -m benchmarks.operator --threads "$THREADS" --lengths "$LENGTHS" --dtypes float32,bfloat16 --no-tune \
    --out "$OUT/operator_fixed.json"
# 3. tuned (reads the cache written in step 1)
"$PYTHON" -m benchmarks.operator --threads "$THREADS" --lengths "$LENGTHS" --dtypes float32,bfloat16 \
    --out "$OUT/operator_tuned.json"
"$PYTHON" -m benchmarks.operator --compare "$OUT/operator_fixed.json" "$OUT/operator_tuned.json"
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
