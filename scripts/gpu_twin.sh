#!/usr/bin/env bash
# A CPU twin of the lent GPU machine's Python: the versions its image holds (Python 3.12, torch 2.11.0, triton
# 3.6.0, transformers 5.17.0, accelerate 1.15.0, safetensors 0.8.0, tokenizers 0.23.2, huggingface_hub 1.33.0,
# numpy 2.5.2, as the device library's KINDS.md lists them; peft's version there is not recorded, 0.21.2 is ours),
# and none of what it lacks (datasets, lm-eval, gguf), so that the GPU scripts are rehearsed here on the versions
# they will meet there, before the GPU's minutes are spent:
#
#   bash scripts/gpu_twin.sh                  # builds .twin/ (git-ignored; about 5 GB: PyPI's torch 2.11 is a CUDA build)
#   bash scripts/gpu_twin.sh check            # then: scripts/gpu_check.sh's matrix on a tiny model, DEVICE=cpu
#   bash scripts/gpu_twin.sh perf             # then: scripts/gpu_perf.sh with DEVICE=cpu (the interpreter)
#   bash scripts/gpu_twin.sh tests FILES...   # then: pytest on FILES under the twin (the Triton interpreter)
#
# scripts/gpu_budget.sh rehearses by hand, after scripts/gpu_budget_prep.sh, with .gpu_carry/{cache,runs,site} moved
# aside so that the twin joins the GGUF, installs the carried gguf wheel and runs afresh (2 minutes):
#   PYTHON=.twin/bin/python DEVICE=cpu STEPS=2 VAL_EVERY=1 LEN=128 VAL_BLOCKS=1 TEST_BLOCKS=1 LAYERS=13,14 \
#     SWA_LAYERS=13,14 OUT=/tmp/twin_budget bash scripts/gpu_budget.sh
#
# As on the GPU machine, oal runs from src via PYTHONPATH, never installed. Output: check and perf write to
# benchmarks/results/twin_{check,perf}/ (ignored by git). The first rehearsal (2026-12-05, 2 cores): check ran its
# 19 commands in 11 minutes (lm_eval skipped, as there) and found that transformers 5.17 ignores the `cache=`
# keyword the benchmarks passed (oal.models.cache.cache_kwargs since).
set -euo pipefail
ROOT="$PWD"
TWIN="${TWIN:-$ROOT/.twin}"
# a pyenv shim answers `command -v` but fails to run where 3.12 is not the selected version: take the first that runs
find_py312() {
    local c
    for c in "${PY312:-}" "$(command -v python3.12 || true)" "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
        [ -n "$c" ] && "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { echo "$c"; return; }
    done
}
PINS=(torch==2.11.0 triton==3.6.0 transformers==5.17.0 accelerate==1.15.0 safetensors==0.8.0 tokenizers==0.23.2
      huggingface_hub==1.33.0 numpy==2.5.2 peft==0.21.2 typer rich matplotlib pytest pytest-xdist hypothesis
      pytest-timeout)
export PYTHONPATH="$ROOT/src:$ROOT:$ROOT/tests${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1

build() {
    PY312="$(find_py312)"
    [ -n "$PY312" ] || { echo "Error: no python3.12 that runs was found (set PY312)" >&2; exit 2; }
    [ -x "$TWIN/bin/python" ] || "$PY312" -m venv "$TWIN"
    "$TWIN/bin/python" -m pip install -q --upgrade pip
    "$TWIN/bin/python" -m pip install -q "${PINS[@]}"
    "$TWIN/bin/python" -c "import torch, transformers, triton; print('twin:', torch.__version__, transformers.__version__,
        triton.__version__)"
}

tiny() {  # a tiny random Qwen2 with 1024 positions and a corpus large enough for every command's default blocks
    local dir="$1"
    [ -f "$dir/corpus.txt" ] && return 0
    "$TWIN/bin/python" -c "from pathlib import Path; from tests.test_pipeline import make_assets
make_assets(Path('$dir'), max_positions=1024, paragraphs=6000)"
}

[ -x "$TWIN/bin/python" ] || [ "${1:-}" = "" ] || { echo "Error: build the twin first: bash $0" >&2; exit 2; }
case "${1:-}" in
    "") build ;;
    check)
        OUT="$ROOT/benchmarks/results/twin_check"
        tiny "$OUT/tiny"
        DEVICE=cpu MODEL="$OUT/tiny/model" DATA="$OUT/tiny/corpus.txt" STEPS=2 BUDGET_S=100000 LIMIT_SCALE=30 \
            OUT="$OUT" WORK="$OUT/work" PYTHON="$TWIN/bin/python" bash scripts/gpu_check.sh ;;
    perf) DEVICE=cpu OUT="$ROOT/benchmarks/results/twin_perf" PYTHON="$TWIN/bin/python" bash scripts/gpu_perf.sh ;;
    tests) shift; TRITON_INTERPRET=1 "$TWIN/bin/python" -m pytest -q -p no:cacheprovider "$@" ;;
    *) echo "Error: unknown command '$1' (expected nothing, check, perf or tests)" >&2; exit 2 ;;
esac
