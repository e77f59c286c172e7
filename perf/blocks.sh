#!/usr/bin/env bash
# The 2-core blocks of docs/performance.md, one after another, each against the tree BASE (a checkout of an
# earlier commit, run as target proxy@base in the same interleaved rounds) and nginx:
#   perf/blocks.sh OUT_DIR BASE [block ...]
# Blocks (default: all but the two llama ones, which need $LLAMA_SERVER_BIN or the cached CPU build):
#   fake-32    32 steady streams, 64 chunks 10 ms apart after 50 ms: the targets' block; the proxy twice, probing
#              the engine (llama.cpp-like: a fresh upstream connection per stream) and as kind openai (kept alive,
#              as nginx keeps its own); fake-1, fake-32 and w2-256 also run the floor targets (perf/floor_relay.py)
#   fake-1     one stream at a time
#   llama-1    one stream against a real llama-server (llama-32: 32 of them, -np 32)
#   burst-32   32 streams started at once
#   start-cpu  16 streams of one token: the CPU of a request start
#   w2-256     256 steady streams, the proxy with 1 and 2 workers (serve --workers): throughput on both cores (BASE:
#              one worker)
#   gc         fake-32's load with the GC probe in the proxies (perf/probe): pauses per generation
#   profile-32 py-spy of the proxy under fake-32's load (perf/pyspy.py; pip install py-spy)
#   loopcost   perf/loopcost.py: what the loop pays for work in threads (a /metrics scrape, by switch interval),
#              for C calls that hold the GIL, and for a full garbage collection of the start-up heap
#   chunkpath  perf/chunkpath.py on this tree and on BASE: the per-chunk path and a request's metrics, hot
#   ceiling-chunk, ceiling-request
#              fake-32's load, kept-alive upstream, against this tree with perf/ceilings/chunk.patch (no per-chunk
#              work) or request.patch (no gateway) applied, as target ceiling-chunk / ceiling-request instead of
#              BASE: what the proxy would cost if that part cost nothing
#   tokens-16, tokens-256
#              fake-32 with 16 or 256 chunks a stream (kept alive): with fake-32, the CPU of a request apart
#              from the CPU of a chunk
# BASE: a directory holding the earlier tree, or a commit (archived to a temporary directory here).
# Writes OUT_DIR/commands.txt (the tree, the machine, each block's command and the load average before it) and
# per block BLOCK.txt (the bench's output) and BLOCK.json (every figure). ROUNDS scales the rounds of the long
# blocks (default 6).
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
blocks=("$@")
ceil=
[ ${#blocks[@]} -gt 0 ] || blocks=(fake-32 fake-1 burst-32 start-cpu w2-256 gc profile-32 loopcost chunkpath)
mkdir -p "$out"
{
  echo "tree: $(git -C "$root" rev-parse HEAD) $(git -C "$root" log -1 --format=%s | cut -c1-100); base: $base_note"
  echo "machine: $(nproc) CPUs, $(uname -r), $("$py" --version 2>&1), $(nginx -v 2>&1 || echo 'no nginx')"
  echo "start: $(date -u +%FT%TZ); $(uptime)"
} >"$out/commands.txt"
for b in "${blocks[@]}"; do
  runner=(perf/overhead.py)
  case $b in
    fake-32)    args=(--streams 32 --tokens 64 --cadence-ms 10 --rounds "$rounds" --engine-kind auto,openai --floor) ;;
    fake-1)     args=(--streams 1 --tokens 16 --cadence-ms 10 --duration-s 3 --rounds "$rounds" --floor) ;;
    llama-1)    args=(--engine llama --streams 1 --tokens 16 --duration-s 3 --rounds "$rounds") ;;
    llama-32)   args=(--engine llama --streams 32 --tokens 16 --duration-s 3 --rounds 3) ;;
    burst-32)   args=(--arrival burst --streams 32 --tokens 16 --cadence-ms 10 --rounds "$rounds") ;;
    start-cpu)  args=(--streams 16 --tokens 1 --cadence-ms 1 --ttft-ms 1 --duration-s 3 --rounds 3) ;;
    w2-256)     args=(--streams 256 --tokens 64 --cadence-ms 20 --rounds 3 --proxy-workers 1,2 --max-connections 1024 --floor) ;;
    gc)         args=(--streams 32 --tokens 64 --cadence-ms 10 --rounds 3 --nginx off -v
                      --proxy-env "PYTHONPATH=$root/perf/probe" --proxy-env "ENGINEMETER_GCPROBE=$out/gc") ;;
    profile-32) runner=(perf/pyspy.py --out "$out/profile-32" --streams 32 --tokens 64 --cadence-ms 10 --rounds 8 --)
                args=() ;;
    loopcost)   runner=(perf/loopcost.py); args=() ;;
    chunkpath)  runner=(sh -c "'$py' perf/chunkpath.py && '$py' perf/chunkpath.py --tree '$base'"); args=() ;;
    ceiling-*)  part=${b#ceiling-}
                ceil=$(mktemp -d /tmp/enginemeter-ceiling.XXXXXX)
                git -C "$root" archive HEAD | tar -x -C "$ceil"
                git -C "$ceil" apply "$root/perf/ceilings/$part.patch"  # outside a repository: as patch -p1
                args=(--streams 32 --tokens 64 --cadence-ms 10 --rounds "$rounds" --engine-kind openai --floor
                      --baseline-name "$b") ;;
    tokens-*)   args=(--streams 32 --tokens "${b#tokens-}" --cadence-ms 10 --rounds 3 --engine-kind openai --floor) ;;
    *) echo "unknown block $b" >&2; exit 2 ;;
  esac
  case $b in
    profile-32|loopcost) cmd=("$py" "${runner[@]}" "${args[@]}") ;;
    chunkpath)      cmd=("${runner[@]}") ;;
    ceiling-*)      cmd=("$py" "${runner[@]}" "${args[@]}" --baseline-tree "$ceil" --json "$out/$b.json") ;;
    *)              cmd=("$py" "${runner[@]}" "${args[@]}" --baseline-tree "$base" --json "$out/$b.json") ;;
  esac
  echo "== $b ($(cut -d' ' -f1-3 /proc/loadavg) load before, $(date -u +%T)): ${cmd[*]}" >>"$out/commands.txt"
  (cd "$root" && PYTHONUNBUFFERED=1 "${cmd[@]}") >"$out/$b.txt" 2>&1 || echo "   (exit $?)" >>"$out/commands.txt"
  if [ -n "${ceil:-}" ]; then rm -rf "$ceil"; ceil=; fi
done
echo "done $(date -u +%FT%TZ); $(uptime)" >>"$out/commands.txt"
