#!/usr/bin/env bash
# Issue 11: the one entry point of every device call (the call's command stays far under 2000 characters).
#
#   scripts/gpu/device.sh stage     copy the carried parts (.carry/cN/) to /tmp/w, unpack every component
#                                   whose parts are all there, start scripts/gpu/orchestrate.sh once (setsid)
#   scripts/gpu/device.sh capture   wait for the three engines, then scripts/gpu/capture.py (raw shapes) and
#                                   scripts/gpu/live.py (enginemeter live: llama.cpp primary, SGLang then vLLM
#                                   shadow, all mirrored)
#   scripts/gpu/device.sh bench     enginemeter bench: llamacpp, llamacpp_aa (same URL: the A/A noise floor),
#                                   sglang, vllm taking turns
#   scripts/gpu/device.sh status    what is up
# Everything that must come back is packed into $OUT (at most 8 files).
# The machine keeps /tmp/w only while calls follow each other within 30 s.
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
W=/tmp/w
S=$W/state
L=$W/logs
OUT=${OUT:-/tmp/out}
mkdir -p "$W/parts" "$S" "$L" "$OUT"
log() { printf '[device %(%H:%M:%S)T] %s\n' -1 "$*"; }
phase=${1:-status}
export PYTHONUNBUFFERED=1

status() {
  log "state: $(ls "$S" | tr '\n' ' ')"
  nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv,noheader 2>/dev/null
  for e in sglang vllm llama; do
    [ -f "$S/$e.pid" ] && { kill -0 "$(cat "$S/$e.pid")" 2>/dev/null && log "$e pid $(cat "$S/$e.pid") alive" || log "$e DEAD"; }
  done
  tail -n 25 "$L/orch.log" 2>/dev/null
}

pack() {  # pack NAME: the logs and results so far
  tar -czf "$OUT/$1-logs.tar.gz" -C "$W" logs state 2>/dev/null || true
}

unpack() {  # unpack NAME: all of NAME's parts present -> /tmp/w/NAME
  local name=$1 m=$W/parts/$1.manifest
  [ -f "$S/$name.extracted" ] && return 0
  [ -f "$m" ] || return 0
  local p
  while read -r p; do [ -f "$W/parts/$p" ] || return 0; done < "$m"
  local t0=$SECONDS
  mkdir -p "$W/$name"
  local files=()
  while read -r p; do files+=("$W/parts/$p"); done < "$m"
  case $(head -n 1 "$m") in
    *.tar.xz*) cat "${files[@]}" | tar -xJf - -C "$W/$name" ;;
    *.tar*) cat "${files[@]}" | tar -xf - -C "$W/$name" ;;
  esac && touch "$S/$name.extracted" && rm -f "${files[@]}" \
    && log "unpacked $name ($(du -sh "$W/$name" | cut -f1), $(( SECONDS - t0 )) s)"
}

case $phase in
stage)
  n=0
  for d in .carry/c[0-9]*/; do
    [ -d "$d" ] || continue
    for f in "$d"*; do
      [ -f "$W/parts/$(basename "$f")" ] || { cp "$f" "$W/parts/" && n=$((n + 1)); }
    done
  done
  log "copied $n parts ($(du -sh "$W/parts" | cut -f1) waiting)"
  for c in llama em model sg vl; do unpack "$c"; done
  if [ -z "${NO_ORCH:-}" ] && { [ ! -f "$S/orch.pid" ] || ! kill -0 "$(cat "$S/orch.pid")" 2>/dev/null; }; then
    cp scripts/gpu/orchestrate.sh "$W/orchestrate.sh"  # run from a copy: the next call re-syncs the tree
    ROOT=$root setsid nohup bash "$W/orchestrate.sh" > "$L/orch.log" 2>&1 < /dev/null &
    echo $! > "$S/orch.pid"
    log "orchestrator started (pid $!)"
  fi
  sleep "${STAGE_SLEEP:-2}"
  status
  ;;
capture)
  deadline=$(( SECONDS + ${WAIT_S:-330} ))
  while [ ! -f "$S/all.started" ] && [ ! -f "$S/llama.dead" ] && (( SECONDS < deadline )); do sleep 2; done
  # and each live engine answering /health 200 (SGLang: only after its warm-up generation)
  for pu in llama:8081 sglang:30000 vllm:8000; do
    e=${pu%%:*} u=${pu#*:} code=none
    while (( SECONDS < deadline )); do
      { [ -f "$S/$e.pid" ] && kill -0 "$(cat "$S/$e.pid")" 2>/dev/null; } || { code=dead; break; }
      code=$(python3 -c "import sys,urllib.request as u
try: print(u.urlopen(sys.argv[1], timeout=5).status)
except Exception as e: print(getattr(e, 'code', 'down'))" "http://127.0.0.1:$u/health")
      [ "$code" = 200 ] && break
      sleep 2
    done
    log "$e (port $u) /health $code"
  done
  status
  PYTHONPATH=/tmp/em-site:$root python3 scripts/gpu/capture.py --out "$W/capture" 2>&1 | tee "$L/capture.log"
  PYTHONPATH=/tmp/em-site:$root python3 scripts/gpu/live.py --out "$W/live" 2>&1 | tee "$L/live.log"
  status
  tar -czf "$OUT/capture.tar.gz" -C "$W" capture live 2>/dev/null
  pack capture
  ;;
bench)
  status
  PYTHONPATH=/tmp/em-site:$root timeout -s INT "${BENCH_S:-340}" python3 scripts/gpu/bench.py --out "$W/bench" ${BENCH_ARGS:-} 2>&1 | tee "$L/bench.log"
  status
  tar -czf "$OUT/bench.tar.gz" -C "$W" bench 2>/dev/null
  pack bench
  ;;
status)
  status
  pack status
  ;;
esac
