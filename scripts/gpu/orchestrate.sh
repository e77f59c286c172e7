#!/usr/bin/env bash
# The 27B plan on the GPU machine (issue 26), started once by `device.sh stage`: setsid, cwd $W, from the tree
# copy $W/src -- never from the repo tree, which every device call lays anew (a process still in the old tree
# has a deleted cwd: the likely cause of the `Intel oneMKL FATAL ERROR` deaths; scripts/gpu/README.md).
# Every figure and command line comes from scripts/gpu/plan27b.sh.
#
# Two lanes at once:
#   CPU  enginemeter's wheels -> $W/em-site; llama-quantize (CPU build) and llama-server (CUDA build); the F16
#        GGUF in RAM-backed $SHM (python -m proxy.embedded model); llama-quantize -> Q4_K_M; the F16 deleted
#   GPU  one engine at a time, each launched by enginemeter itself (issue 37: the arms a switch uses first):
#        sg_fp8    enginemeter bench --launch sglang-fp8=<dummy, --quantization fp8>  (while the CPU lane works)
#        vllm_fp8  enginemeter bench --launch vllm-fp8=<vLLM 0.26, dummy, fp8; the share set by the bench>;
#                  refused for KV room at --max-model-len: retried once (VL_RETRY: smaller context or share)
#        bench     enginemeter bench --launch llama=<Q4_K_M, -np 16> (+ its A/A relaunch)
#        live      scripts/gpu/session.py: llama-server launched; scripts/gpu/live.py --profile (live traffic
#                  through enginemeter serve; the traffic profile it recorded -> results/live/live/traffic.txt)
#        join      enginemeter report --results llama sglang-fp8 vllm-fp8 [...] --baseline llama
#                  (--accept-quantization-difference), and once more with --traffic <the recorded profile>
#        extras    (EXTRAS, when the clock allows, in order; cut from the end): tune (-np 16 vs 64 at c=64),
#                  diag (diagnose + live.py), sg_bf16, sg_gguf (GGUF=1 moves it into the core); the join again
# A step that would not finish before DEADLINE_S is cut (README: the cut list); a launch that dies within
# seconds is retried once with its cause logged. State: $W/state, logs: $W/logs, results: $W/results, one line
# per step in $W/timeline.tsv. `touch $W/state/stop` ends it after the running step.
set -uo pipefail
W=${W:-/tmp/w}
cd "$W" || exit 1
SRC=$W/src
# shellcheck source=scripts/gpu/plan27b.sh
. "$SRC/scripts/gpu/plan27b.sh"
S=$W/state L=$W/logs R=$W/results TL=$W/timeline.tsv
mkdir -p "$S" "$L" "$R"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
EM_PATH=$SRC
[ -z "${SMOKE:-}" ] && EM_PATH=$W/em-site:$SRC
EM=(env "PYTHONPATH=$EM_PATH" "$PYTHON" -m proxy.cli)
EMPY=(env "PYTHONPATH=$EM_PATH" "$PYTHON")
GPU=0
[ -z "${SMOKE:-}" ] && command -v nvidia-smi > /dev/null && GPU=1

# shellcheck source=scripts/gpu/lanes.sh
. "$SRC/scripts/gpu/lanes.sh"
# bench_step STEP CAP EST OUT NAME=CMD [FLAGS...]: one bench run of launched engines, retried once when a
# launch died within seconds
bench_step() {
  local step=$1 cap=$2 est=$3 out=$4 target=$5 rc attempt=1
  shift 5
  while :; do
    rm -rf "$out"
    run "$step" gpu "$cap" "${EM[@]}" bench --launch "$target" $WORKLOAD $BENCH_FLAGS --out "$out" "$@"
    rc=$?
    reap_gpu "$step"
    if [ "$rc" = 2 ] && [ $attempt = 1 ] && died_early "$out" && fits "$est"; then
      local why; why=$(cause_of "$out")
      log "$step: the engine died at launch; retrying once. cause: $why"
      tl "$step" gpu "$SECONDS" "$SECONDS" retry "the engine died at launch: $why"
      mv "$out" "$out-attempt1"
      attempt=2
      continue
    fi
    [ "$rc" = 2 ] && tl "$step" gpu "$SECONDS" "$SECONDS" cause "$(cause_of "$out")"
    return "$rc"
  done
}

