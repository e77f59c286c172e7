#!/usr/bin/env bash
# Create/refresh the project's virtual environment (.venv) with enginemeter and the given extras.
# Idempotent and quick when nothing changed (keyed by a hash of pyproject.toml + extras).
# Usage: scripts/bootstrap.sh [extras]     e.g. scripts/bootstrap.sh test
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
extras="${1:-embedded}"
venv="${ENGINEMETER_VENV:-$root/.venv}"
py="${PYTHON:-python3}"
stamp="$venv/.enginemeter-$extras-$(sha256sum "$root/pyproject.toml" | cut -c1-16)"
if [ -f "$stamp" ]; then exit 0; fi
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
echo "enginemeter: installing into $venv (first run or pyproject.toml changed)..." >&2
log="$venv/bootstrap.log"
"$venv/bin/python" -m pip install -q --upgrade pip > "$log" 2>&1 || true
if ! "$venv/bin/python" -m pip install -q -e "$root[$extras]" >> "$log" 2>&1; then
  grep -v '^WARNING: Location' "$log" >&2
  exit 1
fi
"$venv/bin/python" -c "import proxy, starlette, uvicorn, httpx, prometheus_client" # fail loudly if the install did not take
touch "$stamp"
