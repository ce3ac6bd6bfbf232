#!/usr/bin/env bash
# The end-to-end matrix on CUDA in one go (issue 45): every command of `oal` and the benchmarks that run a model, on
# the GPU, each under its own time limit; a failing command does not stop the next. Made for one call of the
# `device` tool on the lent H200 (the Triton kernel tests and the operator benchmark are scripts/gpu_perf.sh's):
#
#   run(command="bash scripts/gpu_check.sh", kind="nvidia-h200", timeout_s=560)
#
# Records every command's exit code and seconds in $OUT/gpu_e2e_TAG.json (TAG names the card: h200, h100, ...;
# scripts/device_tag.py; copy it to benchmarks/reference/):
#   {"device": str, "torch": str, "commit": str, "commands": [{"cmd": str, "rc": int, "seconds": float}]}
# rewritten after each command, so a cut-off run still says how far it got. rc: the command's exit code; 124 (or
# 130/137) = it ran out of its time limit; 125 = not started, the matrix's time budget was spent; 77 = skipped, a
# package it needs is missing (summary.txt says which).
# What comes back in $OUT (7 files): gpu_e2e_TAG.json, summary.txt, env.txt, logs.tar.gz (every command's log, the
# frontier and recall JSON), report_all.md, metrics_all.json and metrics_bf16.json (the two `oal run`s of the issue).
#
# Time: the environment check takes <= 60 s; the matrix shares BUDGET_S (460 s) in the order below, each command
# at most its own limit and what is left of the budget. The commands, with the run directories they share:
#   all   = oal run --methods all --steps 20 (the default preset: the embedded model and builtin corpus; the
#           smollm2-135m preset needs its GGUF, fetched from PyPI, which cannot travel in one call), then on it:
#           evaluate (fidelity), evaluate --zeroshot on tests/fixtures/zeroshot, evaluate --passkey, generate,
#           convert --export, export, the exports reloaded with oal.load and AutoModelForCausalLM (generation),
#           python -m oal.lm_eval on the export with the piqa fixture as a local task, adapt (dijiang)
#   bf16  = oal run --dtype bfloat16 --methods oal,global,softmax,swa,oal-swa --steps 20
#   seeds = oal run --seeds 1,2 (oal, softmax)
#   auto  = oal select-layers --k 2, then oal run --layers auto:2 continuing from it (the preset's adaptation steps:
#           select-layers records them and the run must match)
#   work  = oal analyze, then oal calibrate (oal, global, dijiang) from its groups; diagnose (Table 1, Fig. 2(b),
#           Table 2) in its own folder
#   python -m benchmarks.frontier and python -m benchmarks.recall at their smallest settings
#
# The machine has python3 3.12, torch 2.11 + CUDA, triton 3.6, transformers, peft, accelerate, pytest; `oal` runs from
# src via PYTHONPATH (never pip install it there: it pins torch 2.13.0 and nothing can be downloaded). It has no
# `datasets` and no lm-eval: `python -m oal.lm_eval` is then skipped (rc 77). To run it, carry the wheels: here, once,
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     lm-eval==0.4.13 datasets==5.2.0 dill==0.4.0 multiprocess==0.70.18 pytablewriter==1.2.1 DataProperty==1.1.1 \
#     mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==2.0.0
# (about 10 MB), then run(command="bash scripts/gpu_check.sh", timeout_s=560, carry=[".whl"]): this script installs
# .whl/*.whl into /tmp/site first.
#
# The same matrix on another device or model, e.g. the CPU rehearsal that checks every command line (a tiny model
# from tests/test_pipeline.py's make_assets; see the issue 45 note for its time):
#   DEVICE=cpu MODEL=/tmp/tiny/model DATA=/tmp/tiny/corpus.txt STEPS=2 BUDGET_S=100000 LIMIT_SCALE=30 \
#     OUT=/tmp/e2e_cpu bash scripts/gpu_check.sh
# Outside the device tool, OUT defaults to benchmarks/results/gpu_check (ignored by git). COMMIT names the commit
# when the copy has no .git.
set -u
ROOT="$PWD"
OUT="${OUT:-$ROOT/benchmarks/results/gpu_check}"
DEVICE="${DEVICE:-cuda}"
MODEL="${MODEL:-default}"
DATA="${DATA:-builtin}"
STEPS="${STEPS:-20}"
BUDGET_S="${BUDGET_S:-460}"
LIMIT_SCALE="${LIMIT_SCALE:-1}"
PY="${PYTHON:-python3}"
WORK="${WORK:-/tmp/oal_gpu_check}"
case "$DEVICE" in  # the card's tag (h200, h100, ...): a run on another card is never filed as the H200's
    cuda*) JSON_NAME="gpu_e2e_$(DEVICE="$DEVICE" "$PY" scripts/device_tag.py 2>/dev/null || echo unknown).json" ;;
    *) JSON_NAME="e2e_${DEVICE//:/_}.json" ;;
