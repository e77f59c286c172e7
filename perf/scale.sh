#!/usr/bin/env bash
# The scale run of docs/performance.md ("Every core"): added TTFT and throughput vs nginx at 256, 1,024 and 4,096
# steady streams, the proxy with 1, 4 and 8 workers, all targets interleaved round by round. Made for a 16-core
# machine: 4 fake-engine processes on one port, 4 load-generator processes, nginx with 8 workers.
#   perf/scale.sh [OUT_DIR]   (NGINX_BIN: a carried nginx, its libraries beside it; .whl/: cp312 wheels, NO_WHEELS=1 skips;
#                              perf/carry.sh makes both; NO_FLOOR=1: without the floor targets; STREAMS, WORKERS, ROUNDS,
#                              DURATION_S; BASELINE_TREE, BASELINE_NAME, BASELINE_WORKERS: another tree in the same rounds)
# The direct rows say whether the engine and the load generators kept up (errors 0, TTFT p50 near the engine's).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-/tmp}
mkdir -p "$out"
py=${PYTHON:-python3}
if [ -d .whl ] && [ -z "${NO_WHEELS:-}" ]; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
ulimit -n 1048576 2>/dev/null || ulimit -n 65536 2>/dev/null || true
{ date -u; nproc; "$py" --version; uptime; echo "open files: $(ulimit -n)"; } | tee "$out/scale-machine.txt"
args=(--streams "${STREAMS:-256,1024,4096}" --tokens 16 --cadence-ms 50 --ttft-ms 50 --rounds "${ROUNDS:-2}" --duration-s "${DURATION_S:-1.5}"
      --proxy-workers "${WORKERS:-1,4,8}" --max-connections 8192 --engine-procs 4 --loadgen-procs 4 --nginx-workers 8)
# the floor: a bare uvloop splice in 8 processes, and the same parsing each SSE data line (perf/floor_relay.py)
if [ -z "${NO_FLOOR:-}" ]; then args+=(--floor); fi
if [ -n "${NGINX_BIN:-}" ]; then args+=(--nginx-bin "$NGINX_BIN"); fi
# another tree in the same rounds (e.g. a ceiling: perf/ceilings/), with BASELINE_WORKERS workers
if [ -n "${BASELINE_TREE:-}" ]; then
  args+=(--baseline-tree "$BASELINE_TREE" --baseline-name "${BASELINE_NAME:-proxy@base}" --baseline-workers "${BASELINE_WORKERS:-8}")
fi
echo "$py perf/overhead.py ${args[*]} --json $out/scale.json" | tee -a "$out/scale-machine.txt"
PYTHONUNBUFFERED=1 "$py" perf/overhead.py "${args[@]}" --json "$out/scale.json" 2>&1 | tee "$out/scale.txt"
