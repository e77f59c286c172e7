#!/usr/bin/env bash
# Issue 11, HERE after the device calls: put what came back where it belongs.
#   scripts/gpu/collect.sh capture DIR   DIR holds capture.tar.gz (+ capture-logs.tar.gz) from device.sh capture
#   scripts/gpu/collect.sh bench DIR     DIR holds bench.tar.gz (+ bench-logs.tar.gz) from device.sh bench
# Raw outputs -> docs/gpu-results/three-engines/{capture,live,bench,logs}/; captured shapes ->
# tests/fixtures/engines/<engine>-<version>/; the bench report and charts are rebuilt here from results.jsonl.
set -euo pipefail
cd "$(dirname "$0")/../.."
R=docs/gpu-results/three-engines
F=tests/fixtures/engines
what=$1
src=$2
mkdir -p "$R" "$F"
case $what in
capture)
  tar -xzf "$src/capture.tar.gz" -C "$R"
  mkdir -p "$R/logs"
  [ -f "$src/capture-logs.tar.gz" ] && tar -xzf "$src/capture-logs.tar.gz" -C "$R/logs"
  for e in llamacpp:llama.cpp-11434.0.0 sglang:sglang-0.5.17 vllm:vllm-0.26.0; do
    name=${e%%:*} dir=$F/${e#*:}
    [ -d "$R/capture/$name" ] || continue
    mkdir -p "$dir"
    cp "$R/capture/$name"/* "$dir/"
  done
  ;;
bench)
  tar -xzf "$src/bench.tar.gz" -C "$R"
  mkdir -p "$R/logs"
  [ -f "$src/bench-logs.tar.gz" ] && tar -xzf "$src/bench-logs.tar.gz" -C "$R/logs"
  PY=python3
  [ -x .venv/bin/python ] && PY=.venv/bin/python
  MPLBACKEND=Agg "$PY" -m proxy.cli report --results "$R/bench/results.jsonl" --out "$R/bench" \
    --quantization llamacpp=FP16 --quantization llamacpp_aa=FP16 --quantization sglang=FP16 --quantization vllm=FP16 \
    --baseline llamacpp | tee "$R/bench/verdict.txt"
  ;;
esac
du -sh "$R" "$F"
