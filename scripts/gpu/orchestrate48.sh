#!/usr/bin/env bash
# Issue 48's run on the GPU machine, started once by `ORCH=orchestrate48.sh device.sh stage` (setsid, cwd $W, from
# the tree copy $W/src; scripts/gpu/README.md says why). Every figure and command line: scripts/gpu/plan48.sh.
#
#   CPU  wheels -> $W/em-site; the weights (write_weights.py, into the carried HF dir); llama-quantize (CPU build)
#        and llama-server (CUDA build); convert_hf_to_gguf.py -> F16; llama-quantize -> Q4_K_M
#   GPU  STEPS in order, one engine on the card at a time (each step stops its engines, memory back):
#        agree    bench --launch llama-q4 llama-f16 vllm-fp8 (AGREE_FLAGS: the token agreement)
#        swap     scripts/gpu/swaplive.py: serve, llama.cpp Q4_K_M -> vLLM FP8 under the burst profile, abort
#        sg       bench --launch llama-q4 sglang-fp8 sglang-gguf: SGLang on the checkpoint and on the same file
#        diag     enginemeter diagnose of the baseline (session.py)
# The swap's code may land after the first call: a later `SRC_NEXT=1 device.sh stage` copies that call's tree to
# $W/src-next, which the swap step runs when it is there. A step that would not end before DEADLINE_S is cut.
set -uo pipefail
W=${W:-/tmp/w}
cd "$W" || exit 1
SRC=$W/src
# shellcheck source=scripts/gpu/plan48.sh
. "$SRC/scripts/gpu/plan48.sh"
[ "${LLAMA_ON:-}" = cpu ] && [ -z "${SMOKE:-}" ] && LLAMA_BIN=$CPU_LLAMA_BIN
S=$W/state L=$W/logs R=$W/results TL=$W/timeline.tsv
mkdir -p "$S" "$L" "$R"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
em_path() { local s=$SRC; [ -d "$W/src-next" ] && [ "${1:-}" = next ] && s=$W/src-next; [ -z "${SMOKE:-}" ] && s=$W/em-site:$s; echo "$s"; }
EM=(env "PYTHONPATH=$(em_path)" "$PYTHON" -m proxy.cli)
EMPY=(env "PYTHONPATH=$(em_path)" "$PYTHON")
GPU=0
[ -z "${SMOKE:-}" ] && command -v nvidia-smi > /dev/null && GPU=1
# shellcheck source=scripts/gpu/lanes.sh
. "$SRC/scripts/gpu/lanes.sh"