# ---------------------------------------------------------------------------------------------- CPU lane
cpu_em() {
  if [ -n "${SMOKE:-}" ]; then mark em.ready; return; fi
  wait_for em.extracted || { fail em.ready "$NOTE"; return; }
  local t0=$SECONDS
  if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$W/em-site" "$W"/em/*.whl > "$L/em-pip.log" 2>&1; then
    mark em.ready; tl em cpu "$t0" "$SECONDS" 0 "wheels -> $W/em-site"
  else fail em.ready "pip install of the carried wheels failed: $(tail -n 3 "$L/em-pip.log")"; fi
}
cpu_build_quant() {
  wait_for llama.extracted || { fail quant.built "$NOTE"; return; }
  [ -x "$QUANTIZE" ] && { mark quant.built; tl build_quantize cpu "$SECONDS" "$SECONDS" 0 "cached $QUANTIZE"; return; }
  # shellcheck disable=SC2086
  if run build_quantize cpu 1200 nice -n "$NICE_BUILD" sh -c "cmake -S '$LLAMA_SRC' -B '$QUANT_BUILD' $CPU_CMAKE > /dev/null && cmake --build '$QUANT_BUILD' --target llama-quantize -j $JOBS"; then
    mark quant.built
  else fail quant.built "CPU build of llama-quantize failed: $(tail -n 5 "$L/build_quantize.log")"; fi
}
cpu_build_server() {
  if [ -n "${SMOKE:-}" ]; then
    log "smoke: no CUDA build; the cached CPU llama-server $LLAMA_BIN"
    mark server.built; tl build_server cpu "$SECONDS" "$SECONDS" 0 "smoke: cached CPU build"; return
  fi
  wait_for llama.extracted || { fail server.built "$NOTE"; return; }
  # shellcheck disable=SC2086
  if run build_server cpu 1200 nice -n "$NICE_BUILD" sh -c "cmake -S '$LLAMA_SRC' -B '$W/build-cuda' $CUDA_CMAKE > /dev/null && cmake --build '$W/build-cuda' --target llama-server -j $JOBS"; then
    mark server.built
  else fail server.built "CUDA build of llama-server failed: $(tail -n 5 "$L/build_server.log")"; fi
}
# room for the F16: RAM-backed $SHM (made larger if need be), else the disk
f16_room() {
  local need=$1 dir avail
  mkdir -p "$SHM"
  avail=$(df -B1 --output=avail "$SHM" | tail -n 1)
  if (( avail < need )) && [ "$(stat -f -c %T "$SHM")" = tmpfs ]; then
    log "F16: $SHM has $(( avail >> 30 )) GiB free, $(( need >> 30 )) GiB needed: remounting larger"
    mount -o remount,size=$(( (need >> 30) + 8 ))G "$(df --output=target "$SHM" | tail -n 1)" 2>> "$L/write_f16.log"
    avail=$(df -B1 --output=avail "$SHM" | tail -n 1)
  fi
  if (( avail >= need )); then echo "$SHM"; return 0; fi
  dir=$W/f16; mkdir -p "$dir"
  avail=$(df -B1 --output=avail "$dir" | tail -n 1)
  # the disk must also hold the Q4_K_M (~30 % of the F16) written beside it
  if (( avail >= need + need * 3 / 10 + (2 << 30) )); then echo "$dir"; return 0; fi
  return 1
}
cpu_write() {
  wait_for em.ready model.extracted || { fail f16.done "$NOTE"; fail tiny.done "$NOTE"; return; }
  run write_tiny cpu 300 "${EMPY[@]}" -m proxy.embedded model "$TINY" --vocab llama-spm --vocab-file "$VOCAB" \
    && mark tiny.done || fail tiny.done "the tiny model: $(tail -n 3 "$L/write_tiny.log")"
  # the F16's size: 2 bytes a matrix element, from the shape (the norms' F32 are noise)
  local need dir
  # shellcheck disable=SC2086
  need=$("$PYTHON" - $SHAPE_ARGS <<'EOF'
import sys
a = dict(zip(sys.argv[1::2], map(int, sys.argv[2::2])))
L, e, f, h, kv = (a[k] for k in ("--n-layer", "--n-embd", "--n-ff", "--n-head", "--n-head-kv"))
print(2 * (L * (2 * e * e + 2 * e * (e // h) * kv + 3 * e * f) + 2 * 32000 * e) + (1 << 28))
EOF
)
  if ! dir=$(f16_room "$need"); then
    fail f16.done "no room for the $(( need >> 30 )) GiB F16: $SHM and $W both too small ($(df -h "$SHM" "$W" | tail -n 2 | tr '\n' ' '))"
    return
  fi
  [ "$dir" = "$SHM" ] || { F16=$dir/$(basename "$F16"); log "F16 on the disk: $F16"; }
  echo "$F16" > "$S/f16.path"
  # shellcheck disable=SC2086
  run write_f16 cpu 900 nice -n "$NICE_WRITE" "${EMPY[@]}" -m proxy.embedded model "$F16" --vocab llama-spm \
    --vocab-file "$VOCAB" $SHAPE_ARGS && mark f16.done || fail f16.done "writing the F16: $(tail -n 3 "$L/write_f16.log")"
}
cpu_quantize() {
  wait_for quant.built f16.done || { fail q4.done "$NOTE"; return; }
  F16=$(cat "$S/f16.path")
  if run quantize cpu 1500 nice -n "$NICE_QUANT" "$QUANTIZE" "$F16" "$Q4.tmp" Q4_K_M "$QUANT_THREADS"; then
    mv "$Q4.tmp" "$Q4" && mark q4.done
    tl q4 cpu "$SECONDS" "$SECONDS" 0 "$(du -h "$F16" | cut -f1) F16 -> $(du -h "$Q4" | cut -f1) Q4_K_M"
  else fail q4.done "llama-quantize: $(tail -n 5 "$L/quantize.log")"; fi
  rm -f "$F16" "$F16.json" "$Q4.tmp"
}
cpu_lane() {
  cpu_em &
  cpu_build_quant &
  cpu_build_server &
  cpu_write &
  cpu_quantize &
  if [ -n "${SMOKE:-}" ]; then
    # the SGLang emulator's backend (SGLang itself cannot run here): a resident CPU llama-server
    ( wait_for tiny.done || { fail sg.extracted "$NOTE"; exit; }
      setsid $SMOKE_BACKEND > "$L/smoke-backend.log" 2>&1 < /dev/null &
      echo $! > "$S/smoke-backend.pid"
      for _ in $(seq 120); do
        "$PYTHON" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)" \
          "http://127.0.0.1:$SMOKE_BACKEND_PORT/health" 2> /dev/null && { mark sg.extracted; mark vl.extracted; exit; }
        sleep 1
      done
      fail sg.extracted "the emulator's backend did not start: $(tail -n 3 "$L/smoke-backend.log")"
      cp "$S/sg.extracted.failed" "$S/vl.extracted.failed" ) &
  fi
  wait
}
# every 5 s: load, CPU counters, GPU memory and utilisation -- what else ran while an engine was measured
sampler() {
  while [ ! -f "$S/done" ]; do
    printf '%s\t%s\t%s\t%s\n' "$SECONDS" "$(cut -d' ' -f1-3 /proc/loadavg)" "$(head -n 1 /proc/stat)" \
      "$( [ "$GPU" = 1 ] && nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits | head -n 1)"
    sleep 5
  done >> "$L/cpu-gpu.tsv"
}

# ---------------------------------------------------------------------------------------------- GPU lane
LATER=$(( EST_BENCH + EST_JOIN ))  # what must still fit after an optional step
step_sg() {  # step_sg STEP NAME CMD_FN EST CAP OUT [BENCH FLAGS...]
  local step=$1 name=$2 fn=$3 est=$4 cap=$5 out=$6
  shift 6
  NOTE=""
  if ! wait_for sg.extracted model.extracted em.ready; then skip "$step" "$NOTE"; return; fi
  [ "$step" = sg_gguf ] && { wait_for q4.done || { skip "$step" "$NOTE"; return; }; }
  has_cli bench --launch || { skip "$step" "this tree's enginemeter has no bench --launch (issue 22): merge it"; return; }
  fits "$est" "$LATER" || { skip "$step" "cut: would end after the deadline (now $SECONDS + $est + $LATER after it + margin $MARGIN_S > $DEADLINE_S s)"; return; }
  bench_step "$step" "$cap" "$est" "$out" "$name=$($fn)" --aa off "$@"
}
# vllm-fp8: vLLM's share is set by the bench from --memory-budget (proxy.procs.launch.fit_memory_share). vLLM refuses
# to start when one request of --max-model-len does not fit its KV cache: then one retry, VL_RETRY=ctx with the
# context its error estimates (>= VL_CTX_MIN; else VL_CTX_FALLBACK), or VL_RETRY=share with the share raised by
# the KV it lacked (capped at the budget's share of the card); the timeline says which and why
vl_retry_target() {  # vl_retry_target OUT -> "TARGET<TAB>why" on stdout; 1 when it was no KV refusal
  local logs est need have ctx share
  logs=$(cat "$1"/engines/*.log 2>/dev/null)
  grep -q 'KV cache is needed\|estimated maximum model length\|No available memory for the cache blocks' <<< "$logs" || return 1
  est=$(grep -o 'estimated maximum model length is [0-9]*' <<< "$logs" | grep -o '[0-9]*$' | tail -n 1)
  need=$(grep -o '([0-9.]* GiB KV cache is needed' <<< "$logs" | grep -o '[0-9.]*' | tail -n 1)
  have=$(grep -o 'available KV cache memory ([0-9.]* GiB)' <<< "$logs" | grep -o '[0-9.]*' | tail -n 1)
  if [ "$VL_RETRY" != ctx ] && [ -n "$need" ] && [ -n "$have" ]; then
    # the share that gives the KV it lacked (+0.25 GiB), and whether it stays under the budget's share of the card
    read -r share ok < <("$PYTHON" -c "import math,sys; b,t,n,h=map(float,sys.argv[1:]); fit=(b-1)*1024/t; cap=math.floor(b*1024/t*1000)/1000
want=math.ceil((fit+(n-h+0.25)*1024/t)*1000)/1000; print(f'{min(cap, want):.3f}', int(want <= cap))" \
      "$BUDGET_GIB" "$GPU_TOTAL_MIB" "$need" "$have")
    if [ "$VL_RETRY" = share ] || [ "$ok" = 1 ]; then
      printf '%s\t%s\n' "vllm-fp8=$(vllm_fp8_cmd "$VL_CTX" --gpu-memory-utilization "$share")" \
        "VL_RETRY=$VL_RETRY -> share: KV for --max-model-len $VL_CTX needs $need GiB, $have GiB available: retry at --gpu-memory-utilization $share (the same context; the peak may pass the $BUDGET_GIB GiB budget by up to ~0.5 GiB)"
      return 0
    fi
  fi
  if [ -n "$est" ]; then ctx=$(( est / 1024 * 1024 )); (( ctx < VL_CTX_MIN )) && ctx=$VL_CTX_MIN
  else ctx=$VL_CTX_FALLBACK; fi
  printf '%s\t%s\n' "vllm-fp8=$(vllm_fp8_cmd "$ctx")" \
    "VL_RETRY=$VL_RETRY -> ctx: KV for --max-model-len $VL_CTX needs ${need:-?} GiB, ${have:-?} GiB available (vLLM's estimate: ${est:-none}): retry at --max-model-len $ctx (the same 72 GiB share; context differs from llama.cpp's $CTX)"
}
step_vllm() {
  local step=vllm_fp8 out=$R/vllm-fp8 target rc attempt=1 retry why
  NOTE=""
  # vLLM's carries may not come at all (no VLLM=1, or calls 3-5 not made): a bounded wait, never the deadline
  local t_end=$(( SECONDS + VL_WAIT_S ))
  while [ ! -f "$S/vl.extracted" ] && [ ! -f "$S/vl.extracted.failed" ] && (( SECONDS < t_end )); do sleep 2; done
  [ -f "$S/vl.extracted" ] || { skip "$step" "vLLM's install tree not here after $VL_WAIT_S s (its carries: VLLM=1 fetch-wheels.sh, the stage calls c2-c5): no vLLM arm"; return; }
  if ! wait_for model.extracted em.ready; then skip "$step" "$NOTE"; return; fi
  has_cli bench --launch || { skip "$step" "this tree's enginemeter has no bench --launch (issue 22): merge it"; return; }
  fits "$EST_VL_FP8" "$LATER" || { skip "$step" "cut: would end after the deadline (now $SECONDS + $EST_VL_FP8 + $LATER after it + margin $MARGIN_S > $DEADLINE_S s)"; return; }
  target="vllm-fp8=$(vllm_fp8_cmd "$VL_CTX" ${VL_SHARE:+--gpu-memory-utilization "$VL_SHARE"})"
  while :; do
    rm -rf "$out"
    # shellcheck disable=SC2086
    run "$step" gpu "$CAP_VL_FP8" "${EM[@]}" bench --launch "$target" $WORKLOAD $BENCH_FLAGS --out "$out" --aa off $VL_FP8_BENCH
    rc=$?
    reap_gpu "$step"
    if [ "$rc" = 2 ] && [ $attempt = 1 ] && died_early "$out" && fits "$EST_VL_RETRY" "$LATER"; then
      if retry=$(vl_retry_target "$out"); then
        target=${retry%%$'\t'*} why=${retry#*$'\t'}
      else
        why="the engine died at launch: $(cause_of "$out"); retrying once, the same command"
      fi
      log "$step: $why"
      tl "$step" gpu "$SECONDS" "$SECONDS" retry "$why"
      mv "$out" "$out-attempt1"
      attempt=2
      continue
    fi
    [ "$rc" = 2 ] && tl "$step" gpu "$SECONDS" "$SECONDS" cause "$(cause_of "$out")"
    return "$rc"
  done
}
step_live() {  # live traffic through enginemeter serve in front of the bench's llama.cpp (-np as benched)
  NOTE=""
  wait_for server.built q4.done tiny.done em.ready || { skip live "$NOTE"; return; }
  fits "$EST_LIVE" "$EST_JOIN" || { skip live "cut: no time left for it before the join"; return; }
  local d=$R/live np tiny="$LLAMA_BIN -m $TINY -ngl 99 -c 2048 -np 1 -t 1 --no-webui --host 127.0.0.1 --port {port}"
  np=$(tuned_np)
  rm -rf "$d"; mkdir -p "$d"
  # shellcheck disable=SC2086
  run live gpu "$CAP_LIVE" "${EMPY[@]}" "$SRC/scripts/gpu/session.py" --out "$d" \
    --launch "llama=$(llama_cmd "$np")" --launch "tiny=$tiny" -- \
    "${EMPY[*]} $SRC/scripts/gpu/live.py --out $d/live --engine llama={url:llama} --pid llama={pid:llama} --engine tiny={url:tiny} --pid tiny={pid:tiny} --profile $LIVE_PROFILE $LIVE_TRAFFIC_ARGS"
  reap_gpu live
  [ -s "$d/live/traffic.txt" ] && tl traffic cpu "$SECONDS" "$SECONDS" 0 "recorded: --traffic $(cat "$d/live/traffic.txt")"
}
step_diag() {
  NOTE=""
  wait_for server.built q4.done tiny.done em.ready || { skip diag "$NOTE"; return; }
  fits "$EST_DIAG" "$LATER" || { skip diag "cut: no time left for it before the bench"; return; }
  local d=$R/diag tiny="$LLAMA_BIN -m $TINY -ngl 99 -c 2048 -np 1 -t 1 --no-webui --host 127.0.0.1 --port {port}"
  rm -rf "$d"; mkdir -p "$d"
  # shellcheck disable=SC2086
  run diag gpu "$CAP_DIAG" "${EMPY[@]}" "$SRC/scripts/gpu/session.py" --out "$d" \
    --launch "llama=$(llama_cmd "${TUNE_NP%%,*}" -lv 4)" --launch "tiny=$tiny" -- \
    "${EM[*]} diagnose {url:llama} --log {log:llama} $DIAG_ARGS > $d/diagnose.txt" \
    "${EM[*]} diagnose {url:llama} --log {log:llama} $DIAG_ARGS --json > $d/diagnose.json" \
    "${EMPY[*]} $SRC/scripts/gpu/live.py --out $d/live --engine llama={url:llama} --pid llama={pid:llama} --engine tiny={url:tiny} --pid tiny={pid:tiny} $LIVE_ARGS"
  reap_gpu diag
}
step_tune() {
  NOTE=""
  wait_for server.built q4.done em.ready || { skip tune "$NOTE"; return; }
  has_cli tune --vary || { skip tune "this tree's enginemeter has no tune (issue 23): merge it"; return; }
  local np=$TUNE_NP_FULL est=$EST_TUNE_FULL
  fits "$est" "$LATER" || { np=$TUNE_NP est=$EST_TUNE; }
  fits "$est" "$LATER" || { skip tune "cut: no time left for it before the bench"; return; }
  rm -rf "$R/tune"
  # shellcheck disable=SC2086
  run tune gpu "$CAP_TUNE" "${EM[@]}" tune --launch "$(llama_cmd "{$np}")" $TUNE_WORKLOAD \
    --memory-budget "${BUDGET_GIB}GiB" --launch-timeout 300 --no-progress --out "$R/tune"
  reap_gpu tune
}
tuned_np() {  # the -np tune found best under load (its tune.json), else the default
  "$PYTHON" - "$R/tune/tune.json" "$BENCH_NP_DEFAULT" <<'EOF'
import json, sys
try:
    t = json.load(open(sys.argv[1]))
    best = t["best"]["under_load"]
    print(next(s["value"] for s in t["settings"] if s["name"] == best))
except Exception:
    print(sys.argv[2])
EOF
}
step_bench() {
  NOTE=""
  wait_for server.built q4.done em.ready || { skip bench "$NOTE"; return; }
  has_cli bench --launch || { skip bench "this tree's enginemeter has no bench --launch (issue 22): merge it"; return; }
  (( SECONDS + 60 <= DEADLINE_S )) || { skip bench "too late: under 60 s before the deadline"; return; }
  local np; np=$(tuned_np)
  NOTE="llama.cpp -np $np ($( [ -f "$R/tune/tune.json" ] && echo "tune's best under load" || echo "the default: no tune"))"
  # shellcheck disable=SC2086
  bench_step bench "$CAP_BENCH" "$EST_BENCH" "$R/llama" "llama=$(llama_cmd "$np")" $LLAMA_BENCH_FLAGS
}
JOINED=""  # the result files the last join used
step_join() {
  local files=() f spec
  for f in llama sglang-fp8 vllm-fp8 sglang sglang-gguf; do [ -s "$R/$f/results.jsonl" ] && files+=("$R/$f/results.jsonl"); done
  if [ ! -s "$R/llama/results.jsonl" ] || [ ${#files[@]} -lt 2 ]; then
    skip join "needs llama.cpp's run and another: have ${files[*]:-none}"; return
  fi
  [ "$JOINED" = "${files[*]}" ] && return 0  # nothing new since the last join
  JOINED="${files[*]}"
  rm -rf "$R/joined"
  run join cpu "$CAP_JOIN" "${EM[@]}" report --results "${files[@]}" --baseline llama --accept-quantization-difference \
    --out "$R/joined"
  cp "$L/join.log" "$R/joined/output.txt" 2>/dev/null
  # the same answer weighed by the traffic live sent through the proxy in front of llama.cpp: its request log's
  # exact profile (every request's start and end), else the profile serve recorded
  for f in "$R"/live/live/traffic.txt; do
    [ -s "$f" ] || continue
    spec=$(head -n 1 "$f")
    [ -s "$R/live/live/requests.jsonl" ] && spec=$R/live/live/requests.jsonl
    rm -rf "$R/joined-traffic"
    run join_traffic cpu "$CAP_JOIN" "${EM[@]}" report --results "${files[@]}" --baseline llama \
      --accept-quantization-difference --traffic "$spec" --out "$R/joined-traffic"
    cp "$L/join_traffic.log" "$R/joined-traffic/output.txt" 2>/dev/null
    echo "$spec" > "$R/joined-traffic/traffic.txt" 2>/dev/null
  done
}
arm() {  # arm NAME: one arm of the plan
  case $1 in
    # shellcheck disable=SC2086
    sg_fp8) step_sg sg_fp8 sglang-fp8 sg_fp8_cmd "$EST_SG_FP8" "$CAP_SG_FP8" "$R/sglang-fp8" $SG_FP8_BENCH ;;
    vllm_fp8) step_vllm ;;
    # shellcheck disable=SC2086
    sg_bf16) step_sg sg_bf16 sglang sg_bf16_cmd "$EST_SG_BF16" "$CAP_SG_BF16" "$R/sglang" $SG_BF16_BENCH ;;
    # shellcheck disable=SC2086
    sg_gguf) step_sg sg_gguf sglang-gguf sg_gguf_cmd "$EST_SG_GGUF" "$CAP_SG_GGUF" "$R/sglang-gguf" $SG_GGUF_BENCH ;;
    diag) step_diag ;;
    tune) step_tune ;;
    *) skip "$1" "unknown arm" ;;
  esac
}
gpu_lane() {
  local a
  for a in $ARMS; do arm "$a"; done
  step_bench
  step_live
  step_join
  # the extras, after the join so that they never delay it; each must end (with a join after it) by the deadline
  LATER=$EST_JOIN
  for a in $EXTRAS; do arm "$a"; done
  step_join
}

# ---------------------------------------------------------------------------------------------- main
printf 'step\tlane\tstart_s\tend_s\trc\tnote\n' > "$TL"
GPU_TOTAL_MIB=143771
if [ "$GPU" = 1 ]; then
  GPU_TOTAL_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
  log "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader | head -n 1)"
fi
log "plan: W=$W deadline ${DEADLINE_S} s; CTX $CTX; SGLang --mem-fraction-static $(sg_frac) ($BUDGET_GIB GiB budget, $SG_RESERVE_GIB reserved, $GPU_TOTAL_MIB MiB card); tune -np {$TUNE_NP} / {$TUNE_NP_FULL}${SMOKE:+; SMOKE}"
{ echo "date_utc: $(date -u '+%Y-%m-%d %H:%M:%S')"; echo "gpu_total_mib: $GPU_TOTAL_MIB"; echo "sg_frac: $(sg_frac)"
  echo "arms: $ARMS; extras: $EXTRAS"; echo "llama: $(llama_cmd N)"; echo "sglang-fp8: $(sg_fp8_cmd)"
  echo "vllm-fp8: $(vllm_fp8_cmd)"; echo "sglang: $(sg_bf16_cmd)"; echo "sglang-gguf: $(sg_gguf_cmd)"
  echo "live profile: $LIVE_PROFILE"
  echo "workload: $WORKLOAD"; echo "tune: $TUNE_WORKLOAD"; nproc; free -g | head -n 2; df -h "$W" /dev/shm | tail -n 2
  [ "$GPU" = 1 ] && nvidia-smi; } > "$R/plan.txt" 2>&1
sampler &
cpu_lane &
cpu=$!
gpu_lane
wait "$cpu"
if [ -f "$S/smoke-backend.pid" ]; then kill "$(cat "$S/smoke-backend.pid")" 2>/dev/null; fi
log "done after $SECONDS s"
mark done