esac
ALL="$WORK/all" BF16="$WORK/bf16" SEEDS="$WORK/seeds" AUTO="$WORK/auto" AN="$WORK/analyze" DIAG="$WORK/diagnose"
# the two runs' reports that come back, as source:name in $OUT (`publish`)
REPORTS=("$ALL/report.md:report_all.md" "$ALL/metrics.json:metrics_all.json" "$BF16/metrics.json:metrics_bf16.json")
mkdir -p "$OUT"
for pair in "${REPORTS[@]}"; do rm -f "$OUT/${pair##*:}"; done  # never an earlier run's, as this one's
rm -rf "$WORK"
mkdir -p "$WORK/logs" "$WORK/tasks"
export PYTHONPATH="$ROOT/src:$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
    PYTHONUNBUFFERED=1 OAL_CACHE_DIR="${OAL_CACHE_DIR:-$WORK/cache}"
unset TRITON_INTERPRET
SUMMARY="$OUT/summary.txt"
RECORDS="$WORK/records.tsv"
: >"$SUMMARY"
: >"$RECORDS"

if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# ------------------------------------------------------------------------------------------------ helpers (Python)
cat >"$WORK/env.py" <<'EOF'
import importlib
import subprocess
import sys

import torch

print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name() if torch.cuda.is_available() else None)
for name in ("triton", "transformers", "peft", "accelerate", "safetensors", "typer", "rich", "matplotlib", "lm_eval",
             "datasets"):
    try:
        print(f"{name:13s}", getattr(importlib.import_module(name), "__version__", "present"))
    except ImportError as err:
        print(f"{name:13s} ABSENT ({err})")
import oal  # noqa: E402,F401

print("oal", oal.__version__, "from", oal.__file__)
print(subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout if torch.cuda.is_available() else "")
EOF

cat >"$WORK/record.py" <<'EOF'
"""Rewrite the JSON of the matrix from records.tsv (rc, seconds, command per line)."""
import json
import os
import sys

import torch

records, out, commit = sys.argv[1:4]
device = os.environ.get("DEVICE", "cuda")
name = torch.cuda.get_device_name() if device.startswith("cuda") and torch.cuda.is_available() else device
commands = []
for line in open(records, encoding="utf-8"):
    rc, seconds, cmd = line.rstrip("\n").split("\t", 2)
    commands.append({"cmd": cmd, "rc": int(rc), "seconds": float(seconds)})
data = {"device": name, "torch": torch.__version__, "commit": commit, "commands": commands}
tmp = out + ".tmp"
with open(tmp, "w", encoding="utf-8") as f:
    json.dump(data, f, indent=1)
    f.write("\n")
os.replace(tmp, out)
EOF

cat >"$WORK/reload.py" <<'EOF'
"""Reload an export with oal.load and with AutoModelForCausalLM (after `import oal`) on the device; both generate
greedily through the cache, on the device, and must give the same tokens."""
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import oal

