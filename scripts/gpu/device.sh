#!/usr/bin/env bash
# The one entry point of every device call (the call's command stays far under 2000 characters). Everything
# the run needs lives in $W (/tmp/w), which outlives the calls while they follow each other within 30 s; the
# repo tree a call lays anew is only read at `stage` (copied to $W/src) and never run from afterwards.
#
#   scripts/gpu/device.sh stage   copy the carried parts (.carry/cN/) to $W/parts, unpack every component whose
#                                 parts are all there, copy the tree to $W/src (first call), start the plan
#                                 (scripts/gpu/orchestrate.sh: setsid, cwd $W) once
#   scripts/gpu/device.sh wait    until the plan is done or WAIT_S (default 560) passed, a progress line every
#                                 30 s; then pack what is there
#   scripts/gpu/device.sh status  what is up, packed
#   scripts/gpu/device.sh stop    the plan ends after its running step (state/stop)
# Every phase packs into $OUT (at most 8 files, 2 folders deep, 16 MiB each; scripts/gpu/collect.sh unpacks):
#   results.tar.gz  $W/results: every run's results.jsonl, report, verdict.json, engine logs (trimmed)
#   logs.tar.gz     $W/logs: the plan's log, one log per step, cpu-gpu.tsv (trimmed)
#   timeline.tsv    one line per step: lane, start/end (plan seconds), exit status, note (cut, retry, cause)
#   status.txt      nvidia-smi, the state files, the plan log's tail
# Knobs (environment of the first stage call, inherited by the plan): W, DEADLINE_S and every variable of
# scripts/gpu/plan27b.sh (plan48.sh); CARRY_ROOT (default .carry), SRC_TREE (default this repo); ORCH, the plan
# to start (default orchestrate.sh, the 27B plan; orchestrate48.sh: issue 48's). SRC_NEXT=1 on a later stage
# call copies that call's tree to $W/src-next (a plan step that runs later may use it: issue 48's swap).
set -uo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
W=${W:-/tmp/w}
S=$W/state L=$W/logs
OUT=${OUT:-/tmp/out}
CARRY_ROOT=${CARRY_ROOT:-$root/.carry}
SRC_TREE=${SRC_TREE:-$root}
ORCH=${ORCH:-orchestrate.sh}
export W
mkdir -p "$W/parts" "$S" "$L" "$W/results" "$OUT"
log() { printf '[device %(%H:%M:%S)T] %s\n' -1 "$*"; }
phase=${1:-status}
export PYTHONUNBUFFERED=1
# DEADLINE_S on a later call moves the running plan's deadline (plan seconds from its start, call 1)
if [ -n "${DEADLINE_S:-}" ] && [ -d "$W/src" ]; then echo "$DEADLINE_S" > "$S/deadline_s"; log "deadline: plan second $DEADLINE_S"; fi

