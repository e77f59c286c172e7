#!/usr/bin/env bash
# Rebuild a collected GPU run's reports with this tree's code from its raw results (never edited by hand):
#
#   scripts/gpu/report.sh DIR      DIR as scripts/gpu/collect.sh made it (DIR/raw/NAME/results.jsonl.gz)
#
# DIR/report/       the runs joined: enginemeter report --results raw/llama raw/sglang-fp8 raw/vllm-fp8 raw/sglang
#                   raw/sglang-gguf (those there) --baseline llama --accept-quantization-difference (the runs made
#                   one engine at a time, joined as separate runs)
# DIR/traffic-report/  the same weighed by the traffic live.py sent through the proxy: its request log's exact
#                   profile (--traffic raw/live/live/requests.jsonl: every request's start and end), else the
#                   profile serve recorded (raw/live/live/traffic.txt)
# DIR/traffic-NAME/   the same weighed by each profile of DIR/traffic.txt (lines "NAME SPEC", SPEC as --traffic takes
#                   it): the answer for a traffic a team names (one at a time, bursts, their own mix)
# DIR/tune-report/  enginemeter report --results raw/tune (the tune run's table, rule and verdicts)
# DIR/tuned-report/ the candidates against llama.cpp tuned: raw/tune joined with the other engines' runs, the
#                   baseline the tune's best setting under load (tune.json's best.under_load; the tune's cells only),
#                   when it is not the -np llama.cpp's bench ran with
# DIR/output.txt    every command as run in DIR with its output and exit status
# EM_ROOT: the enginemeter tree to run (default: this repo); PYTHON (default its .venv, else this repo's).
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
runs=()
for r in llama sglang-fp8 vllm-fp8 sglang sglang-gguf; do
  [ -f "$dir/raw/$r/results.jsonl.gz" ] && runs+=("raw/$r")
done
rc=0
(
  if [ -f "$dir/raw/llama/results.jsonl.gz" ] && [ ${#runs[@]} -ge 2 ]; then
    rm -rf "$dir/report"
    em report --results "${runs[@]}" --baseline llama --accept-quantization-difference --out report || rc=$?
    recorded=
    if [ -s "$dir/raw/live/live/requests.jsonl" ] && [ -s "$dir/raw/live/live/traffic.txt" ]; then
      recorded=raw/live/live/requests.jsonl
    elif [ -s "$dir/raw/live/live/traffic.txt" ]; then
      recorded=$(head -n 1 "$dir/raw/live/live/traffic.txt")
    fi
    if [ -n "$recorded" ]; then
      rm -rf "$dir/traffic-report"
      em report --results "${runs[@]}" --baseline llama --accept-quantization-difference \
        --traffic "$recorded" --out traffic-report || rc=$?
    fi
    if [ -s "$dir/traffic.txt" ]; then
      while read -r name spec; do
        case $name in ''|'#'*) continue ;; esac
        rm -rf "${dir:?}/traffic-$name"
        em report --results "${runs[@]}" --baseline llama --accept-quantization-difference --traffic "$spec" \
          --out "traffic-$name" || rc=$?
      done < "$dir/traffic.txt"
    fi
  else
    echo "no join: needs llama.cpp's run and another (have: ${runs[*]##*/})"
  fi
  if [ -f "$dir/raw/tune/results.jsonl.gz" ]; then
    rm -rf "$dir/tune-report"
    em report --results raw/tune --out tune-report || rc=$?
  fi
  cands=()
  for r in "${runs[@]}"; do [ "$r" = raw/llama ] || cands+=("$r"); done
  best=$("$py" -c "import json,sys; print(json.load(open(sys.argv[1]))['best']['under_load'])" \
    "$dir/raw/tune/tune.json" 2>/dev/null)
  ran=$(gzip -dc "$dir/raw/llama/results.jsonl.gz" 2>/dev/null | grep -o -m 1 -- '-np [0-9]*' | head -n 1)
  if [ -n "$best" ] && [ "$best" != "np${ran#-np }" ] && [ -f "$dir/raw/tune/results.jsonl.gz" ] \
    && [ ${#cands[@]} -ge 1 ]; then
    rm -rf "$dir/tuned-report"
    em report --results raw/tune "${cands[@]}" --baseline "$best" --accept-quantization-difference \
      --out tuned-report || rc=$?
  fi
  exit "$rc"
) > "$dir/output.txt"
rc=$?
cat "$dir/output.txt"
exit "$rc"
