"""A vLLM 0.26.0 OpenAI server in front of a llama-server: vLLM's command line, startup checks, log lines and
answers (as captured on the H200: tests/fixtures/engines/vllm-0.26.0/, shared/reference/engines.md), the tokens
from the backend. Used by the CPU smoke of the GPU harness (scripts/gpu/plan27b.sh) in vLLM's place.

    python -m fakes.vllm_emulator --backend http://127.0.0.1:8080 --model DIR --served-model-name m27b \\
        --quantization fp8 --load-format dummy --gpu-memory-utilization 0.505 --max-model-len 196608 --port 8000

What it copies from vLLM: ``/health`` and ``/ping`` 200 with an empty body, ``/version`` ``{"version":"0.26.0"}``,
``/load``, ``/v1/models`` (``root``, ``max_model_len``, ``owned_by: vllm``), ``POST /tokenize`` (a chat prompt
tokenized as the template renders it, ``add_special_tokens`` false by default; a plain prompt with them, true by
default), ``POST /detokenize`` (``{"prompt"}``, special tokens kept), and ``/v1/completions`` asking for tokens
(``completions``: ``return_token_ids``, ``logprobs`` with ``return_tokens_as_token_ids``, ``prompt_logprobs``
as vLLM orders them, over ``--max-logprobs`` a 400 with vLLM's message; see :mod:`fakes.llama_logprobs` for what
the backend cannot tell: a rank past the top-k); 404 with
``{"detail":"Not Found"}`` for SGLang's and llama.cpp's endpoints; the stream's ``finish_reason`` on the last
content chunk (no separate finish chunk) and the usage chunk with ``choices: []``; a context overflow as a 400 in
the nested error shape (``param: "input_tokens"``); ``/metrics`` with ``vllm:num_requests_running`` and
``vllm:cache_config_info`` (``gpu_memory_utilization``, ``kv_cache_size_tokens``). Its startup log prints the lines
enginemeter's vLLM dialect reads (``non-default args``, ``Model loading took``, ``GPU KV cache size``), and, as
vLLM does, it refuses to start when one request of ``--max-model-len`` tokens does not fit the KV cache
(the emulator's own flags: ``--emulate-kv-tokens`` the cache's size in tokens, or ``--emulate-fixed-gib F``: the
cache is ``--gpu-memory-utilization`` x ``--emulate-card-gib`` (140.4, the H200) less F GiB, at the 27B shape's 232
KiB a token, so a higher share makes room as on the card) -- the smoke's retry path.

Modules: ``config`` (the command line, constants), ``server`` (the routes, the OpenAI answers), ``completions``
(``/v1/completions`` with token ids and log-probabilities).
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from typing import Any

import httpx
import uvicorn

from fakes.vllm_emulator.config import KV_BYTES_PER_TOKEN, KV_ERROR, Config, config_kv, parse_args
from fakes.vllm_emulator.server import create_app

__all__ = ["Config", "create_app", "main", "parse_args", "startup_log"]


def _wait_backend(url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            r = httpx.get(url + "/props", timeout=2)
            if r.status_code == 200:
                props: dict[str, Any] = r.json()
                return props
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"the backend {url} did not answer /props")
        time.sleep(0.5)


def startup_log(config: Config) -> str | None:
    """vLLM's startup lines, or the KV check's error (None when the engine starts)."""
    gib = 2**30
    args = {"model_tag": config.model, "model": config.model, "served_model_name": [config.served_model_name],
            "gpu_memory_utilization": config.gpu_memory_utilization, "max_model_len": config.max_model_len,
            "load_format": config.load_format, "quantization": config.quantization}  # fmt: skip
    print(f"(APIServer pid={os.getpid()}) INFO non-default args: {args}", flush=True)
    kv = config.kv_tokens
    if kv is None and config.fixed_gib is not None:
        kv = max(
            0, int((config.gpu_memory_utilization * config.card_gib - config.fixed_gib) * gib / KV_BYTES_PER_TOKEN)
        )
    if kv is not None and config.max_model_len > kv:
        need, have = config.max_model_len * KV_BYTES_PER_TOKEN, kv * KV_BYTES_PER_TOKEN
        print(KV_ERROR.format(need=config.max_model_len, need_gib=round(need / gib, 2), have_gib=round(have / gib, 2), have=kv),
              file=sys.stderr, flush=True)  # fmt: skip
        return None
    kv = kv or config.max_model_len * 4
    config_kv[0] = kv
    print("(EngineCore pid=0) INFO Model loading took 0.01 GiB and 0.10 seconds", flush=True)
    print(f"(EngineCore pid=0) INFO Available KV cache memory: {kv * KV_BYTES_PER_TOKEN / gib:.2f} GiB", flush=True)
    print(f"(EngineCore pid=0) INFO GPU KV cache size: {kv:,} tokens", flush=True)
    print(f"(EngineCore pid=0) INFO Maximum concurrency for {config.max_model_len:,} tokens per request: "
          f"{kv / max(config.max_model_len, 1):.2f}x", flush=True)  # fmt: skip
    return "ok"


def main(argv: list[str] | None = None) -> None:
    config = parse_args(argv)
    props = _wait_backend(config.backend)
    if not config.max_model_len:  # vLLM: the model's own context; here the backend's per-slot context
        n_ctx = int((props.get("default_generation_settings") or {}).get("n_ctx") or 4096)
        config = Config(**{**{f: getattr(config, f) for f in Config.__dataclass_fields__}, "max_model_len": n_ctx})
    if startup_log(config) is None:
        sys.exit(1)

    async def serve() -> None:
        async with httpx.AsyncClient(base_url=config.backend, timeout=httpx.Timeout(None)) as client:
            server = uvicorn.Server(uvicorn.Config(create_app(config, client), host=config.host, port=config.port,
                                                   log_level="warning", access_log=False, lifespan="off"))  # fmt: skip
            stop = threading.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, lambda: setattr(server, "should_exit", True))
            print(f"(APIServer pid={os.getpid()}) INFO Starting vLLM API server 0 on http://{config.host}:{config.port}",
                  flush=True)  # fmt: skip
            await server.serve()
            stop.set()

    asyncio.run(serve())
