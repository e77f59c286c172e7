# shellcheck shell=bash
# Issue 48's run on one GPU: every figure and command line of it, in ONE place (scripts/gpu/orchestrate48.sh
# sources it on the GPU machine, scripts/gpu/smoke48.sh here with SMOKE=1). Each variable can be set in the
# environment of the first `ORCH=orchestrate48.sh device.sh stage` call.
#
#   weights   ONE random checkpoint (scripts/gpu/write_weights.py: bf16 safetensors, HF's init) of the 3b shape
#             (scripts/gpu/make_model_dir.py: the 27B's family at 3.02 B parameters -- the 27B's 53.6 GB
#             checkpoint, its 53.6 GB F16 GGUF and the Q4_K_M do not fit the 64 GiB disk, nor the lease's clock)
#   gguf      llama.cpp's own convert_hf_to_gguf.py (F16: the reference) and llama-quantize (Q4_K_M: the baseline)
#   agree     enginemeter bench --launch: llama.cpp Q4_K_M (the baseline), llama.cpp F16, vLLM FP8 (the
#             checkpoint, --quantization fp8: FP8 on the fly), each alone on the card under the 72 GB budget, the
#             timed cells and the token agreement of each against the baseline (AGREE_FLAGS)
#   swap      scripts/gpu/swaplive.py: serve launches llama.cpp Q4_K_M, the burst profile flows, the swap to vLLM
#             FP8 (POST /admin/rollout start), the watch, then an abort (the rollback), memory back each time
#   sg        llama.cpp Q4_K_M again, SGLang FP8 (the checkpoint) and SGLang on the Q4_K_M file (the same-file
#             arm), agreement included
#   diag      enginemeter diagnose of the baseline's launch

W=${W:-/tmp/w}
PYTHON=${PYTHON:-python3}
SHAPE=${SHAPE:-3b}
HF=$W/model/m$SHAPE                  # from the model carry (config, tokenizer, template); weights written here
F16=$W/m$SHAPE-F16.gguf              # convert_hf_to_gguf.py --outtype f16: the reference arm's file
Q4=$W/m$SHAPE-Q4_K_M.gguf            # llama-quantize: the baseline's file, and the same-file arm's
ALIAS=m$SHAPE
WEIGHT_SEED=${WEIGHT_SEED:-48}

# ---- the budget: each engine configured as on a 72 GB card -----------------------------------------------------
BUDGET_GIB=${BUDGET_GIB:-72}
CTX=${CTX:-196608}                   # context per request on every engine (the 27B plan's; 3b KV: 112 KiB/token)
SG_RESERVE_GIB=${SG_RESERVE_GIB:-4.7}
sg_frac() { "$PYTHON" -c "import sys; print(f'{($BUDGET_GIB - $SG_RESERVE_GIB) * 1024 / float(sys.argv[1]):.3f}')" \
  "${GPU_TOTAL_MIB:-81559}"; }
# vLLM's share when serve launches it (no bench to set it): what proxy.procs.launch.fit_memory_share gives,
# (budget - 1 GiB) / the card
vl_frac() { "$PYTHON" -c "import sys; print(f'{($BUDGET_GIB - 1) * 1024 / float(sys.argv[1]):.3f}')" \
  "${GPU_TOTAL_MIB:-81559}"; }

