# shellcheck shell=bash
# The helpers every plan on the GPU machine shares (sourced by scripts/gpu/orchestrate.sh, the 27B plan, and
# scripts/gpu/orchestrate48.sh, issue 48's): the log line, the timeline row, state files (`mark`, `fail`,
# `wait_for`), the deadline and the cut rule (`fits`), a step with its cap and log (`run`), `skip`, the GPU reaped
# after a step, a failed launch's cause. Needs S (state dir), L (logs), TL (timeline.tsv), GPU (1: nvidia-smi),
# DEADLINE_S, MARGIN_S and EM (enginemeter's command, an array) set by the plan that sources it.
log() { printf '[orch %5ss %(%H:%M:%S)T] %s\n' "$SECONDS" -1 "$*"; }
tl() { printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "$5" "${6//$'\n'/ }" >> "$TL"; }  # step lane t0 t1 rc note
fail() { printf '%s\n' "$2" > "$S/$1.failed"; log "FAILED $1: $2"; }
mark() { touch "$S/$1"; }
# the deadline may be moved by a later device call (DEADLINE_S=... device.sh stage|wait writes state/deadline_s):
# the lease's clock is only known once the machine's start time is (scripts/gpu/lease.py)
deadline() { [ -s "$S/deadline_s" ] && DEADLINE_S=$(cat "$S/deadline_s"); return 0; }
fits() { deadline; (( SECONDS + $1 + ${2:-0} + MARGIN_S <= DEADLINE_S )); }  # fits EST [LATER]
# wait_for FILE...: until every state file exists; 1 (cause in NOTE) when one failed, on stop or at the deadline
wait_for() {
  local f ok
  while :; do
    ok=1
    for f in "$@"; do
      [ -f "$S/$f.failed" ] && { NOTE="needs $f, which failed: $(head -c 300 "$S/$f.failed")"; return 1; }
      [ -f "$S/$f" ] || ok=0
    done
    [ $ok = 1 ] && return 0
    [ -f "$S/stop" ] && { NOTE="stopped (state/stop)"; return 1; }
    deadline
    (( SECONDS >= DEADLINE_S )) && { NOTE="deadline reached waiting for $*"; return 1; }
    sleep 2
  done
}
# run STEP LANE CAP CMD...: the command with its output in $L/STEP.log, SIGINT at CAP (SIGKILL 30 s later)
run() {
  local step=$1 lane=$2 cap=$3 t0=$SECONDS rc
  shift 3
  log "start $step (cap ${cap} s)"
  printf '+ %s\n' "$*" >> "$L/$step.log"
  timeout -s INT -k 30 "$cap" "$@" >> "$L/$step.log" 2>&1
  rc=$?
  log "end $step rc $rc after $(( SECONDS - t0 )) s"
  tl "$step" "$lane" "$t0" "$SECONDS" "$rc" "${NOTE:-}"
  NOTE=""
  return $rc
}
skip() { log "skip $1: $2"; tl "$1" gpu "$SECONDS" "$SECONDS" skip "$2"; }
# after a GPU step: nothing of it may hold the GPU when the next engine starts (the bench stops its engines;
# this only catches one a SIGKILLed bench left behind)
reap_gpu() {
  [ "$GPU" = 1 ] || return 0
  local pids
  pids=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | tr -d ' ')
  [ -z "$pids" ] && return 0
  log "GPU still held by $pids after $1: SIGTERM"
  kill $pids 2>/dev/null; sleep 10; kill -9 $pids 2>/dev/null; tl reap gpu "$SECONDS" "$SECONDS" 0 "after $1: $pids"
}
# the engine's last log lines, for the timeline and the results, when a launch failed
cause_of() {  # cause_of OUT
  local f
  for f in "$1"/engines/*.log; do
    [ -f "$f" ] || continue
    printf '%s: %s | ' "$(basename "$f" .log)" "$(grep -v '^\s*$' "$f" | tail -n 3 | cut -c1-200 | tr '\n' ' ')"
  done
}
died_early() {  # died_early OUT: the bench stopped at the launch because the engine exited (not a timeout)
  grep -q '"gate": "launch"' "$1/verdict.json" 2>/dev/null && grep -q 'exited with' "$1/verdict.json" 2>/dev/null
}
has_cli() {  # has_cli SUBCOMMAND FLAG: this tree's enginemeter knows it (issue 22/23 landed)
  "${EM[@]}" "$1" --help 2>/dev/null | grep -q -- "$2"
}