path, device = sys.argv[1], sys.argv[2]
tok = AutoTokenizer.from_pretrained(path)
ids = tok("The kernel", return_tensors="pt").input_ids.to(device)
outs = {}
for name, load in (("oal.load", lambda: oal.load(path, device=device)),
                   ("AutoModelForCausalLM", lambda: AutoModelForCausalLM.from_pretrained(path).to(device))):
    model = load().eval()
    with torch.no_grad():
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                             use_cache=True, pad_token_id=tok.pad_token_id or tok.eos_token_id)
    if seq.device.type != torch.device(device).type:
        sys.exit(f"{name}: generated on {seq.device}, not {device}")
    outs[name] = seq.cpu()
    print(name, type(model).__name__, repr(tok.decode(seq[0, ids.shape[1]:])))
if not torch.equal(*outs.values()):
    sys.exit("oal.load and AutoModelForCausalLM generated different tokens")
EOF

cat >"$WORK/tasks/oal_piqa_fixture.yaml" <<EOF
task: oal_piqa_fixture
dataset_path: json
dataset_kwargs:
  data_files:
    test: $ROOT/tests/fixtures/zeroshot/piqa.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{goal}}\nAnswer:"
doc_to_choice: "{{[sol1, sol2]}}"
doc_to_target: label
metric_list:
  - metric: acc
EOF

note() { echo "$*" | tee -a "$SUMMARY"; }

COMMIT="${COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
if [ "$COMMIT" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    COMMIT="$COMMIT+uncommitted"
fi

publish() {  # the JSON, the two runs' reports and the logs so far (a cut-off run still returns them)
    DEVICE="$DEVICE" "$PY" "$WORK/record.py" "$RECORDS" "$OUT/$JSON_NAME" "$COMMIT" 2>>"$WORK/logs/record.log"
    local pair
    for pair in "${REPORTS[@]}"; do
        [ -f "${pair%%:*}" ] && cp "${pair%%:*}" "$OUT/${pair##*:}"
    done
    tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs 2>/dev/null
    return 0
}

N=0
T0=$SECONDS
# step NAME LIMIT CMD...: run CMD under min(LIMIT * LIMIT_SCALE, what is left of the budget), log it, record it
step() {
    local name="$1" limit=$(($2 * LIMIT_SCALE)) rc t0 left
    shift 2
    N=$((N + 1))
    local log="$WORK/logs/$(printf %02d "$N")_$name.log" cmd="$*"
    cmd="${cmd//$PY -m oal /oal }"
    left=$((BUDGET_S - (SECONDS - T0)))
    if [ "$left" -lt 15 ]; then
        printf '125\t0\t%s\n' "$cmd" >>"$RECORDS"
        note "$name: NOT STARTED (the ${BUDGET_S} s budget is spent)"
        publish
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit ${limit} s): $cmd"
    t0=$(date +%s.%N)
    timeout --signal=INT --kill-after=15 "$limit" "$@" >"$log" 2>&1
    rc=$?
    local secs
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    printf '%s\t%s\t%s\n' "$rc" "$secs" "$cmd" >>"$RECORDS"
    case "$rc" in
        0) note "$name: ok ($secs s)" ;;
        124 | 130 | 137) note "$name: TIMED OUT after $secs s (rc $rc)" ;;
        *) note "$name: FAILED rc $rc ($secs s)"; tail -n 15 "$log" ;;
    esac
    publish
    return 0
}

skip() {  # skip NAME REASON CMD...: recorded with rc 77
    local name="$1" why="$2"
    shift 2
    N=$((N + 1))
    local cmd="$*"
    printf '77\t0\t%s\n' "${cmd//$PY -m oal /oal }" >>"$RECORDS"
    note "$name: SKIPPED ($why)"
    publish
}

# ------------------------------------------------------------------------------------------------ environment
timeout 60 "$PY" "$WORK/env.py" >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
LMEVAL=1
"$PY" -c "import lm_eval, datasets" 2>/dev/null || LMEVAL=0
T0=$SECONDS  # the budget is the matrix's

# ------------------------------------------------------------------------------------------------ the matrix
FIX="$ROOT/tests/fixtures/zeroshot"
TASKS=(--task-file "piqa=$FIX/piqa.jsonl" --task-file "hellaswag=$FIX/hellaswag.jsonl"
       --task-file "arc_easy=$FIX/arc_easy.jsonl")