# ---- builds and CPU work (as the 27B plan) -----------------------------------------------------------------------
LLAMA_SRC=$W/llama/llama.cpp
LLAMA_BIN=${LLAMA_BIN:-$W/build-cuda/bin/llama-server}
# LLAMA_ON=cpu: llama.cpp's arms on the CPU build's llama-server (no CUDA build, ~270 s saved): for a lease too
# short for that build, when only the token agreement is wanted (llama.cpp's figures then are the CPU's; its
# speed cells are not a GPU's) -- the timeline and the run's README say so. LLAMA_ON=none: no llama.cpp on the
# machine at all (no build, no GGUF; only arms of the checkpoint: `AGREE_ARMS="vllm-bf16 vllm-fp8"`, the FP8
# discount against the bf16 reference, for a lease too short for any build; llama.cpp's side then runs elsewhere)
QUANT_BUILD=${QUANT_BUILD:-$W/build-cpu}
QUANTIZE=$QUANT_BUILD/bin/llama-quantize
CUDA_CMAKE="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release"
CPU_CMAKE="-DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release"
# the CPU build makes a llama-server too: the swap's baseline when the CUDA build is not done in time for the swap
# to fit the deadline (a short lease; the timeline and the swap's notes say so), never otherwise
CPU_TARGETS="llama-quantize llama-server"
CPU_LLAMA_BIN=$QUANT_BUILD/bin/llama-server
JOBS=${JOBS:-16}
QUANT_THREADS=${QUANT_THREADS:-16}
NICE_BUILD=19 NICE_QUANT=10 NICE_WRITE=5
NICE_SERVER=${NICE_SERVER:-0}   # the CUDA llama-server build is the critical path (every GPU step needs it)
# llama.cpp's own converter: the image's torch, numpy, sentencepiece; its gguf-py and conversion/ from the source
CONVERT_ENV="PYTHONPATH=$LLAMA_SRC/gguf-py"
CONVERT_PYTHON=${CONVERT_PYTHON:-$PYTHON}   # needs torch (the image's); the smoke gives a venv with CPU torch

# ---- the engines -------------------------------------------------------------------------------------------------
LLAMA_THREADS=${LLAMA_THREADS:-8}
NP=${NP:-16}
llama_cmd() {  # llama_cmd GGUF NP [EXTRA...]
  local m=$1 np=$2; shift 2
  echo "$LLAMA_BIN -m $m -ngl 99 -fa on -fit off -kvu -c $CTX -np $np -t $LLAMA_THREADS --jinja --metrics --slots --no-webui --alias $ALIAS $* --host 127.0.0.1 --port {port}"
}
SG_ENV="PYTHONPATH=$W/sg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 PYTHONUNBUFFERED=1"
SG_FLAGS="--attention-backend triton --sampling-backend pytorch --grammar-backend none --cuda-graph-max-bs-decode 64"
sg_common() { echo "$SG_FLAGS --mem-fraction-static $(sg_frac) --context-length $CTX --served-model-name $ALIAS --enable-metrics --enable-cache-report --host 127.0.0.1 --port {port}"; }
sg_fp8_cmd() { echo "$SG_ENV $PYTHON -m sglang.launch_server --model-path $HF --dtype bfloat16 --quantization fp8 $(sg_common)"; }
sg_gguf_cmd() { echo "$SG_ENV $PYTHON -m sglang.launch_server --model-path $Q4 --tokenizer-path $HF --disable-prefill-cuda-graph $(sg_common)"; }
VL_ENV="PYTHONPATH=$W/vl HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 PYTHONUNBUFFERED=1"
VL_FLAGS=${VL_FLAGS:-"--attention-backend TRITON_ATTN --max-num-seqs 64"}
vllm_cmd() {  # vllm_cmd [EXTRA...]: the checkpoint as written, bf16 (bench --launch sets the share)
  echo "$VL_ENV $PYTHON -m vllm.entrypoints.openai.api_server --model $HF --served-model-name $ALIAS --dtype bfloat16 $VL_FLAGS --max-model-len $CTX $* --host 127.0.0.1 --port {port}"
}
vllm_fp8_cmd() { vllm_cmd --quantization fp8 "$@"; }  # the checkpoint, FP8 on the fly
# the swap's candidate: serve launches it, so the share is given; its torch.compile cache off, so the outage is
# a first switch's (the agree step compiled the same model minutes before: a warm cache would hide ~30-60 s)
VL_SWAP_ENV=${VL_SWAP_ENV:-VLLM_DISABLE_COMPILE_CACHE=1}
vllm_swap_cmd() { echo "$VL_SWAP_ENV $(vllm_fp8_cmd --gpu-memory-utilization "$(vl_frac)")"; }

