#!/usr/bin/env bash
# Install what the report tests need beyond Python: headless Chromium (Debian's `chromium`, only when missing),
# which draws report.html as a reader's browser would (tests/bench/report/test_headline.py: the answer on the first screen).
# Idempotent, safe to run on every CI start. Usage: scripts/install-report-tools.sh
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1 && ! command -v chromium-browser >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    $SUDO apt-get update -q
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
fi
(command -v chromium || command -v chromium-browser) >/dev/null
echo "report tools ready ($(chromium --version 2>/dev/null || chromium-browser --version))"
