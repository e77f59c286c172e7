#!/usr/bin/env bash
# The 2-core blocks of docs/performance.md, one after another, each against the tree BASE (a checkout of an
# earlier commit, run as target proxy@base in the same interleaved rounds) and nginx:
#   perf/blocks.sh OUT_DIR BASE [block ...]     (blocks: fake-32 fake-1 llama-1 llama-32 burst-32 start-cpu)
# BASE: a directory holding the earlier tree, or a commit (archived to a temporary directory here).
# Writes OUT_DIR/commands.txt (the tree, each block's command, the load average before it) and per block
# BLOCK.txt (the bench's output) and BLOCK.json (every figure). ROUNDS scales the rounds of the long blocks.
set -euo pipefail
out=${1:?OUT_DIR}; base=${2:?BASE}; shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
if [ ! -d "$base" ]; then
  commit=$(git -C "$root" rev-parse "$base")
  base=$(mktemp -d /tmp/enginemeter-base.XXXXXX)
  trap 'rm -rf "$base"' EXIT
  git -C "$root" archive "$commit" | tar -x -C "$base"
  base_note="$commit (in $base)"
else
  base_note=$base
fi
py=${PYTHON:-$root/.venv/bin/python}
rounds=${ROUNDS:-6}
blocks=("$@"); [ ${#blocks[@]} -gt 0 ] || blocks=(fake-32 fake-1 llama-1 llama-32 burst-32 start-cpu)
mkdir -p "$out"
echo "tree: $(git -C "$root" rev-parse HEAD) $(git -C "$root" log -1 --format=%s | cut -c1-100); base: $base_note" >"$out/commands.txt"
for b in "${blocks[@]}"; do
  case $b in
    fake-32)   args=(--streams 32 --tokens 64 --cadence-ms 10 --rounds "$rounds") ;;
    fake-1)    args=(--streams 1 --tokens 16 --cadence-ms 10 --duration-s 3 --rounds "$rounds") ;;
    llama-1)   args=(--engine llama --streams 1 --tokens 16 --duration-s 3 --rounds "$rounds") ;;
    llama-32)  args=(--engine llama --streams 32 --tokens 16 --duration-s 3 --rounds 3) ;;
    burst-32)  args=(--arrival burst --streams 32 --tokens 16 --cadence-ms 10 --rounds "$rounds") ;;
    start-cpu) args=(--streams 16 --tokens 1 --cadence-ms 1 --ttft-ms 1 --duration-s 3 --rounds 3) ;;
    *) echo "unknown block $b" >&2; exit 2 ;;
  esac
  cmd=("$py" perf/overhead.py "${args[@]}" --baseline-tree "$base" --json "$out/$b.json")
  echo "== $b ($(cut -d' ' -f1-3 /proc/loadavg) load before): ${cmd[*]}" >>"$out/commands.txt"
  (cd "$root" && "${cmd[@]}") >"$out/$b.txt" 2>&1
done
echo "done $(date -u +%FT%TZ)" >>"$out/commands.txt"