# ---------------------------------------------------------------------------------------------- CPU lane
cpu_em() {
  if [ -n "${SMOKE:-}" ]; then mark em.ready; return; fi
  wait_for em.extracted || { fail em.ready "$NOTE"; return; }
  local t0=$SECONDS
  if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --target "$W/em-site" "$W"/em/*.whl > "$L/em-pip.log" 2>&1; then
    mark em.ready; tl em cpu "$t0" "$SECONDS" 0 "wheels -> $W/em-site"
  else fail em.ready "pip install of the carried wheels failed: $(tail -n 3 "$L/em-pip.log")"; fi
}
cpu_weights() {
  wait_for model.extracted || { fail hf.done "$NOTE"; return; }
  run weights cpu 600 nice -n "$NICE_WRITE" "$PYTHON" "$SRC/scripts/gpu/write_weights.py" "$HF" --seed "$WEIGHT_SEED" \
    && mark hf.done || fail hf.done "writing the weights: $(tail -n 3 "$L/weights.log")"
}
no_llama() {  # LLAMA_ON=none (plan48.sh): nothing of llama.cpp's is made; the steps that need it are skipped
  [ "${LLAMA_ON:-}" = none ] || return 1
  fail "$1" "LLAMA_ON=none: no llama.cpp on this machine"
}
cpu_build_quant() {
  no_llama quant.built && return
  [ -x "$QUANTIZE" ] && { mark quant.built; tl build_quantize cpu "$SECONDS" "$SECONDS" 0 "cached $QUANTIZE"; return; }
  wait_for llama.extracted || { fail quant.built "$NOTE"; return; }
  # shellcheck disable=SC2086
  if run build_quantize cpu 1200 nice -n "$NICE_BUILD" sh -c "cmake -S '$LLAMA_SRC' -B '$QUANT_BUILD' $CPU_CMAKE > /dev/null && cmake --build '$QUANT_BUILD' --target $CPU_TARGETS -j $JOBS"; then
    mark quant.built
  else fail quant.built "CPU build of llama-quantize failed: $(tail -n 5 "$L/build_quantize.log")"; fi
}
cpu_build_server() {
  no_llama server.built && return
  if [ -n "${SMOKE:-}" ]; then mark server.built; tl build_server cpu "$SECONDS" "$SECONDS" 0 "smoke: cached CPU build"; return; fi
  if [ "${LLAMA_ON:-}" = cpu ]; then  # plan48.sh: llama.cpp's arms on the CPU build's llama-server
    wait_for quant.built || { fail server.built "$NOTE"; return; }
    mark server.built; tl build_server cpu "$SECONDS" "$SECONDS" 0 "LLAMA_ON=cpu: $CPU_LLAMA_BIN, no CUDA build"; return
  fi
  wait_for llama.extracted || { fail server.built "$NOTE"; return; }
  # shellcheck disable=SC2086
  if run build_server cpu 1200 nice -n "$NICE_SERVER" sh -c "cmake -S '$LLAMA_SRC' -B '$W/build-cuda' $CUDA_CMAKE > /dev/null && cmake --build '$W/build-cuda' --target llama-server -j $JOBS"; then
    mark server.built
  else fail server.built "CUDA build of llama-server failed: $(tail -n 5 "$L/build_server.log")"; fi
}
cpu_gguf() {  # the checkpoint -> F16 (llama.cpp's converter) -> Q4_K_M (llama-quantize); the F16 kept: the reference
  no_llama f16.done && { no_llama q4.done; return; }
  wait_for hf.done llama.extracted || { fail f16.done "$NOTE"; fail q4.done "$NOTE"; return; }
  # shellcheck disable=SC2086
  run convert cpu 900 nice -n "$NICE_WRITE" env $CONVERT_ENV "$CONVERT_PYTHON" "$LLAMA_SRC/convert_hf_to_gguf.py" "$HF" \
    --outtype f16 --outfile "$F16.tmp" && mv "$F16.tmp" "$F16" && mark f16.done \
    || { fail f16.done "convert_hf_to_gguf.py: $(tail -n 3 "$L/convert.log")"; fail q4.done "no F16"; return; }
  wait_for quant.built || { fail q4.done "$NOTE"; return; }
  if run quantize cpu 900 nice -n "$NICE_QUANT" "$QUANTIZE" "$F16" "$Q4.tmp" Q4_K_M "$QUANT_THREADS"; then
    mv "$Q4.tmp" "$Q4" && mark q4.done
    tl q4 cpu "$SECONDS" "$SECONDS" 0 "$(du -h "$HF/model.safetensors" | cut -f1) bf16 -> $(du -h "$F16" | cut -f1) F16 -> $(du -h "$Q4" | cut -f1) Q4_K_M"
  else fail q4.done "llama-quantize: $(tail -n 5 "$L/quantize.log")"; fi
}
cpu_lane() {
  cpu_em &
  cpu_weights &
  cpu_build_quant &
  cpu_build_server &
  cpu_gguf &
  if [ -n "${SMOKE:-}" ]; then
    # the emulators' backend (SGLang and vLLM cannot run here): a resident CPU llama-server on the Q4_K_M
    ( wait_for q4.done || { fail sg.extracted "$NOTE"; exit; }
      setsid $SMOKE_BACKEND > "$L/smoke-backend.log" 2>&1 < /dev/null &
      echo $! > "$S/smoke-backend.pid"
      for _ in $(seq 120); do
        "$PYTHON" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)" \
          "http://127.0.0.1:$SMOKE_BACKEND_PORT/health" 2> /dev/null && { mark sg.extracted; mark vl.extracted; exit; }
        sleep 1
      done
      fail sg.extracted "the emulators' backend did not start: $(tail -n 3 "$L/smoke-backend.log")"
      cp "$S/sg.extracted.failed" "$S/vl.extracted.failed" ) &
  fi
  wait
}
sampler() {
  while [ ! -f "$S/done" ]; do
    printf '%s\t%s\t%s\n' "$SECONDS" "$(cut -d' ' -f1-3 /proc/loadavg)" \
      "$( [ "$GPU" = 1 ] && nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader,nounits | head -n 1)"
    sleep 5
  done >> "$L/cpu-gpu.tsv"
}

# ---------------------------------------------------------------------------------------------- GPU lane
# a bench of launched arms; an arm whose install tree is not here (after a bounded wait) is left out and said so
step_bench() {  # step_bench STEP OUT EST CAP ARM...
  local step=$1 out=$2 est=$3 cap=$4 a launches=() quants=() have=()
  shift 4
  NOTE=""
  local need=(hf.done em.ready)
  [[ " $* " == *" llama-"* || " $* " == *" sglang-gguf "* ]] && need+=(server.built q4.done f16.done)
  wait_for "${need[@]}" || { skip "$step" "$NOTE"; return; }
  fits "$est" || { skip "$step" "cut: would end after the deadline (now $SECONDS + $est + margin $MARGIN_S > $DEADLINE_S s)"; return; }
  for a in "$@"; do
    case $a in
      vllm-*) wait_tree vl || { tl "$step" gpu "$SECONDS" "$SECONDS" note "$a left out: vLLM's carries not here"; continue; } ;;
      sglang-*) wait_tree sg || { tl "$step" gpu "$SECONDS" "$SECONDS" note "$a left out: SGLang's carries not here"; continue; } ;;
    esac
    launches+=(--launch "$(arm_cmd "$a")")
    # shellcheck disable=SC2207
    quants+=($(arm_quant "$a"))
    have+=("$a")
  done
  (( ${#have[@]} >= 2 )) || { skip "$step" "fewer than two arms: ${have[*]:-none}"; return; }
  NOTE="arms: ${have[*]}"
  rm -rf "$out"
  # shellcheck disable=SC2086
  run "$step" gpu "$cap" "${EM[@]}" bench "${launches[@]}" "${quants[@]}" --baseline "${have[0]}" $WORKLOAD $BENCH_FLAGS \
    $AGREE_FLAGS --out "$out"
  reap_gpu "$step"
}
wait_tree() {  # wait_tree sg|vl: its install tree unpacked (bounded: the stage calls may never bring it)
  local t_end=$(( SECONDS + ${TREE_WAIT_S:-300} ))
  while [ ! -f "$S/$1.extracted" ] && [ ! -f "$S/$1.extracted.failed" ] && (( SECONDS < t_end )); do sleep 2; done
  [ -f "$S/$1.extracted" ]
}
step_swap() {
  NOTE=""
  wait_for q4.done hf.done em.ready || { skip swap "$NOTE"; return; }
  # llama.cpp on the card (the CUDA build) -- or, when that build would end too late for the swap to fit the
  # deadline, the CPU build's llama-server as the baseline (said in the timeline and the swap's note)
  local baseline_on=card
  while [ ! -f "$S/server.built" ]; do
    deadline
    if [ -f "$S/server.built.failed" ] || (( SECONDS + EST_SWAP + MARGIN_S + 5 >= DEADLINE_S )); then
      [ -x "$CPU_LLAMA_BIN" ] || { skip swap "no llama-server: the CUDA build not done, no CPU one"; return; }
      LLAMA_BIN=$CPU_LLAMA_BIN baseline_on=cpu SWAP_PROFILE=$SWAP_PROFILE_CPU
      tl swap gpu "$SECONDS" "$SECONDS" note "the CUDA build not done at plan second $SECONDS: the baseline is the CPU build's llama-server"
      break
    fi
    sleep 2
  done
  wait_tree vl || { skip swap "vLLM's carries not here"; return; }
  local em; em=$(em_path next)
  env "PYTHONPATH=$em" "$PYTHON" -c "import proxy.server.switch.swapper" 2> /dev/null \
    || { skip swap "this tree's serve has no swap (proxy/server/switch/swapper.py): SRC_NEXT=1 on a later stage call"; return; }
  fits "$EST_SWAP" || { skip swap "cut: would end after the deadline (now $SECONDS + $EST_SWAP + margin $MARGIN_S > $DEADLINE_S s)"; return; }
  local src=$SRC; [ -d "$W/src-next" ] && src=$W/src-next
  NOTE="tree $(basename "$src"); baseline llama.cpp Q4_K_M -np $NP (on the $baseline_on), candidate vLLM FP8 at --gpu-memory-utilization $(vl_frac)"
  rm -rf "$R/swap"
  # shellcheck disable=SC2086
  run swap gpu "$CAP_SWAP" env "PYTHONPATH=$em" "$PYTHON" "$src/scripts/gpu/swaplive.py" --out "$R/swap" \
    --baseline "llama-q4=$(llama_cmd "$Q4" "$NP")" --candidate "vllm-fp8=$(vllm_swap_cmd)" --profile "$SWAP_PROFILE" --model "$ALIAS" $SWAP_ARGS
  reap_gpu swap
}
step_diag() {
  NOTE=""
  wait_for server.built q4.done em.ready || { skip diag "$NOTE"; return; }
  fits "$EST_DIAG" || { skip diag "cut: no time left"; return; }
  local d=$R/diag
  rm -rf "$d"; mkdir -p "$d"
  run diag gpu "$CAP_DIAG" "${EMPY[@]}" "$SRC/scripts/gpu/session.py" --out "$d" --launch "llama-q4=$(llama_cmd "$Q4" "$NP" -lv 4)" -- \
    "${EM[*]} diagnose {url:llama-q4} --log {log:llama-q4} $DIAG_ARGS > $d/diagnose.txt" \
    "${EM[*]} diagnose {url:llama-q4} --log {log:llama-q4} $DIAG_ARGS --json > $d/diagnose.json"
  reap_gpu diag
}
step_prewarm() {  # plan48.sh: PREWARM, only while the CUDA build runs
  local a cmd
  wait_for hf.done em.ready || return 0
  for a in $PREWARM; do
    [ -f "$S/server.built" ] && { tl prewarm gpu "$SECONDS" "$SECONDS" note "llama.cpp built: no prewarm of $a"; return 0; }
    case $a in
      vllm-fp8) wait_tree vl || continue; cmd=$(vllm_fp8_cmd --gpu-memory-utilization "$(vl_frac)") ;;
      sglang-fp8) wait_tree sg || continue; cmd=$(sg_fp8_cmd) ;;
      *) tl prewarm gpu "$SECONDS" "$SECONDS" skip "$a: no prewarm for it"; continue ;;
    esac
    NOTE="$a launched once and stopped while llama.cpp builds: its caches warm for the steps (its ready_s: results/prewarm/$a/session.json)"
    run "prewarm-$a" gpu "$CAP_PREWARM" "${EMPY[@]}" "$SRC/scripts/gpu/session.py" --out "$R/prewarm/$a" --launch "$a=$cmd" -- true
    reap_gpu "prewarm-$a"
  done
}
step() {
  case $1 in
    agree) step_bench agree "$R/agree" "$EST_AGREE" "$CAP_AGREE" $AGREE_ARMS ;;
    swap) step_swap ;;
    sg) step_bench sg "$R/sg" "$EST_SG" "$CAP_SG" $SG_ARMS ;;
    diag) step_diag ;;
    *) skip "$1" "unknown step" ;;
  esac
}

# ---------------------------------------------------------------------------------------------- main
printf 'step\tlane\tstart_s\tend_s\trc\tnote\n' > "$TL"
GPU_TOTAL_MIB=81559
if [ "$GPU" = 1 ]; then
  GPU_TOTAL_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
  log "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader | head -n 1)"
fi
log "plan 48: W=$W deadline ${DEADLINE_S} s; steps: $STEPS; shape $SHAPE; CTX $CTX; vLLM swap share $(vl_frac); SGLang $(sg_frac)${SMOKE:+; SMOKE}"
{ echo "date_utc: $(date -u '+%Y-%m-%d %H:%M:%S')"; echo "gpu_total_mib: $GPU_TOTAL_MIB"; echo "steps: $STEPS"
  echo "shape: $SHAPE ($HF)"; for a in llama-q4 llama-f16 vllm-fp8 vllm-bf16 sglang-fp8 sglang-gguf; do echo "$(arm_cmd "$a")"; done
  echo "swap candidate: $(vllm_swap_cmd)"; echo "swap profile: $SWAP_PROFILE"; echo "swap args: $SWAP_ARGS"
  echo "workload: $WORKLOAD"; echo "agree flags: $AGREE_FLAGS"; nproc; free -g | head -n 2; df -h "$W" | tail -n 1
  [ "$GPU" = 1 ] && nvidia-smi; } > "$R/plan.txt" 2>&1
sampler &
cpu_lane &
cpu=$!
[ -n "$PREWARM" ] && step_prewarm
for st in $STEPS; do step "$st"; done
wait "$cpu"
cp "$HF/weights.json" "$R/weights.json" 2>/dev/null
cp "$HF/config.json" "$R/model-config.json" 2>/dev/null
if [ -f "$S/smoke-backend.pid" ]; then kill "$(cat "$S/smoke-backend.pid")" 2>/dev/null; fi
log "done after $SECONDS s"
mark done