# ---- what each step sends -----------------------------------------------------------------------------------------
# the bench of the same-weights arms: the timed cells a switch decides on (one request, and under load) and the
# token agreement (AGREE_FLAGS: filled in once `bench` has it -- issue 46; empty: the cells alone)
WORKLOAD=${WORKLOAD:---concurrency 1,16,64 --prompt-lengths short --output-lengths 64 --max-tokens 64 --cache cold --repeats 3 --warmup 1 --waves 1}
AGREE_FLAGS=${AGREE_FLAGS---agreement 32x64}
# --weights random: write_weights.py's checkpoint (and the GGUF made from it) is random, which no engine can tell:
# its agreement figures then say they are the network's noise, not the discount (h100-2026-12-07-agree-vllm)
BENCH_FLAGS="--memory-budget ${BUDGET_GIB}GiB --accept-quantization-difference --weights random --launch-timeout 600 --no-progress --aa off"
# which engines the agree bench launches, in order (the first is the baseline); sglang-fp8 is left out when its
# carries are not there
AGREE_ARMS=${AGREE_ARMS:-llama-q4 llama-f16 vllm-fp8}
# SGLang's arms in a run of their own after the swap and agree (its carries come last; cut first): FP8 on the
# checkpoint and the same-file arm, each with the token agreement against llama.cpp Q4_K_M launched again
SG_ARMS=${SG_ARMS:-llama-q4 sglang-fp8 sglang-gguf}
arm_cmd() {  # arm_cmd NAME -> NAME=COMMAND
  case $1 in
    llama-q4) echo "llama-q4=$(llama_cmd "$Q4" "$NP")" ;;
    llama-f16) echo "llama-f16=$(llama_cmd "$F16" "$NP")" ;;
    vllm-fp8) echo "vllm-fp8=$(vllm_fp8_cmd)" ;;
    vllm-bf16) echo "vllm-bf16=$(vllm_cmd)" ;;
    sglang-fp8) echo "sglang-fp8=$(sg_fp8_cmd)" ;;
    sglang-gguf) echo "sglang-gguf=$(sg_gguf_cmd)" ;;
  esac
}
arm_quant() {  # the precision each arm declares (the bench reads GGUF headers itself)
  case $1 in vllm-fp8|sglang-fp8) echo "--quantization $1=fp8" ;; vllm-bf16) echo "--quantization $1=bf16" ;; esac
}
# the swap: the recorded burst profile (2026-12-06, concurrency:seconds), repeated; the watch shortened to fit
# the lease (min_dwell_s 60 instead of 300; min_requests 30 per exercised regime, as the default)
SWAP_PROFILE=${SWAP_PROFILE:-1:15,2:10,32:15,1:10,64:20,2:10,8:15}
# with the CPU fallback baseline (a short lease): no bursts past 8 (64 streams on 16 CPU cores would outlast the drain)
SWAP_PROFILE_CPU=${SWAP_PROFILE_CPU:-1:13,8:11,2:10,4:8,1:8}
SWAP_ARGS=${SWAP_ARGS:---before-s 95 --after-s 20 --tail-s 20 --max-tokens 64 --swap min_dwell_s=60 --swap min_requests=30 --swap queue_max_wait_s=300 --swap ready_timeout_s=600 --swap-timeout-s 900}
DIAG_ARGS="--probes 3"
# the order of the GPU steps; the swap first when its code is here (priority 1), else last
STEPS=${STEPS:-swap agree sg diag}
# before the steps, while llama.cpp's CUDA server builds (the card idle ~270-320 s): each of these launched once
# (scripts/gpu/session.py) and stopped, so their compile and kernel caches are warm when a step launches them
# (vLLM FP8 of the 3b on the H100, 2026-12-07: ready 170.5 s on its first launch, 78.5 s on its second). Not for a
# swap step, which measures a first switch's outage (its default: none when STEPS has swap). Empty: none
if [[ " $STEPS " == *" swap "* ]]; then PREWARM=${PREWARM-}; else PREWARM=${PREWARM-vllm-fp8 sglang-fp8}; fi
CAP_PREWARM=${CAP_PREWARM:-300}

