#!/usr/bin/env bash
# Prepares what scripts/gpu_budget.sh needs on the lent GPU machine, in .gpu_carry/ (git ignores it through its own
# .gitignore, so it travels only when a device call names it in `carry`):
#   .gpu_carry/meta/                 the gguf wheel (the machine has no gguf package; transformers reads a GGUF with
#                                    it) and manifest.txt (the parts, their SHA256 and the whole file's)
#   .gpu_carry/smollm2.gguf.partK    the SmolLM2 GGUF (98 MB) cut into parts that each fit one call: a call carries
#                                    at most 64 MiB, the working tree included, so the part size is what the tree
#                                    leaves (less a 2 MiB margin); usually two parts
# and prints the device calls to make, in order. Run it here (not on the GPU machine), after `oal fetch smollm2-135m`:
#
#   bash scripts/gpu_budget_prep.sh
#
# Every call but the last only stores its part (seconds); the last joins the parts, checks the SHA256 and runs the
# study. The machine keeps ignored files only while it is warm (30 s after a call), so make each call right after the
# one before; if a part is missing when the last call starts (the machine was given back), that call says so in a few
# seconds: start again from the first call.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
PY="${PYTHON:-.venv/bin/python}"
CARRY=.gpu_carry
LIMIT=$((64 * 1024 * 1024))
MARGIN=$((2 * 1024 * 1024))
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # oal.models.fetch.LOCAL_MODELS
GGUF_WHEEL="${GGUF_WHEEL:-gguf==0.19.0}"

gguf="$("$PY" -c "from oal.models.fetch import fetch_model; print(fetch_model('smollm2-135m'))")"
if [ "$(sha256sum "$gguf" | cut -d' ' -f1)" != "$GGUF_SHA" ]; then
    echo "Error: $gguf: SHA256 is not the one oal records for smollm2-135m" >&2
    exit 2
fi
rm -rf "$CARRY/meta" "$CARRY"/smollm2.gguf.part*
mkdir -p "$CARRY/meta"
echo '*' >"$CARRY/.gitignore"  # the folder ignores itself: nothing in it travels unless carried

"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$CARRY/meta" "$GGUF_WHEEL"

# what travels with every call: tracked files and untracked ones git does not ignore (other work in progress too)
tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
meta=$(du -cb "$CARRY/meta" | tail -1 | cut -f1)
room=$((LIMIT - tree - meta - MARGIN))
size=$(stat -c %s "$gguf")
if [ "$room" -lt $((8 * 1024 * 1024)) ]; then
    echo "Error: the working tree takes $tree bytes of the 64 MiB a call carries; too little is left for the GGUF" >&2
    exit 2
fi
parts=$(((size + room - 1) / room))
part=$(((size + parts - 1) / parts))
split -b "$part" -d -a 1 --numeric-suffixes=1 "$gguf" "$CARRY/smollm2.gguf.part"
{
    echo "gguf_sha256 $GGUF_SHA"
    echo "gguf_bytes $size"
    echo "parts $parts"
    for f in "$CARRY"/smollm2.gguf.part*; do echo "part $(basename "$f") $(sha256sum "$f" | cut -d' ' -f1)"; done
} >"$CARRY/meta/manifest.txt"
cat "$CARRY/meta/manifest.txt"
echo "working tree $tree bytes; $parts parts of <= $part bytes"
echo
echo "The device calls, in order (each right after the one before; the last one runs the study):"
for k in $(seq 1 "$parts"); do
    carry="\"$CARRY/smollm2.gguf.part$k\""
    if [ "$k" -eq 1 ]; then carry="\"$CARRY/meta\", $carry"; fi
    if [ "$k" -lt "$parts" ]; then
        echo "  run(command=\"bash scripts/gpu_budget.sh store $k\", carry=[$carry], timeout_s=120)"
    else
        echo "  run(command=\"bash scripts/gpu_budget.sh\", carry=[$carry], timeout_s=590)"
    fi
done
