#!/usr/bin/env bash
# Rebuilds this run's figures (output.txt) with this tree's code from raw/: the token agreement of llama.cpp Q4_K_M
# and F16 on the one checkpoint (raw/cpu-q4-f16, a CPU), and both against vLLM bf16 on the card (raw/device).
set -uo pipefail
dir=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$dir/../../.." && pwd)
py=${PYTHON:-$root/.venv/bin/python}
[ -x "$py" ] || py=python3
show() {  # show CMD...: run in this folder, shown as run, with its exit status
  echo "\$ $*"
  (cd "$dir" && PYTHONPATH="$root" "$@" 2>&1); echo "exit status $?"
}
{
  show "$py" -m proxy.bench.quality raw/cpu-q4-f16/results.jsonl.gz
  show "$py" -m proxy.bench.quality raw/cpu-q4-f16/results.jsonl.gz --baseline llama-f16
  show "$py" "$root/scripts/gpu/paths48.py" raw/device/agree/results.jsonl.gz raw/cpu-q4-f16/results.jsonl.gz
  show sh -c "zcat raw/device/agree/engines/vllm-bf16.log.gz | grep -E 'Loading weights took|init engine|Starting vLLM server' | cut -c1-160"
} > "$dir/output.txt"
sed "s#$root/##g; s#$dir/##g" "$dir/output.txt" > "$dir/output.txt.tmp" && mv "$dir/output.txt.tmp" "$dir/output.txt"
cat "$dir/output.txt"
