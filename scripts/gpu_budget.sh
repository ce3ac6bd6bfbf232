#!/usr/bin/env bash
# The SmolLM2 budget study on the lent GPU (issue 47, item 2): softmax, OAL, the learned global quadratic and the
# recipe's oal-swa adapted with the same LoRA budget toward the paper's (512 updates of 2048-token blocks of the
# builtin corpus's train split), learning curves (validation PPL every VAL_EVERY updates), test PPL on its test split
# (every complete block), optionally Table 2 of every method at 2048 tokens; then `benchmarks.budget collect` writes
# the study's JSON and figure from the runs' verified records, ready to commit.
#
# Prepare here first (cuts the 98 MB GGUF into parts that fit the 64 MiB a call carries, fetches the gguf wheel):
#
#   bash scripts/gpu_budget_prep.sh          # prints the exact calls; with two parts they are:
#
#   run(command="bash scripts/gpu_budget.sh store 1", carry=[".gpu_carry/meta", ".gpu_carry/smollm2.gguf.part1"],
#       timeout_s=120)                                                   # seconds: checks part 1, installs gguf
#   run(command="bash scripts/gpu_budget.sh", carry=[".gpu_carry/smollm2.gguf.part2"], timeout_s=590)
#
# Make the second call right after the first: the machine keeps the first call's ignored files only while warm (30 s).
# The last call joins the parts, checks the GGUF's SHA256 against the one oal records, and runs the parts below, each
# under a time limit, all within DEADLINE_S (default 300 s: about 5 minutes of H200 time after the machine's start;
# up to 560 in a call of timeout_s=590).
# Run directories live in .gpu_carry/runs on the machine, named by the knobs below, so the same call made again while
# it is warm resumes them.
# Back in $OUT (at most 8 files): summary.txt, smollm2_budget_TAG.json and .png (TAG names the card: h200, h100, ...;
# scripts/device_tag.py; commit them to benchmarks/reference/), logs.tar.gz, records.tar.gz or its parts
# records.tar.gz.partK (the run and Table 2 directories without checkpoints, for `python -m benchmarks.budget
# collect` to read again here).
# A part that timed out resumes when the same last call is made again while the machine is warm. Table 2 of every
# method on the preset's 24 layers at LEN tokens is a further call, e.g.
#   run(command="SWA=0 TABLE2=1 TABLE2_S=500 DEADLINE_S=560 bash scripts/gpu_budget.sh", timeout_s=590)
#
# Knobs (environment): STEPS (512), LEN (2048: adaptation, validation, test and fidelity blocks), CALIB_LEN (LEN:
# the calibration blocks, as the paper calibrates at the length it measures), VAL_EVERY (32),
# VAL_BLOCKS (8 of the 12 validation blocks of 2048 tokens), TEST_BLOCKS (0: every complete block, 13 at 2048),
# SEEDS (42; e.g. 42,43,44 for three seeds of oal, global and softmax, one run directory each), SWA (1: the oal-swa
# arm), SWA_LAYERS (the recipe's 15 layers), LAYERS (3-26, the preset's), TABLE2 (0; 1: Table 2 of every method on
# TABLE2_LAYERS, default 3-26), RUN_S / SWA_S / TABLE2_S (each part's limit, s), DEADLINE_S, DTYPE (float32),
# DEVICE (cuda; cpu with tiny knobs tests this script here, e.g.
#   DEVICE=cpu STEPS=2 VAL_EVERY=1 LEN=128 VAL_BLOCKS=1 TEST_BLOCKS=1 LAYERS=13,14 SWA_LAYERS=13,14 \
#   bash scripts/gpu_budget.sh
# after scripts/gpu_budget_prep.sh: it runs the same join and the same commands).
set -u
cd "$(dirname "$0")/.."
MODE="${1:-run}"
CARRY=.gpu_carry
OUT="${OUT:-$PWD/benchmarks/results/gpu_budget}"
DEVICE="${DEVICE:-cuda}"
STEPS="${STEPS:-512}" LEN="${LEN:-2048}" VAL_EVERY="${VAL_EVERY:-32}" VAL_BLOCKS="${VAL_BLOCKS:-8}"
CALIB_LEN="${CALIB_LEN:-$LEN}"
TEST_BLOCKS="${TEST_BLOCKS:-0}" SEEDS="${SEEDS:-42}" SWA="${SWA:-1}" TABLE2="${TABLE2:-0}" DTYPE="${DTYPE:-float32}"
LAYERS="${LAYERS:-3-26}" SWA_LAYERS="${SWA_LAYERS:-1,2,11,12,13,15,16,19,21,22,24,25,26,27,28}"
TABLE2_LAYERS="${TABLE2_LAYERS:-3-26}"
RUN_S="${RUN_S:-200}" SWA_S="${SWA_S:-80}" TABLE2_S="${TABLE2_S:-200}" DEADLINE_S="${DEADLINE_S:-300}"
PY="${PYTHON:-python3}"
if [ "$DEVICE" = cpu ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
export OAL_CACHE_DIR="${OAL_CACHE_DIR:-$PWD/$CARRY/cache}" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src:$PWD/$CARRY/site${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
fail() { note "STOP: $*"; exit 1; }

# manifest lines: "part NAME SHA256"; a part is checked against it before it is used
part_ok() {
    local name="$1" want
    want=$(awk -v n="$name" '$1 == "part" && $2 == n {print $3}' "$CARRY/meta/manifest.txt")
    [ -f "$CARRY/$name" ] && [ -n "$want" ] && [ "$(sha256sum "$CARRY/$name" | cut -d' ' -f1)" = "$want" ]
}

[ -f "$CARRY/meta/manifest.txt" ] || fail "no $CARRY/meta/manifest.txt: run scripts/gpu_budget_prep.sh here, then \
the first call it prints (which carries $CARRY/meta); a machine given back between calls starts bare"
if [ ! -d "$CARRY/site/gguf" ]; then  # transformers reads GGUF files through the gguf package
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$CARRY/site" \
        "$CARRY"/meta/gguf-*.whl || fail "cannot install the gguf wheel"
fi

if [ "$MODE" = store ]; then
    k="${2:?store K: which part this call carried}"
    part_ok "smollm2.gguf.part$k" || fail "part $k is missing or its SHA256 differs from the manifest"
    note "part $k stored and checked; make the next call now (the machine is given back 30 s after this one)"
    "$PY" -c "import gguf, torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'device',
      torch.cuda.get_device_name() if torch.cuda.is_available() else None, 'gguf', gguf.__name__)" 2>&1 | tail -2
    exit 0
fi

# the last call: every part present and checked, joined where `oal fetch` keeps the GGUF
target="$OAL_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf"
want=$(awk '$1 == "gguf_sha256" {print $2}' "$CARRY/meta/manifest.txt")
if [ ! -f "$target" ] || [ "$(sha256sum "$target" | cut -d' ' -f1)" != "$want" ]; then
    for name in $(awk '$1 == "part" {print $2}' "$CARRY/meta/manifest.txt"); do
        part_ok "$name" || fail "$name is missing or damaged (the machine was given back between calls?): start \
again from the first call that scripts/gpu_budget_prep.sh printed"
    done
    mkdir -p "$(dirname "$target")"
    cat $(awk '$1 == "part" {print "'"$CARRY"'/" $2}' "$CARRY/meta/manifest.txt") >"$target.part"
    [ "$(sha256sum "$target.part" | cut -d' ' -f1)" = "$want" ] || fail "the joined GGUF's SHA256 is not $want"
    mv "$target.part" "$target"
fi
note "GGUF joined and checked ($want)"
GPU=$("$PY" -c "import torch; print(torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')")
TAG_GPU=$(GPU_TAG="$GPU" "$PY" scripts/device_tag.py 2>/dev/null) || TAG_GPU=unknown  # from the name just read
DESC="$GPU, torch $("$PY" -c 'import torch; print(torch.__version__)'), $DTYPE"
note "device: $DESC"
T0=$SECONDS

# part NAME LIMIT CMD...: CMD under min(LIMIT, time left before the deadline), logged to $OUT/NAME.log
part() {
    local name="$1" limit="$2" left rc t0=$SECONDS
    shift 2
    left=$((DEADLINE_S - (SECONDS - T0) - 40))  # 40 s kept for collect and packing
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 20 ]; then note "$name: skipped (no time left)"; return 0; fi
    echo "== $name (limit ${limit}s): $*"
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    case $rc in
        0) note "$name: ok ($((SECONDS - t0)) s)" ;;
        124 | 130 | 137) note "$name: TIMED OUT after $((SECONDS - t0)) s (resumes when this call is made again)" ;;
        *) note "$name: FAILED rc $rc ($((SECONDS - t0)) s)" ;;
    esac
    tail -n 15 "$OUT/$name.log"
}

