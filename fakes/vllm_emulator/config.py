"""The emulator's settings: vLLM's command line (and the emulator's own ``--emulate-*`` flags), its constants."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

VERSION = "0.26.0"
FINGERPRINT = "vllm-0.26.0-42466141"
NOT_FOUND = ("/health_generate", "/ready", "/server_info", "/get_server_info", "/model_info", "/props", "/slots")
#: vLLM 0.26.0's KV check at startup (vllm/v1/core/kv_cache_utils.py ``_check_enough_kv_cache_memory``, GiB as its
#: ``format_gib``: rounded to 2 places), less its closing documentation link; the harness's retry reads it back
KV_ERROR = (
    "ValueError: To serve at least one request with the model's max seq len ({need}), ({need_gib} GiB KV cache "
    "is needed, which is larger than the available KV cache memory ({have_gib} GiB). Based on the available "
    "memory, the estimated maximum model length is {have}. Try increasing `gpu_memory_utilization` (which also "
    "controls CPU memory on the CPU backend) or decreasing `max_model_len` when initializing the engine."
)
KV_BYTES_PER_TOKEN = 232 * 1024  # the 27B shape's f16 KV per token (scripts/gpu/README.md), for the log lines


@dataclass(frozen=True, slots=True)
class Config:
    backend: str
    model: str
    served_model_name: str
    max_model_len: int
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_logprobs: int = 20
    quantization: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    kv_tokens: int | None = None
    fixed_gib: float | None = None
    card_gib: float = 140.4
    host: str = "127.0.0.1"
    port: int = 8000


def parse_args(argv: list[str] | None = None) -> Config:
    p = argparse.ArgumentParser(prog="python -m fakes.vllm_emulator", description=__doc__.split("\n")[0])
    p.add_argument("model_tag", nargs="?", default=None, help="vllm serve MODEL")
    p.add_argument("--model", default=None)
    p.add_argument("--backend", required=True, help="llama-server base URL")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--load-format", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-logprobs", type=int, default=20, help="the most logprobs / prompt_logprobs a request gets")
    p.add_argument("--emulate-kv-tokens", type=int, default=None, help="the KV cache's size in tokens (emulator)")
    p.add_argument("--emulate-fixed-gib", type=float, default=None, help="KV = share x card - this (emulator)")
    p.add_argument("--emulate-card-gib", type=float, default=140.4, help="the card's size (emulator)")
    # accepted and ignored, as the harness passes them to the real engine
    for flag in (
        "--attention-backend",
        "--compilation-config",
        "--tokenizer",
        "--kv-cache-dtype",
        "--max-num-batched-tokens",
    ):
        p.add_argument(flag, default=None)
    for flag in (
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--disable-log-requests",
        "--enable-log-requests",
    ):
        p.add_argument(flag, action="store_true")
    a = p.parse_args(argv)
    model = a.model or a.model_tag
    if not model:
        p.error("a model: vllm serve MODEL or --model MODEL")
    return Config(
        backend=a.backend.rstrip("/"),
        model=model,
        served_model_name=a.served_model_name or model,
        max_model_len=a.max_model_len or 0,
        gpu_memory_utilization=a.gpu_memory_utilization,
        max_num_seqs=a.max_num_seqs,
        max_logprobs=a.max_logprobs,
        quantization=a.quantization,
        load_format=a.load_format,
        dtype=a.dtype,
        kv_tokens=a.emulate_kv_tokens,
        fixed_gib=a.emulate_fixed_gib,
        card_gib=a.emulate_card_gib,
        host=a.host,
        port=a.port,
    )


config_kv: list[int] = [0]  # the KV cache's tokens as startup_log sized it (/metrics reports it)
