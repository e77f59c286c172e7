#!/usr/bin/env bash
# Rebuild issue 48's run reports with this tree's code from its raw files (never edited by hand):
#
#   scripts/gpu/report48.sh DIR    DIR as scripts/gpu/collect.sh made it (DIR/raw/...)
#
# DIR/swap-report/   the swap under live traffic: scripts/gpu/swapreport.py raw/swap (phases, outage, every
#                    request accounted for, the watch, memory)
# DIR/agree-report/  the same weights in every engine: enginemeter report --results raw/agree --baseline llama-q4
#                    (the timed cells and the token agreement of each engine against llama.cpp Q4_K_M)
# DIR/sg-report/     SGLang FP8 and SGLang on the same file: enginemeter report --results raw/sg --baseline llama-q4
#                    (each with the token agreement's figures: python -m proxy.bench.quality, in output.txt)
# DIR/output.txt     every command as run in DIR with its output and exit status (+ diagnose's text)
# EM_ROOT: the enginemeter tree to run (default: this repo); PYTHON (default its .venv).
set -uo pipefail
dir=$(cd "$1" && pwd)
here=$(cd "$(dirname "$0")/../.." && pwd)
root=${EM_ROOT:-$here}
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=$here/.venv/bin/python
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rel() { sed "s#$dir/##g"; }
em() {  # em ARGS...: one enginemeter command, run in DIR on its relative paths, shown as run, its output kept
  local rc=0
  echo "\$ enginemeter $*"
  (cd "$dir" && PYTHONPATH="$root" MPLBACKEND=Agg "$py" -m proxy.cli "$@") > "$work/out" 2>&1 || rc=$?
  grep -v 'matplotlib.font_manager' "$work/out" | rel
  echo "exit status $rc"
  return "$rc"
}
(
  rc=0
  if [ -f "$dir/raw/swap/client.jsonl" ] || [ -f "$dir/raw/swap/client.jsonl.gz" ]; then
    echo "\$ python3 scripts/gpu/swapreport.py raw/swap swap-report"
    (cd "$dir" && "$py" "$here/scripts/gpu/swapreport.py" raw/swap swap-report) || rc=$?
    echo "exit status $rc"
  else
    echo "no swap run (raw/swap): see logs/timeline.tsv"
  fi
  for pair in agree:agree-report sg:sg-report; do
    run=${pair%%:*} out=${pair#*:}
    if [ -f "$dir/raw/$run/results.jsonl.gz" ]; then
      rm -rf "${dir:?}/$out"
      em report --results "raw/$run" --baseline llama-q4 --accept-quantization-difference --weights random --out "$out" || rc=$?
      # the token agreement's figures (issue 46's readout), each engine against the baseline
      echo "\$ python -m proxy.bench.quality raw/$run/results.jsonl.gz  (token agreement against llama-q4)"
      (cd "$dir" && PYTHONPATH="$root" "$py" -m proxy.bench.quality "raw/$run/results.jsonl.gz") 2>&1 | rel
      if [ "$run" = agree ]; then  # and against the F16 reference (the same weights at full precision in llama.cpp)
        echo "\$ python -m proxy.bench.quality raw/$run/results.jsonl.gz --baseline llama-f16  (against the F16 reference)"
        (cd "$dir" && PYTHONPATH="$root" "$py" -m proxy.bench.quality "raw/$run/results.jsonl.gz" --baseline llama-f16) \
          2>&1 | rel
      fi
    else
      echo "no $run run (raw/$run): see logs/timeline.tsv"
    fi
  done
  if [ -s "$dir/raw/diag/diagnose.txt" ]; then
    echo "\$ cat raw/diag/diagnose.txt  (enginemeter diagnose of the baseline's launch, as run on the card)"
    cat "$dir/raw/diag/diagnose.txt"
  fi
  exit "$rc"
) > "$dir/output.txt"
rc=$?
cat "$dir/output.txt"
exit "$rc"