# ---- the clock -------------------------------------------------------------------------------------------------------
DEADLINE_S=${DEADLINE_S:-1450}
MARGIN_S=${MARGIN_S:-60}
EST_AGREE=${EST_AGREE:-330} CAP_AGREE=${CAP_AGREE:-600}          # 3 launches (llama ~5 s, vLLM ~100-150 s) + cells + agreement (~60 s each)
EST_SWAP=${EST_SWAP:-420} CAP_SWAP=${CAP_SWAP:-900}            # 95 s baseline + outage (vLLM cold ~100-150 s) + watch 60-120 + 20 + rollback + 20
EST_SG=${EST_SG:-400} CAP_SG=600               # llama ~70 s again + SGLang FP8 and GGUF ~150 s each
EST_DIAG=${EST_DIAG:-90} CAP_DIAG=240

if [ -n "${SMOKE:-}" ]; then
  # CPU smoke (scripts/gpu/smoke48.sh): the same steps, the smoke shape, the cached CPU llama-server and
  # llama-quantize, the vLLM and SGLang emulators (fakes/) in front of a resident CPU llama-server
  SHAPE=smoke HF=$W/model/msmoke F16=$W/msmoke-F16.gguf Q4=$W/msmoke-Q4_K_M.gguf ALIAS=msmoke
  CTX=4096 JOBS=2 QUANT_THREADS=2 LLAMA_THREADS=1 NP=2
  : "${LLAMA_SERVER_BIN:?smoke: set LLAMA_SERVER_BIN (scripts/build-llama-server.sh)}"
  LLAMA_BIN=$LLAMA_SERVER_BIN
  QUANTIZE=$(dirname "$LLAMA_SERVER_BIN")/llama-quantize
  SMOKE_BACKEND_PORT=${SMOKE_BACKEND_PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
  SMOKE_BACKEND="$LLAMA_BIN -m $Q4 -c 8192 -np 4 -t 1 --jinja --no-webui --host 127.0.0.1 --port $SMOKE_BACKEND_PORT"
  sg_fp8_cmd() { echo "PYTHONPATH=$W/src $PYTHON -m fakes.sglang_emulator --backend http://127.0.0.1:$SMOKE_BACKEND_PORT --served-model-name $ALIAS --context-length $CTX --enable-metrics --enable-cache-report --model-path $HF --quantization fp8 --port {port}"; }
  sg_gguf_cmd() { echo "PYTHONPATH=$W/src $PYTHON -m fakes.sglang_emulator --backend http://127.0.0.1:$SMOKE_BACKEND_PORT --served-model-name $ALIAS --context-length $CTX --enable-metrics --enable-cache-report --model-path $Q4 --port {port}"; }
  vllm_cmd() { echo "PYTHONPATH=$W/src $PYTHON -m fakes.vllm_emulator --backend http://127.0.0.1:$SMOKE_BACKEND_PORT --model $HF --served-model-name $ALIAS --dtype bfloat16 $VL_FLAGS --gpu-memory-utilization 0.3 --max-model-len $CTX $* --host 127.0.0.1 --port {port}"; }
  vllm_swap_cmd() { vllm_fp8_cmd; }
  WORKLOAD="--concurrency 1,2 --prompt-lengths short --output-lengths 16 --max-tokens 16 --cache cold --repeats 3 --warmup 1 --waves 1"
  SWAP_PROFILE=${SMOKE_SWAP_PROFILE:-1:4,4:4,2:4}
  SWAP_ARGS="--before-s 15 --after-s 8 --tail-s 6 --max-tokens 16 --swap min_dwell_s=5 --swap min_requests=30 --swap queue_max_wait_s=120 --swap ready_timeout_s=120 --swap-timeout-s 300"
  DIAG_ARGS="--probes 1"
  DEADLINE_S=${SMOKE_DEADLINE_S:-3600} MARGIN_S=0
  EST_AGREE=120 EST_SWAP=120 EST_SG=60 EST_DIAG=40 CAP_AGREE=900 CAP_SWAP=600 CAP_SG=300 CAP_DIAG=200
fi