M=(--model "$MODEL" --data "$DATA")

step run_all 240 "$PY" -m oal run --out "$ALL" "${M[@]}" --device "$DEVICE" --methods all --steps "$STEPS" \
    --no-progress
step run_bf16 150 "$PY" -m oal run --out "$BF16" "${M[@]}" --device "$DEVICE" --dtype bfloat16 \
    --methods oal,global,softmax,swa,oal-swa --steps "$STEPS" --no-progress
step evaluate_fidelity 60 "$PY" -m oal evaluate --out "$ALL" --device "$DEVICE"
step evaluate_zeroshot 60 "$PY" -m oal evaluate --out "$ALL" --zeroshot --methods oal,softmax "${TASKS[@]}" \
    --device "$DEVICE"
step evaluate_passkey 60 "$PY" -m oal evaluate --out "$ALL" --passkey --methods oal,softmax --lengths 256,512 \
    --depths 0,0.5,1 --trials 2 --device "$DEVICE"
step generate 40 "$PY" -m oal generate --out "$ALL" --method oal --max-new-tokens 32 --device "$DEVICE" \
    "The kernel of the"
step convert 60 "$PY" -m oal convert --out "$ALL" --method oal --export "$WORK/export_oal" --device "$DEVICE"
step export 60 "$PY" -m oal export --out "$ALL" --method oal-swa --to "$WORK/export_oal_swa"
step reload 60 "$PY" "$WORK/reload.py" "$WORK/export_oal" "$DEVICE"
LMEVAL_CMD=("$PY" -m oal.lm_eval --model hf --model_args "pretrained=$WORK/export_oal,dtype=float32"
            --tasks oal_piqa_fixture --include_path "$WORK/tasks" --batch_size 8 --output_path "$WORK/logs/lm_eval"
            --device "$DEVICE")
if [ "$LMEVAL" = 1 ]; then
    step lm_eval 90 "${LMEVAL_CMD[@]}"
else
    skip lm_eval "lm-eval or datasets is not installed: carry the wheels (see this script's header)" "${LMEVAL_CMD[@]}"
fi
step adapt 60 "$PY" -m oal adapt --out "$ALL" --method dijiang --steps 10 --device "$DEVICE" --no-progress
step run_seeds 120 "$PY" -m oal run --out "$SEEDS" "${M[@]}" --device "$DEVICE" --methods oal,softmax --steps 5 \
    --seeds 1,2 --no-progress
step select_layers 120 "$PY" -m oal select-layers --out "$AUTO" "${M[@]}" --k 2 --methods oal,softmax \
    --device "$DEVICE" --no-progress
step run_auto 150 "$PY" -m oal run --out "$AUTO" "${M[@]}" --layers auto:2 --methods oal,softmax \
    --device "$DEVICE" --no-progress
step analyze 60 "$PY" -m oal analyze --out "$AN" "${M[@]}" --layers 1-2 --device "$DEVICE"
step calibrate 90 "$PY" -m oal calibrate --out "$AN" "${M[@]}" --layers 1-2 --methods oal,global,dijiang \
    --max-steps 50 --device "$DEVICE" --no-progress
step diagnose 120 "$PY" -m oal diagnose --out "$DIAG" "${M[@]}" --layers 1 --parts table1,budget,table2 \
    --methods oal,global,performer,swa --controls 4 --sequences 2 --max-budget 3 --device "$DEVICE"
step frontier 120 "$PY" -m benchmarks.frontier --model "$MODEL" --device "$DEVICE" --methods oal --k 1 --steps 1 \
    --lengths 64,128 --passkey-lengths 256 --trials 1 --depths 0.5 --decode-tokens 2 \
    --work "$WORK/frontier" --json "$WORK/logs/frontier.json"
step recall 180 "$PY" -m benchmarks.recall --quick --device "$DEVICE" --json "$WORK/logs/recall.json"

# ------------------------------------------------------------------------------------------------ what comes back
publish
echo "== summary ($((SECONDS - T0)) s of the ${BUDGET_S} s budget)"
cat "$SUMMARY"
