#!/usr/bin/env bash
# Issue 11, on the GPU machine, started (setsid, once) by scripts/gpu/device.sh stage: brings up the three
# engines as their parts arrive, in an order that keeps their memory accounting honest:
#   1. CUDA llama-server build (as soon as the llama.cpp source is there; ~4.5 min on 16 cores)
#   2. enginemeter's wheels -> /tmp/em-site; the 7B-shape GGUF from the carried vocab GGUF (~30 s, 14.5 GB)
#   3. SGLang (as soon as its tree is there); wait until its KV pool is allocated (it sizes the pool from the
#      memory free after its weights: nothing else may allocate meanwhile)
#   4. vLLM (as soon as its tree is there and SGLang has its pool); wait until vLLM has its KV cache
#   5. llama-server (built, GGUF written, the others settled)
# State files in /tmp/w/state, logs in /tmp/w/logs. Knobs: GIB_PER_ENGINE (23 on 80 GB, 27 above: SGLang's and
# vLLM's share of the GPU), LLAMA_CTX (98304: llama.cpp's shared KV pool, tokens), CTX (8192 per request on all three).
set -uo pipefail
cd "${ROOT:-$(dirname "$0")/../..}"
root=$PWD
W=/tmp/w
S=$W/state
L=$W/logs
mkdir -p "$S" "$L"
CTX=${CTX:-8192}
LLAMA_CTX=${LLAMA_CTX:-98304}
NP=${LLAMA_NP:-64}
log() { printf '[orch %(%H:%M:%S)T] %s\n' -1 "$*"; }
wait_for() { while :; do local ok=1; for f in "$@"; do [ -f "$S/$f" ] || ok=0; done; [ $ok = 1 ] && return 0; [ -f "$S/stop" ] && return 1; sleep 1; done; }
http_ok() { python3 - "$1" <<'EOF'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=3) as r:
        sys.exit(0 if r.status == 200 else 1)
except Exception:
    sys.exit(1)
EOF
}
# wait until FILE matches REGEX, URL answers 200, PID died, or T seconds passed
settle() {  # settle NAME PID LOG REGEX URL TIMEOUT
  local name=$1 pid=$2 logf=$3 re=$4 url=$5 t=$6 t0=$SECONDS
  while (( SECONDS - t0 < t )); do
    if ! kill -0 "$pid" 2>/dev/null; then log "$name died (see $logf)"; touch "$S/$name.dead"; return 1; fi
    if grep -qE "$re" "$logf" 2>/dev/null; then log "$name: memory settled ($(( SECONDS - t0 )) s): $(grep -E "$re" "$logf" | tail -1 | cut -c1-200)"; sleep 3; return 0; fi
    if http_ok "$url"; then log "$name: ready before the marker ($(( SECONDS - t0 )) s)"; return 0; fi
    sleep 1
  done
  log "$name: no marker in $t s, going on"
}

log "start; $(nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader)"
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
# H100 (80 GB): 23 GiB each for SGLang and vLLM (weights 13.5 + ~8 GiB KV), llama.cpp 13.5 + 12 GiB KV pool;
# H200: 27 GiB each (about the same KV as llama.cpp's pool)
if [ "$total_mib" -gt 100000 ]; then GIB=${GIB_PER_ENGINE:-27}; else GIB=${GIB_PER_ENGINE:-23}; fi
FRAC=$(python3 -c "print(round($GIB * 1024 / $total_mib, 3))")
log "SGLang --mem-fraction-static $FRAC, vLLM --gpu-memory-utilization $FRAC ($GIB GiB of $total_mib MiB each); llama.cpp -c $LLAMA_CTX -np $NP"
echo "$FRAC" > "$S/frac"

# 1. llama-server, CUDA
(
  wait_for llama.extracted || exit 1
  t0=$SECONDS
  src=$W/llama/llama.cpp
  cmake -S "$src" -B "$W/llama-build" -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release > "$L/llama-cmake.log" 2>&1 \
    && cmake --build "$W/llama-build" --target llama-server -j16 > "$L/llama-build.log" 2>&1 \
    && touch "$S/llama.built" && log "llama-server built in $(( SECONDS - t0 )) s" \
    || { log "llama-server build FAILED"; tail -n 30 "$L/llama-build.log" "$L/llama-cmake.log"; touch "$S/llama.dead"; }
) &

# 2. enginemeter wheels, 7B GGUF
(
  wait_for em.extracted || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/em-site "$W"/em/*.whl > "$L/em-pip.log" 2>&1 \
    && touch "$S/em.installed" && log "enginemeter wheels installed"
  wait_for model.extracted || exit 1
  t0=$SECONDS
  PYTHONPATH=/tmp/em-site python3 scripts/gpu/write_gguf.py "$W/model/m7b-vocab.gguf" "$W/m7b.gguf" > "$L/gguf.log" 2>&1 \
    && touch "$S/gguf.done" && log "GGUF written in $(( SECONDS - t0 )) s: $(tail -n 1 "$L/gguf.log")" \
    || { log "GGUF FAILED"; tail -n 20 "$L/gguf.log"; }
) &

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 PYTHONUNBUFFERED=1
M=$W/model/m7b

# 3. SGLang
wait_for sg.extracted model.extracted || exit 1
log "starting SGLang"
PYTHONPATH=$W/sg python3 -m sglang.launch_server --model-path "$M" --served-model-name m7b --load-format dummy \
  --dtype float16 --attention-backend triton --sampling-backend pytorch --grammar-backend none --disable-cuda-graph \
  --mem-fraction-static "$FRAC" --context-length "$CTX" --host 127.0.0.1 --port 30000 --enable-metrics \
  --enable-cache-report > "$L/sglang.log" 2>&1 &
echo $! > "$S/sglang.pid"
date +%s > "$S/sglang.t0"
settle sglang "$(cat "$S/sglang.pid")" "$L/sglang.log" "KV Cache is allocated|Memory pool end" http://127.0.0.1:30000/health 400

# 4. vLLM
wait_for vl.extracted || exit 1
log "starting vLLM"
PYTHONPATH=$W/vl python3 -m vllm.entrypoints.openai.api_server --model "$M" --served-model-name m7b --load-format dummy \
  --dtype float16 --attention-backend TRITON_ATTN --enforce-eager --gpu-memory-utilization "$FRAC" \
  --max-model-len "$CTX" --host 127.0.0.1 --port 8000 --enable-prompt-tokens-details > "$L/vllm.log" 2>&1 &
echo $! > "$S/vllm.pid"
date +%s > "$S/vllm.t0"
settle vllm "$(cat "$S/vllm.pid")" "$L/vllm.log" "GPU KV cache size|Maximum concurrency for" http://127.0.0.1:8000/health 300

# 5. llama-server
while [ ! -f "$S/llama.built" ] || [ ! -f "$S/gguf.done" ]; do
  [ -f "$S/llama.dead" ] && { log "no llama-server"; exit 1; }
  sleep 1
done
log "starting llama-server"
"$W/llama-build/bin/llama-server" -m "$W/m7b.gguf" --alias m7b --host 127.0.0.1 --port 8081 -ngl 99 -fa on -fit off \
  -np "$NP" -kvu --kv-unified-per-slot "$CTX" -c "$LLAMA_CTX" --jinja --metrics --slots --no-webui \
  > "$L/llama.log" 2>&1 &
echo $! > "$S/llama.pid"
date +%s > "$S/llama.t0"
settle llama "$(cat "$S/llama.pid")" "$L/llama.log" "server is listening|all slots are idle" http://127.0.0.1:8081/health 180
touch "$S/all.started"
log "all started; $(nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader)"
wait