RUNS="$CARRY/runs"
# other knobs, other directories (a directory keeps one configuration): the main ones in the name, all in the hash
TAG="l$LEN-n$STEPS-$(echo "$LEN $CALIB_LEN $STEPS $VAL_EVERY $VAL_BLOCKS $TEST_BLOCKS $LAYERS $SWA_LAYERS $DTYPE" \
    | sha256sum | cut -c1-8)"
mkdir -p "$RUNS"
COMMON=(--adapt-len "$LEN" --eval-len "$LEN" --fidelity-len "$LEN" --calib-len "$CALIB_LEN"
        --val-blocks "$VAL_BLOCKS" --test-blocks "$TEST_BLOCKS" --steps "$STEPS" --val-every "$VAL_EVERY"
        --device "$DEVICE" --dtype "$DTYPE" --threads 0 --no-progress)
for seed in ${SEEDS//,/ }; do
    part "main-s$seed" "$RUN_S" "$PY" -m benchmarks.budget run --out "$RUNS/main-$TAG-s$seed" --seeds "$seed" \
        --methods oal,global,softmax --layers "$LAYERS" "${COMMON[@]}"
done
if [ "$SWA" = 1 ]; then
    part swa "$SWA_S" "$PY" -m benchmarks.budget run --out "$RUNS/swa-$TAG-s42" --seeds 42 --methods oal-swa \
        --layers "$SWA_LAYERS" --window 64 --sinks 4 "${COMMON[@]}"
fi
TABLES=()
if [ "$TABLE2" = 1 ]; then
    t2="$RUNS/table2-c$CALIB_LEN-f$LEN-layers${TABLE2_LAYERS//,/_}"
    part table2 "$TABLE2_S" "$PY" -m benchmarks.budget table2 --out "$t2" --fidelity-len "$LEN" \
        --calib-len "$CALIB_LEN" --layers "$TABLE2_LAYERS" --device "$DEVICE" --threads 0
    [ -f "$t2/.oal/evaluations.json" ] && TABLES=(--table2 "$t2")
fi

dirs=()
for d in "$RUNS/main-$TAG"-s* "$RUNS/swa-$TAG"-s*; do [ -f "$d/config.json" ] && dirs+=("$d"); done
if [ "${#dirs[@]}" -gt 0 ]; then
    "$PY" -m benchmarks.budget collect --runs "${dirs[@]}" "${TABLES[@]}" --device "$DESC" \
        --json "$OUT/smollm2_budget_$TAG_GPU.json" --png "$OUT/smollm2_budget_$TAG_GPU.png" 2>&1 \
        | tee "$OUT/collect.log" | tee -a "$SUMMARY"
fi
# the records, for `collect` to read again here: parts of 15 MiB (a file that comes back holds at most 16 MiB, and at
# most 8 files do); join them with `cat records.tar.gz.part* > records.tar.gz`
tar -czf "$OUT/records.tar.gz" --exclude=.oal/checkpoints --exclude=.oal/capture -C "$CARRY" runs 2>/dev/null
if [ "$(stat -c %s "$OUT/records.tar.gz")" -gt $((60 * 1024 * 1024)) ]; then
    tar -czf "$OUT/records.tar.gz" --exclude=.oal/checkpoints --exclude=.oal/capture --exclude='*.safetensors' \
        -C "$CARRY" runs 2>/dev/null
    note "records.tar.gz: without the tensors (too large); collect cannot verify it again"
fi
if [ "$(stat -c %s "$OUT/records.tar.gz")" -gt $((15 * 1024 * 1024)) ]; then
    split -b 15M -d -a 1 --numeric-suffixes=1 "$OUT/records.tar.gz" "$OUT/records.tar.gz.part" \
        && rm "$OUT/records.tar.gz"
fi
(cd "$OUT" && tar -czf logs.tar.gz --remove-files ./*.log 2>/dev/null)
note "total $((SECONDS - T0)) s"
