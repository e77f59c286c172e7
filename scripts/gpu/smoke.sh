#!/usr/bin/env bash
# The GPU harness end to end HERE, before any device call: the same device.sh stage/wait, the same plan
# (scripts/gpu/orchestrate.sh with scripts/gpu/plan27b.sh's SMOKE block), the real enginemeter commands (bench
# --launch, tune, diagnose, report --results) on real processes -- the cached CPU llama-server on a tiny shape
# with the real tokenizer, llama-quantize built from the carried source, the SGLang emulator launched by its
# command line in SGLang's place, live.py against a recorded GPU reading -- then collect.sh into a scratch dir.
#
#   scripts/gpu/smoke.sh [DEST]      DEST default /tmp/em-smoke-collected
#
# Needs: .venv (scripts/bootstrap.sh test), the llama.cpp source and model carries (scripts/gpu/fetch-wheels.sh
# smoke, or the full run), LLAMA_SERVER_BIN or scripts/build-llama-server.sh. Knobs: SRC_TREE (the tree the plan
# runs: default this repo), SMOKE_DEADLINE_S (default 3600; small values exercise the cut list), W (/tmp/em-smoke).
# First run: the CPU llama-quantize build (~5-10 min on 2 cores), cached in ~/.cache/enginemeter/smoke-quantize.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
export SMOKE=1 W=${W:-/tmp/em-smoke} PYTHON=${PYTHON:-$root/.venv/bin/python}
export LLAMA_SERVER_BIN=${LLAMA_SERVER_BIN:-$(scripts/build-llama-server.sh)}
export QUANT_BUILD=${QUANT_BUILD:-$HOME/.cache/enginemeter/smoke-quantize}
dest=${1:-/tmp/em-smoke-collected}
C=$root/.carry/cache
for f in llama.tar.xz model-27b.tar.xz; do
  [ -f "$C/$f" ] || { echo "smoke: $C/$f missing: run scripts/gpu/fetch-wheels.sh smoke" >&2; exit 2; }
done
pgrep -f "^bash $W/src/scripts/gpu/orchestrate.sh" >/dev/null && { echo "smoke: a plan runs in $W" >&2; exit 2; }
rm -rf "$W" "$W-carry" "$W-out"
# the carries as the GPU machine gets them (two, to exercise parts arriving in separate calls)
"$PYTHON" scripts/gpu/pack_carries.py --out "$W-carry" 5 llama="$C/llama.tar.xz" model="$C/model-27b.tar.xz"
export OUT=$W-out CARRY_ROOT=$W-carry
t0=$SECONDS
bash scripts/gpu/device.sh stage
WAIT_S=${SMOKE_WAIT_S:-3000} bash scripts/gpu/device.sh wait
echo "smoke: plan took $(( SECONDS - t0 )) s; timeline:"
column -t -s $'\t' "$W/timeline.tsv"
rm -rf "$dest"
EM_ROOT=${SRC_TREE:-$root} PYTHON=$PYTHON bash scripts/gpu/collect.sh "$OUT" "$dest"
ls -R "$dest" | head -60
