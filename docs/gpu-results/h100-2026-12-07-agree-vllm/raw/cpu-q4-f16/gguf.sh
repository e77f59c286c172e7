set -e
cd /tmp/l48
t0=$(date +%s)
/work/main/.venv/bin/python /work/main/scripts/gpu/write_weights.py m3b --seed 48 --workers 2 > weights.log 2>&1
echo "weights $(( $(date +%s) - t0 )) s"
PYTHONPATH=llama.cpp/gguf-py /tmp/torchenv/bin/python llama.cpp/convert_hf_to_gguf.py m3b --outtype f16 --outfile m3b-F16.gguf > convert.log 2>&1
echo "convert $(( $(date +%s) - t0 )) s"
/root/.cache/enginemeter/llama-server-11434.0.0-cpu/bin/llama-quantize m3b-F16.gguf m3b-Q4_K_M.gguf Q4_K_M 2 > quantize.log 2>&1
echo "quantize $(( $(date +%s) - t0 )) s"
ls -la
