#!/usr/bin/env bash
# Rebuilds this run's reports (output.txt and its report folders: scripts/gpu/report48.sh) with this tree's code from raw/.
exec "$(dirname "$0")/../../../scripts/gpu/report48.sh" "$(dirname "$0")"
