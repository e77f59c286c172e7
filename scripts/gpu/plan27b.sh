# shellcheck shell=bash
# The 27B run on one GPU (issue 26): every figure and every command line of it, in ONE place. Sourced by
# scripts/gpu/orchestrate.sh on the GPU machine and by scripts/gpu/smoke.sh here (SMOKE=1 swaps in the CPU
# llama-server, a tiny shape and the SGLang emulator, further down). Edit here, nowhere else; each variable can
# also be set in the environment of the first `device.sh stage` call (the orchestrator inherits it).
#
# The estimates (EST_*, seconds on the H200) come from shared/reference/gpu.md and issue 26 -- how they were
# made, the timeline they add up to and the cut list are in scripts/gpu/README.md. CAP_* bound each step
# (SIGINT, then SIGKILL 30 s later: a bench interrupted writes the report of what finished).

W=${W:-/tmp/w}                       # the directory that outlives the calls: never the repo tree (README: oneMKL)
PYTHON=${PYTHON:-python3}            # the image's python3 (torch, numpy, matplotlib, nvidia-ml-py)
SHM=${SHM:-/dev/shm/em}              # RAM-backed: the 54 GB F16 GGUF (the disk is 64 GiB)

# ---- the model: a 27B-class dense GQA Llama (README: parameters, bytes, KV per token) -------------------------
HF=$W/model/m27b                     # HF dir: config.json + the Mistral v1 tokenizer + [INST] template
VOCAB=$W/model/m27b-vocab.gguf       # its vocab-only GGUF (llama.cpp's convert_hf_to_gguf.py --vocab-only)
SHAPE_ARGS=${SHAPE_ARGS:---n-layer 58 --n-embd 5120 --n-ff 25600 --n-head 40 --n-head-kv 8 --n-ctx-train 262144}
F16=$SHM/m27b-F16.gguf               # written on the machine, deleted once quantized
Q4=$W/m27b-Q4_K_M.gguf               # llama.cpp's own llama-quantize, ~16 GB: what both llama.cpp and SGLang load
TINY=$W/tiny.gguf                    # 2 x 64, same tokenizer: the second engine of the memory-attribution check
ALIAS=m27b

# ---- the budget: each engine configured as on a 72 GB card, measured alone ------------------------------------
BUDGET_GIB=${BUDGET_GIB:-72}
# context per request, the same on every engine (the parity gate compares it): llama.cpp's one unified KV pool
# (-kvu -c CTX) at 232 KiB/token is 43.5 GiB, + 15.2 GiB Q4_K_M weights + buffers = ~61 GiB of the 72
CTX=${CTX:-196608}
# SGLang's static share (weights + KV pool + CUDA graphs) of the card, leaving SG_RESERVE_GIB of the budget for
# the rest of the process (CUDA context, activations): frac = (budget - reserve) / the card's total
# (4 on the 2026-12-03 27B run: 0.484 of the card; SGLang peaked 72.19 GiB, 4.24 GiB beyond its static 67.95:
# 4.7 leaves ~0.45 GiB under the budget -> 0.479)
SG_RESERVE_GIB=${SG_RESERVE_GIB:-4.7}
sg_frac() { "$PYTHON" -c "import sys; print(f'{($BUDGET_GIB - $SG_RESERVE_GIB) * 1024 / float(sys.argv[1]):.3f}')" \
  "${GPU_TOTAL_MIB:-143771}"; }

# ---- builds and CPU work ----------------------------------------------------------------------------------------
LLAMA_SRC=$W/llama/llama.cpp
LLAMA_BIN=${LLAMA_BIN:-$W/build-cuda/bin/llama-server}       # CUDA sm_90, target llama-server only
QUANT_BUILD=${QUANT_BUILD:-$W/build-cpu}                      # llama-quantize needs no CUDA: a CPU build is
QUANTIZE=$QUANT_BUILD/bin/llama-quantize                      # ready minutes before the CUDA one (README)
CUDA_CMAKE="-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release"
CPU_CMAKE="-DGGML_CUDA=OFF -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release"
JOBS=${JOBS:-16}
QUANT_THREADS=${QUANT_THREADS:-16}
# background CPU work yields to the engines and the bench client: nice 19 (builds), 10 (quantize, which the
# SGLang same-file arm waits for), 5 (the F16 writer, which the quantize waits for); engines and bench run at 0
NICE_BUILD=19 NICE_QUANT=10 NICE_WRITE=5

