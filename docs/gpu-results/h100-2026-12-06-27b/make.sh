#!/usr/bin/env bash
# Rebuilds this run's reports (report/, tune-report/, output.txt) with the code of this tree from raw/.
exec "$(dirname "$0")/../../../scripts/gpu/report.sh" "$(dirname "$0")"
