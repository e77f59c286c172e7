#!/usr/bin/env bash
# Issue 48's run end to end HERE, before any device call: the same device.sh stage/wait with
# ORCH=orchestrate48.sh and plan48.sh's SMOKE block -- the random checkpoint (write_weights.py), llama.cpp's own
# convert_hf_to_gguf.py and the cached CPU llama-quantize, bench --launch with --agreement on the CPU llama-server
# and the vLLM/SGLang emulators, the swap under live traffic through serve (swaplive.py), diagnose -- then
# collect.sh (REPORT=report48.sh) into a scratch dir.
#
#   scripts/gpu/smoke48.sh [DEST]      DEST default /tmp/em-smoke48-collected
#
# Needs: .venv, `SHAPE=smoke scripts/gpu/fetch-wheels.sh smoke` (the llama.cpp source and the smoke model dir),
# CONVERT_PYTHON: a python with torch, numpy, sentencepiece (default /tmp/torchenv/bin/python:
# `python3 -m venv /tmp/torchenv && /tmp/torchenv/bin/pip install torch numpy sentencepiece safetensors`).
# Knobs: STEPS (plan48.sh's), W (/tmp/em-smoke48), SMOKE_DEADLINE_S.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
export SMOKE=1 W=${W:-/tmp/em-smoke48} PYTHON=${PYTHON:-$root/.venv/bin/python} ORCH=orchestrate48.sh
export CONVERT_PYTHON=${CONVERT_PYTHON:-/tmp/torchenv/bin/python}
export LLAMA_SERVER_BIN=${LLAMA_SERVER_BIN:-$(scripts/build-llama-server.sh)}
dest=${1:-/tmp/em-smoke48-collected}
C=$root/.carry/cache
for f in llama.tar.xz model-smoke.tar.xz; do
  [ -f "$C/$f" ] || { echo "smoke48: $C/$f missing: run SHAPE=smoke scripts/gpu/fetch-wheels.sh smoke" >&2; exit 2; }
done
pgrep -f "^bash $W/src/scripts/gpu/orchestrate" >/dev/null && { echo "smoke48: a plan runs in $W" >&2; exit 2; }
rm -rf "$W" "$W-carry" "$W-out"
"$PYTHON" scripts/gpu/pack_carries.py --out "$W-carry" 5 llama="$C/llama.tar.xz" model="$C/model-smoke.tar.xz"
export OUT=$W-out CARRY_ROOT=$W-carry
t0=$SECONDS
bash scripts/gpu/device.sh stage
WAIT_S=${SMOKE_WAIT_S:-3000} bash scripts/gpu/device.sh wait
echo "smoke48: plan took $(( SECONDS - t0 )) s; timeline:"
column -t -s $'\t' "$W/timeline.tsv"
rm -rf "$dest"
REPORT=report48.sh EM_ROOT=$root PYTHON=$PYTHON bash scripts/gpu/collect.sh "$OUT" "$dest"
ls -R "$dest" | head -60