# the plan is running when its orchestrator is (by its command line: `$!` of the start below is setsid's pid,
# which forks the orchestrator and exits -- a pid file of it made the second stage call start a second plan)
running() { pgrep -f "^bash $W/src/scripts/gpu/orchestrate" >/dev/null; }
status() {
  log "plan: $(running && echo running || { [ -f "$S/done" ] && echo done || echo 'not running'; })" \
    "; state: $(cd "$S" && ls | tr '\n' ' ')"
  command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.used,memory.total,utilization.gpu --format=csv,noheader
  [ -f "$W/timeline.tsv" ] && { column -t -s $'\t' "$W/timeline.tsv" 2>/dev/null || cat "$W/timeline.tsv"; } | cut -c1-220
  tail -n 15 "$L/orch.log" 2>/dev/null
}
# a copy of DIR with every file over 1 MiB cut to its first and last 300 lines (results.jsonl kept whole)
trimmed() {  # trimmed DIR DEST
  rm -rf "$2"; mkdir -p "$2"
  (cd "$1" && find . -type f) | while read -r f; do
    mkdir -p "$2/$(dirname "$f")"
    if [ "$(stat -c %s "$1/$f")" -gt 1048576 ] && [[ $f != *.jsonl && $f != *.gz && $f != *.json ]]; then
      { head -n 300 "$1/$f"; echo "... [$(wc -l < "$1/$f") lines, cut to the first and last 300 by device.sh] ..."
        tail -n 300 "$1/$f"; } > "$2/$f"
    else cp "$1/$f" "$2/$f"; fi
  done
}
pack() {
  local t=$W/pack
  trimmed "$W/results" "$t/results"
  trimmed "$L" "$t/logs"
  tar -czf "$OUT/results.tar.gz" -C "$t" results
  tar -czf "$OUT/logs.tar.gz" -C "$t" logs
  cp "$W/timeline.tsv" "$OUT/timeline.tsv" 2>/dev/null
  status > "$OUT/status.txt" 2>&1
  rm -rf "$t"
  log "packed: $(cd "$OUT" && du -h -- * | tr '\n' ' ')"
}
unpack() {  # unpack NAME: all of NAME's parts present -> $W/NAME
  local name=$1 m=$W/parts/$1.manifest p t0=$SECONDS
  [ -f "$S/$name.extracted" ] && return 0
  [ -f "$m" ] || return 0
  while read -r p; do [ -f "$W/parts/$p" ] || return 0; done < "$m"
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
  for d in "$CARRY_ROOT"/c[0-9]*/; do
    [ -d "$d" ] || continue
    for f in "$d"*; do
      [ -f "$W/parts/$(basename "$f")" ] || { cp "$f" "$W/parts/" && n=$((n + 1)); }
    done
  done
  log "copied $n parts ($(du -sh "$W/parts" | cut -f1) waiting)"
  for c in llama em model sg vl; do unpack "$c"; done
  if [ ! -d "$W/src" ]; then  # the tree the plan runs from: this call's, copied once
    mkdir -p "$W/src.tmp"
    tar -C "$SRC_TREE" --exclude=./.git --exclude=./.carry --exclude=./.venv --exclude=./.device -cf - . \
      | tar -C "$W/src.tmp" -xf - && mv "$W/src.tmp" "$W/src" && log "tree copied to $W/src ($(du -sh "$W/src" | cut -f1))"
  elif [ -n "${SRC_NEXT:-}" ]; then  # a later tree for a step that has not started yet (the plan says which)
    rm -rf "$W/src-next.tmp"; mkdir -p "$W/src-next.tmp"
    tar -C "$SRC_TREE" --exclude=./.git --exclude=./.carry --exclude=./.venv --exclude=./.device --exclude=./docs -cf - . \
      | tar -C "$W/src-next.tmp" -xf - && rm -rf "$W/src-next" && mv "$W/src-next.tmp" "$W/src-next" \
      && log "tree copied to $W/src-next"
  fi
  if [ -z "${NO_ORCH:-}" ] && ! running && [ ! -f "$S/done" ]; then
    (cd "$W" && setsid nohup bash "$W/src/scripts/gpu/$ORCH" >> "$L/orch.log" 2>&1 < /dev/null &)
    for _ in 1 2 3 4 5 6 7 8 9 10; do running && break; sleep 0.2; done
    pgrep -o -f "^bash $W/src/scripts/gpu/orchestrate" > "$S/orch.pid"
    log "plan started (pid $(cat "$S/orch.pid"), cwd $W)"
  fi
  sleep "${STAGE_SLEEP:-3}"
  status
  pack
  ;;
wait)
  end=$(( SECONDS + ${WAIT_S:-560} ))
  next=$(( SECONDS + 30 ))
  while (( SECONDS < end )) && [ ! -f "$S/done" ] && running; do
    sleep 2
    if (( SECONDS >= next )); then
      next=$(( SECONDS + 30 ))
      log "$(tail -n 1 "$L/orch.log" 2>/dev/null | cut -c1-200)"
    fi
  done
  running || [ -f "$S/done" ] || log "the plan is not running (see logs/orch.log)"
  status
  pack
  ;;
status)
  status
  pack
  ;;
stop)
  touch "$S/stop"
  status
  pack
  ;;
*)
  echo "usage: $0 stage|wait|status|stop" >&2
  exit 2
  ;;
esac