# ---- the engines: the command lines, verbatim as the bench records them -----------------------------------------
LLAMA_THREADS=${LLAMA_THREADS:-8}
# llama.cpp: all layers on the GPU, flash attention, CUDA graphs (its default), one unified KV pool of CTX tokens
# shared by the -np slots (each may use all of it: context per slot = CTX), -fit off (keep these sizes)
llama_cmd() {  # llama_cmd NP [EXTRA...]: NP may be a tune list {4,16}
  local np=$1; shift
  echo "$LLAMA_BIN -m $Q4 -ngl 99 -fa on -fit off -kvu -c $CTX -np $np -t $LLAMA_THREADS --jinja --metrics --slots --no-webui --alias $ALIAS $* --host 127.0.0.1 --port {port}"
}
SG_ENV="PYTHONPATH=$W/sg HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1 PYTHONUNBUFFERED=1"
# the flags that started CUDA graphs (decode bs 1-64 and the prefill graph) with the carried kernels (issue 26)
SG_FLAGS="--attention-backend triton --sampling-backend pytorch --grammar-backend none --cuda-graph-max-bs-decode 64"
sg_common() { echo "$SG_FLAGS --mem-fraction-static $(sg_frac) --context-length $CTX --served-model-name $ALIAS --enable-metrics --enable-cache-report --host 127.0.0.1 --port {port}"; }
# the discounted arm: SGLang with what it runs well, bf16 (dummy weights: the same shape, no files)
sg_bf16_cmd() { echo "$SG_ENV $PYTHON -m sglang.launch_server --model-path $HF --load-format dummy --dtype bfloat16 $(sg_common)"; }
# the same-weights arm: SGLang on llama.cpp's own Q4_K_M file. Decode graphs only: on the 2026-12-03 27B run its
# prefill-graph capture with the GGUF kernels took 67 s for the first of 58 sizes and the arm hit its 480 s cap
# (docs/gpu-results/h200-2026-12-03-27b/raw/sglang-gguf/engines/); llama.cpp's graphs are decode-only too
sg_gguf_cmd() { echo "$SG_ENV $PYTHON -m sglang.launch_server --model-path $Q4 --tokenizer-path $HF --disable-prefill-cuda-graph $(sg_common)"; }
# the arms a switch uses (issue 37): SGLang and vLLM in FP8 (dynamic FP8 of the same dummy bf16 weights; the
# 2026-12-03 lease: SGLang fp8 ready in 125 s at 0.479, peak 71.5 GiB), each alone on the card under the budget
sg_fp8_cmd() { echo "$SG_ENV $PYTHON -m sglang.launch_server --model-path $HF --load-format dummy --dtype bfloat16 --quantization fp8 $(sg_common)"; }
# vLLM 0.26.0 (its carries: VLLM=1 fetch-wheels.sh -> $W/vl). No --gpu-memory-utilization: `bench --launch` sets
# it from --memory-budget (proxy.procs.launch.fit_memory_share: (budget - 1 GiB) / the card, 0.505 on the H200) and
# records it. TRITON_ATTN (the carried kernels; fa3 is only imported), CUDA graphs on (its default) up to 64 seqs
# like SGLang's --cuda-graph-max-bs-decode 64
VL_ENV="PYTHONPATH=$W/vl HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 PYTHONUNBUFFERED=1"
VL_CTX=${VL_CTX:-$CTX}                # --max-model-len; the retry may lower it (VL_RETRY)
# vLLM refuses to start when one request of --max-model-len does not fit its KV cache (at 0.505 of the card: FP8
# weights ~25 GiB, activations ~2-3 GiB, the 43.5 GiB for 196,608 tokens is short by ~1 GiB). The arm then
# retries once, by VL_RETRY:
#   share  --gpu-memory-utilization raised by the KV it lacked (+0.25 GiB), at most the budget's share of the card
#          (0.512): the same context as llama.cpp, the peak up to ~0.5 GiB over the budget (a caveat of the
#          memory gate, not a stop)
#   ctx    --max-model-len at vLLM's own estimate (rounded down to 1 k, >= VL_CTX_MIN): the 72 GiB share kept,
#          but the parity gate stops the verdict at "context per slot differs" (inconclusive; seen in the smoke)
#   auto   (the default) share when the lacking KV fits under that cap, else ctx
VL_RETRY=${VL_RETRY:-auto}
VL_CTX_MIN=${VL_CTX_MIN:-32768}
# the first launch's --gpu-memory-utilization (empty: bench --launch sets it from the budget); the share a refused
# launch's retry found, to skip the refusal: 0.898 for 196,608 tokens on an H100 80GB (2026-12-06, 133 s saved)
VL_SHARE=${VL_SHARE:-}
VL_CTX_FALLBACK=${VL_CTX_FALLBACK:-131072}  # when the log gives no estimate
VL_FLAGS="--attention-backend TRITON_ATTN --max-num-seqs 64"
VL_WAIT_S=${VL_WAIT_S:-240}          # how long the arm waits for vLLM's carries to be unpacked (all 5 stage calls)
vllm_fp8_cmd() {  # vllm_fp8_cmd [CTX] [EXTRA...]
  local ctx=${1:-$VL_CTX}; shift || true
  echo "$VL_ENV $PYTHON -m vllm.entrypoints.openai.api_server --model $HF --served-model-name $ALIAS --load-format dummy --dtype bfloat16 --quantization fp8 $VL_FLAGS --max-model-len $ctx $* --host 127.0.0.1 --port {port}"
}
SG_FP8_BENCH="--quantization sglang-fp8=fp8"
VL_FP8_BENCH="--quantization vllm-fp8=fp8"
# which arms run (ARMS: the core plan, in order; EXTRAS: after the join, when the clock allows, in this order --
# cut from the end: sg_gguf first, then sg_bf16, diag, tune). GGUF=1 puts the same-file arm sg_gguf in the core
ARMS=${ARMS:-sg_fp8 vllm_fp8}
EXTRAS=${EXTRAS-tune diag sg_bf16 sg_gguf}  # EXTRAS="" runs none
if [ -n "${GGUF:-}" ]; then ARMS="$ARMS sg_gguf"; EXTRAS=${EXTRAS//sg_gguf/}; fi
# the precision each SGLang run declares: bf16 as launched (SGLang reports its dtype too); the GGUF arm's comes
# from the file's own header (the bench reads it when the engine says gguf)
SG_BF16_BENCH="--quantization sglang=bf16"
SG_GGUF_BENCH=""

# ---- what each engine is sent: the same workload in every run, so separate runs join -----------------------------
# cells (single-variable sweeps): concurrency 1,4,16,64 at the short prompt; prompt length short,long(~1k),4k,16k
# at one request; 64 output tokens, greedy, cache-cold; 3 repeats after a warm-up wave per cell
WORKLOAD=${WORKLOAD:---concurrency 1,4,16,64 --prompt-lengths short,long,4k,16k --output-lengths 64 --max-tokens 64 --cache cold --repeats 3 --warmup 2 --waves 1}
BENCH_FLAGS="--memory-budget ${BUDGET_GIB}GiB --accept-quantization-difference --launch-timeout 600 --no-progress"
# tune: -np (the slots) with everything else fixed; the first value is the baseline and is launched again last
# (2026-12-03: {4,16} at c=1,16 gave -np 16, +90 % at c=16 and the same memory under -kvu; llama.cpp then lost
# ×7.6 at c=64 with 16 slots, so the next run tunes where it loses: 16 against 64 slots at c=64)
# (issue 37: its last answer was unresolved at 3 repeats: 16 vs 64 slots at c=64 only, 5 repeats)
TUNE_NP=${TUNE_NP:-16,64}             # the plan
TUNE_NP_FULL=${TUNE_NP_FULL:-$TUNE_NP}
TUNE_WORKLOAD=${TUNE_WORKLOAD:---concurrency 64 --prompt-lengths short --output-lengths 64 --max-tokens 64 --cache cold --repeats 5 --warmup 1 --waves 1}
BENCH_NP_DEFAULT=16                  # the bench's llama.cpp -np when tune did not run (else its best under load)
DIAG_ARGS="--probes 3"
LIVE_ARGS="--requests 6 --concurrency 2 --max-tokens 256"
# live traffic through `enginemeter serve` in front of the bench's llama.cpp (issue 37): a recorded concurrency
# mix, CONCURRENCY:SECONDS segments -- bursts to 32-64 between quiet periods at 1-2 (~95 s)
LIVE_PROFILE=${LIVE_PROFILE:-1:15,2:10,32:15,1:10,64:20,2:10,8:15}
LIVE_TRAFFIC_ARGS="--max-tokens 64"

# ---- the clock ----------------------------------------------------------------------------------------------------
DEADLINE_S=${DEADLINE_S:-1450}       # orchestrator seconds; the lease is 30 min from the machine's start (README)
MARGIN_S=${MARGIN_S:-120}            # an optional step runs only if it, the bench and the join end this long before
EST_SG_FP8=230 CAP_SG_FP8=480        # ready 125 s (2026-12-03, same weights, fp8) + bench ~75 + stop
EST_VL_FP8=320 CAP_VL_FP8=540        # ready ~170 s at 7B (torch.compile + graphs), more at 27B, + bench ~75 + stop
EST_VL_RETRY=300                     # the retry after a KV refusal (~60-90 s in): compile cache warm
EST_LIVE=130 CAP_LIVE=300            # launch ~15 s + the profile's ~95 s + the checks
EST_SG_BF16=300 CAP_SG_BF16=560      # load ~200 (dummy init + graph capture) + bench ~75 + stop
EST_SG_GGUF=330 CAP_SG_GGUF=480      # GGUF load + graphs ~200 + bench ~90 (its Q4_K kernels: unknown)
EST_DIAG=90 CAP_DIAG=240             # launch + diagnose (3 probes) + live checks through the proxy
EST_TUNE=200 EST_TUNE_FULL=200 CAP_TUNE=420  # 3 launches (16, 64, 16 again) x (~35 s + 5 x c=64)
EST_BENCH=280 CAP_BENCH=480          # llama.cpp and its A/A relaunch, ~130 s each
# LLAMA_BENCH_FLAGS: extra flags of llama.cpp's bench; a short lease gives "--aa off" (no A/A relaunch: the floor is
# run-to-run variation) with EST_BENCH_OVERRIDE=150
LLAMA_BENCH_FLAGS=${LLAMA_BENCH_FLAGS:-}
EST_BENCH=${EST_BENCH_OVERRIDE:-$EST_BENCH}
EST_JOIN=30 CAP_JOIN=120

if [ -n "${SMOKE:-}" ]; then
  # CPU smoke (scripts/gpu/smoke.sh): the same steps and commands, a tiny shape, the cached CPU llama-server, the
  # SGLang emulator (fakes/sglang_emulator) in front of a resident CPU llama-server standing in for SGLang
  SHM=$W/shm F16=$W/shm/m27b-F16.gguf
  SHAPE_ARGS="--n-layer 2 --n-embd 256 --n-ff 512 --n-head 4 --n-head-kv 2 --n-ctx-train 8192"
  CTX=4096 JOBS=2 QUANT_THREADS=2 LLAMA_THREADS=1
  : "${LLAMA_SERVER_BIN:?smoke: set LLAMA_SERVER_BIN (scripts/build-llama-server.sh)}"
  LLAMA_BIN=$LLAMA_SERVER_BIN
  SMOKE_BACKEND_PORT=${SMOKE_BACKEND_PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
  SMOKE_BACKEND="$LLAMA_BIN -m $TINY -c 8192 -np 2 -t 1 --jinja --no-webui --host 127.0.0.1 --port $SMOKE_BACKEND_PORT"
  emu() { echo "PYTHONPATH=$W/src $PYTHON -m fakes.sglang_emulator --backend http://127.0.0.1:$SMOKE_BACKEND_PORT --served-model-name $ALIAS --context-length $CTX --enable-metrics --enable-cache-report $* --port {port}"; }
  sg_bf16_cmd() { emu --model-path "$HF"; }
  sg_gguf_cmd() { emu --model-path "$Q4"; }
  sg_fp8_cmd() { emu --model-path "$HF" --quantization fp8; }
  # the vLLM emulator sizes its KV cache as share x 140.4 GiB - SMOKE_VL_FIXED_GIB and refuses --max-model-len
  # over it, as vLLM does: the first launch at CTX (at the share the bench sets on the H200, given here: no GPU)
  # fails short by ~0.2 GiB, the retry (VL_RETRY auto -> share; SMOKE_VL_RETRY=ctx: the context) runs
  SMOKE_VL_FIXED_GIB=${SMOKE_VL_FIXED_GIB:-70.2}
  VL_RETRY=${SMOKE_VL_RETRY:-$VL_RETRY}
  vllm_fp8_cmd() {
    local ctx=${1:-$VL_CTX}; shift || true
    echo "PYTHONPATH=$W/src $PYTHON -m fakes.vllm_emulator --backend http://127.0.0.1:$SMOKE_BACKEND_PORT --model $HF --served-model-name $ALIAS --load-format dummy --dtype bfloat16 --quantization fp8 $VL_FLAGS --gpu-memory-utilization 0.505 --emulate-fixed-gib $SMOKE_VL_FIXED_GIB --max-model-len $ctx $* --host 127.0.0.1 --port {port}"
  }
  VL_CTX=$CTX VL_CTX_MIN=1024 VL_CTX_FALLBACK=2048
  LIVE_PROFILE=${SMOKE_LIVE_PROFILE:-1:3,2:3,4:3,1:2}
  # the decode check at 2 % is the GPU's; 16-32-token streams of a tiny model on 2 loaded cores arrive in bursts
  # (the smoke saw a 4.5 % median): the smoke checks the code path at 25 %
  LIVE_TRAFFIC_ARGS="--max-tokens 32 --decode-tolerance 0.25 --fake-nvml"
  EXTRAS=${SMOKE_EXTRAS-}
  WORKLOAD="--concurrency 1,2 --prompt-lengths short,long --output-lengths 16 --max-tokens 16 --cache cold --repeats 3 --warmup 1 --waves 1"
  TUNE_NP=1,2 TUNE_NP_FULL=1,2,4 BENCH_NP_DEFAULT=2
  TUNE_WORKLOAD="--concurrency 1,2 --prompt-lengths short --output-lengths 16 --max-tokens 16 --cache cold --repeats 3 --warmup 1 --waves 1"
  LIVE_ARGS="--requests 4 --concurrency 1 --max-tokens 256 --fake-nvml"
  DEADLINE_S=${SMOKE_DEADLINE_S:-3600} MARGIN_S=${SMOKE_MARGIN_S:-0}
  EST_SG_FP8=60 EST_VL_FP8=60 EST_VL_RETRY=60 EST_LIVE=40 CAP_SG_FP8=300 CAP_VL_FP8=300 CAP_LIVE=200
  EST_SG_BF16=60 EST_SG_GGUF=60 EST_DIAG=40 EST_TUNE=90 EST_TUNE_FULL=150 EST_BENCH=90 EST_JOIN=30
  CAP_SG_BF16=300 CAP_SG_GGUF=300 CAP_DIAG=200 CAP_TUNE=500 CAP_BENCH=400 CAP_JOIN=200
fi
