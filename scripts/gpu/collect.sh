#!/usr/bin/env bash
# HERE, after the device calls: put what the last call brought back (results.tar.gz, logs.tar.gz, timeline.tsv,
# status.txt of scripts/gpu/device.sh) into a dated directory of docs/gpu-results/ and rebuild its reports with
# this tree's code.
#
#   scripts/gpu/collect.sh FILES_DIR [DEST]     DEST default docs/gpu-results/<card>-<date of the run>-27b
#                                               (card: h200, h100, ... from plan.txt's nvidia-smi)
#   REPORT=report48.sh scripts/gpu/collect.sh FILES_DIR DEST   issue 48's run: its make.sh runs report48.sh
#
# DEST/raw/    every run as it came back: NAME/results.jsonl.gz, NAME/command.txt, NAME/report-as-run.md,
#              NAME/verdict-as-run.json, NAME/engines/*.log; tune/tune.json; diag/ (diagnose.txt/.json, live/,
#              session.json); live/ (live traffic: live/traffic.txt, the profile); plan.txt (the commands, the card)
# DEST/logs/   the plan's logs (trimmed on the machine) and timeline.tsv, status.txt
# DEST/make.sh rebuilds DEST/report/ (the runs joined: enginemeter report --results ... --accept-quantization-
#              difference) and DEST/tune-report/ from raw/ (scripts/gpu/report.sh) -- run now, its output in
#              DEST/output.txt
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
src=$(cd "$1" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xzf "$src/results.tar.gz" -C "$work"
[ -f "$src/logs.tar.gz" ] && tar -xzf "$src/logs.tar.gz" -C "$work"
day=$(sed -n 's/^date_utc: \([0-9-]*\).*/\1/p' "$work/results/plan.txt" 2>/dev/null | head -n 1)
card=$( (grep -o -m 1 'NVIDIA H[0-9]*' "$work/results/plan.txt" 2>/dev/null || true) | sed 's/NVIDIA //' | tr '[:upper:]' '[:lower:]')  # none in the smoke
dest=${2:-docs/gpu-results/${card:-h200}-${day:-$(date -u +%F)}-27b}
mkdir -p "$dest/raw" "$dest/logs"
cp -r "$work/results/." "$dest/raw/"
for r in "$dest"/raw/*/; do  # the device's own reports are kept as what it said; make.sh rebuilds them
  [ -f "$r/results.jsonl" ] || continue
  gzip -9f "$r/results.jsonl"
  [ -f "$r/report.md" ] && mv "$r/report.md" "$r/report-as-run.md"
  [ -f "$r/verdict.json" ] && mv "$r/verdict.json" "$r/verdict-as-run.json"
  rm -f "$r"/report.html "$r"/*.svg
done
rm -rf "$dest/raw/joined" "$dest/raw/joined-traffic"  # rebuilt by make.sh from the runs themselves
# the swap's per-request records and every engine log over 100 KB: compressed (swapreport.py reads NAME.gz; the
# tree travels with every device call) -- `zcat` reads them
find "$dest/raw" -type f \( -name '*.jsonl' -o -name '*.log' \) -size +100k -exec gzip -9f {} +
[ -d "$work/logs" ] && cp -r "$work/logs/." "$dest/logs/"
for f in timeline.tsv status.txt; do [ -f "$src/$f" ] && cp "$src/$f" "$dest/logs/"; done
REPORT=${REPORT:-report.sh}
printf '%s\n' '#!/usr/bin/env bash' \
  "# Rebuilds this run's reports (output.txt and its report folders: scripts/gpu/$REPORT) with this tree's code from raw/." \
  "exec \"\$(dirname \"\$0\")/../../../scripts/gpu/$REPORT\" \"\$(dirname \"\$0\")\"" > "$dest/make.sh"
chmod +x "$dest/make.sh"
du -sh "$dest"
bash "scripts/gpu/$REPORT" "$dest" || echo "collect: the reports exited $? (output: $dest/output.txt)" >&2
