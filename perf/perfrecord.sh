#!/usr/bin/env bash
# Where the proxy's CPU goes below Python: Linux perf (apt-get install -y linux-perf) on the proxy process under
# fake-32's load (32 steady streams, 64 chunks 10 ms apart), by shared object (the interpreter, the kernel, uvloop,
# httptools, orjson, libc) and by symbol. py-spy (perf/pyspy.py) sees Python frames only: it books the kernel's and
# the interpreter's own time to the innermost Python frame it finds (often the event loop's run()).
#   perf/perfrecord.sh OUT_DIR   (writes OUT_DIR/perf-dso.txt, perf-sym.txt, bench.txt)
set -euo pipefail
out=${1:?OUT_DIR}; mkdir -p "$out"
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
cd "$root"
"$py" perf/overhead.py --streams 32 --tokens 64 --cadence-ms 10 --rounds 12 --nginx off -v >"$out/bench.txt" 2>&1 &
bench=$!
pid=""
for _ in $(seq 120); do
  pid=$(grep -o "started proxy (pid [0-9]*" "$out/bench.txt" | grep -o "[0-9]*$" || true)
  [ -n "$pid" ] && break
  sleep 0.5
done
[ -n "$pid" ] || { echo "the proxy did not start (see $out/bench.txt)" >&2; exit 1; }
# past its start-up (imports, the engine probe, two TLS contexts of the CA store) and the warm-up rounds
for _ in $(seq 240); do grep -q "round 1/" "$out/bench.txt" && break; sleep 0.5; done
# the proxy is idle while the other targets run its rounds' turn: its samples are its own rounds'
perf record -q -F 1999 -g -p "$pid" -o "$out/perf.data" -- sleep "${SECONDS_RECORDED:-20}" >/dev/null 2>&1 || true
wait "$bench"
{ echo "perf record -F 1999 -g -p <proxy> -- sleep ${SECONDS_RECORDED:-20}; perf report --no-children --sort dso -g none"
  perf report -i "$out/perf.data" --no-children --sort dso -g none 2>/dev/null | grep '%' ; } >"$out/perf-dso.txt"
{ echo "perf report --no-children --sort dso,sym -g none (top 40)"
  perf report -i "$out/perf.data" --no-children --sort dso,sym -g none 2>/dev/null | grep '%' | head -40 ; } >"$out/perf-sym.txt"
rm -f "$out/perf.data"
cat "$out/perf-dso.txt"
