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
"$venv/bin/python" -m pip install -q --upgrade pip >&2 2>/dev/null || true
"$venv/bin/python" -m pip install -q -e "$root[$extras]" 2>&1 | grep -v '^WARNING: Location' >&2 || true
"$venv/bin/python" -c "import proxy, starlette, uvicorn, httpx, prometheus_client" # fail loudly if the install did not take
touch "$stamp"
