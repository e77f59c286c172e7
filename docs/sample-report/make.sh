#!/usr/bin/env bash
# Regenerates docs/sample-report/ with the code of this tree; its raw output goes to output.txt beside it.
# Engines: proxy.embedded.start_default_engines() — the tiny qwen2 model on llama-server -np 1 and -np 2,
# 2048 tokens of context per slot each (-c 2048 and -c 4096), one thread each. The bench: the default preset
# (both cache phases, the A/A pass of the baseline) plus goodput SLOs.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=docs/sample-report
py=${PYTHON:-python}
work=$(mktemp -d)
"$py" - "$work" > "$work/urls" <<'PY' &
import signal, sys, time
from pathlib import Path
from proxy.embedded import start_default_engines
engines = start_default_engines(Path(sys.argv[1]), n=2)
print(" ".join(e.url for e in engines), flush=True)
signal.signal(signal.SIGTERM, lambda *_: [e.stop() for e in engines] and sys.exit(0))
while True:
    time.sleep(1)
PY
engines_pid=$!
trap 'kill $engines_pid; wait $engines_pid 2>/dev/null || true; rm -rf "$work"' EXIT
while ! [ -s "$work/urls" ]; do sleep 0.2; done  # the engines print their URLs once they answer
read -r np1 np2 < "$work/urls"
rm -f "$out"/*.png "$out"/*.svg
cmd=("$py" -m proxy.cli bench --engine "np1=$np1" --engine "np2=$np2" --goodput ttft:200,tpot:20 --no-progress --force --out "$out")
{ echo "\$ enginemeter bench --engine np1=$np1 --engine np2=$np2 --goodput ttft:200,tpot:20 --no-progress --force --out $out"
  "${cmd[@]}" 2>&1 && rc=0 || rc=$?; echo "exit status $rc"; } | tee "$out/output.txt"
