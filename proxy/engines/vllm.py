"""vLLM (sources read: 0.33.0; run on the H200: 0.26.0).

- detect: ``GET /version`` answers ``{"version": "0.26.0"}`` (SGLang 0.5.17 answers 404 there).
- health: ``GET /health``: 200, 503 when the engine is dead; empty body. The HTTP server only listens once the
  engine is ready, so "starting" is "connection refused".
- state: ``/v1/models`` (served id, ``root``, ``max_model_len``), ``/version`` (the build), busy =
  ``vllm:num_requests_running`` summed over engines on ``/metrics``. No ``/server_info`` outside dev mode (404
  on 0.26.0), and nothing reports ``max_num_seqs``: slots stay unknown. No dtype or quantization either.
- tokens: ``POST /tokenize`` with ``{"model","messages","add_generation_prompt":true}`` ->
  ``{"count","max_model_len","tokens"}``.
- cache: ``POST /reset_prefix_cache`` exists only with ``VLLM_SERVER_DEV_MODE=1`` (else 404).
- stream: the last content chunk carries ``finish_reason`` (no separate finish chunk); ``proxy.stream`` reads
  it wherever it comes.
- errors: nested ``{"error":{"message","type","param","code"}}`` (a context overflow: 400, ``param``
  ``"input_tokens"``); releases before the 2025 protocol split sent the flat SGLang-like shape, nested here.
- launch: ``vllm serve MODEL`` or ``python -m vllm.entrypoints.openai.api_server``; ``--host`` (default: all
  addresses, reached on 127.0.0.1), ``--port`` (default 8000); ready when ``/health`` and ``/v1/models`` both
  answer 200 (the HTTP server listens only once the engine is up).
- log (0.26.0, docs/gpu-results/three-engines/logs/engines/vllm.log): ``non-default args: {..,
  'gpu_memory_utilization': 0.192, ..}``, ``Model loading took 13.49 GiB and 2.650973 seconds``, ``Available KV
  cache memory: 12.25 GiB``, ``GPU KV cache size: 100,352 tokens``, ``Maximum concurrency for 8,192 tokens per
  request: 12.25x``, ``Cudagraph is disabled under eager mode``; with graphs, ``Graph capturing finished in 9
  secs, took 0.52 GiB`` (``gpu_model_runner.py``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from typing import Any

import httpx

from proxy.engines.base import (
    Dialect,
    Facts,
    Message,
    PollError,
    TokenCount,
    as_int,
    as_str,
    get_json,
    metrics_busy,
    model_card,
    short,
)
from proxy.engines.startup import LogFacts, clean_lines, has_flag, python_module, size_bytes, subcommand

_RUNNING = re.compile(r"^vllm:num_requests_running(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.M)
_FRACTION = re.compile(r"'gpu_memory_utilization': ([0-9.]+)")
_LOADING = re.compile(r"Model loading took ([0-9.]+) (GiB|MiB|GB) (?:memory )?and ([0-9.]+) seconds")
_KV_MEM = re.compile(r"Available KV cache memory: ([0-9.]+) (GiB|MiB)")
_KV_TOKENS = re.compile(r"GPU KV cache size: ([0-9,]+) tokens")
_CONCURRENCY = re.compile(r"Maximum concurrency for ([0-9,]+) tokens per request")
_GRAPHS = re.compile(r"Graph capturing finished in ([0-9.]+) secs?, took ([0-9.]+) (GiB|MiB)")
_EAGER = re.compile(r"Cudagraph is disabled|Enforce eager set|enforce_eager=True")


class Vllm(Dialect):
    kind = "vllm"
    health_path = "/health"
    detect_paths = ("/version",)
    ready_paths = ("/health", "/v1/models")
    default_port = 8000
    # the whole process's share of the GPU, KV cache sized to fill it (vLLM's default 0.9)
    memory_share_flag = "--gpu-memory-utilization"
    memory_share_default = 0.9
    # the share bounds the whole instance (weights, activations, graphs, KV cache); the CUDA context is outside it
    memory_reserve = (1 << 30, 0.0)

    def launched_by(self, argv: Sequence[str]) -> bool:
        return python_module(argv) == "vllm.entrypoints.openai.api_server" or subcommand(argv) == ("vllm", "serve")

    def memory_share(self, argv: Sequence[str]) -> tuple[str, float] | None:
        # --kv-cache-memory sizes the KV cache in bytes and overrides the share
        return None if has_flag(argv, "--kv-cache-memory") else super().memory_share(argv)

    def parse_log(self, text: str) -> LogFacts:
        ev: dict[str, str] = {}
        found: dict[str, Any] = {}
        for line in clean_lines(text):
            if (m := _FRACTION.search(line)) and "non-default args" in line:
                found["memory_fraction"], ev["memory_fraction"] = (
                    float(m[1]),
                    f"non-default args: gpu_memory_utilization={m[1]}",
                )
            elif m := _LOADING.search(line):
                found["weights_bytes"], found["load_s"] = size_bytes(m[1], m[2]), float(m[3])
                ev["weights_bytes"] = ev["load_s"] = line
            elif m := _KV_MEM.search(line):
                found["kv_cache_bytes"], ev["kv_cache_bytes"] = size_bytes(m[1], m[2]), line
            elif m := _KV_TOKENS.search(line):
                found["kv_cache_tokens"], ev["kv_cache_tokens"] = int(m[1].replace(",", "")), line
            elif m := _CONCURRENCY.search(line):
                found["context_per_slot"] = int(m[1].replace(",", ""))
            elif m := _GRAPHS.search(line):
                found.update(cuda_graphs="on", graph_capture_s=float(m[1]), graph_bytes=size_bytes(m[2], m[3]))
                ev["cuda_graphs"] = line
            elif _EAGER.search(line) and "cuda_graphs" not in found:
                found["cuda_graphs"], ev["cuda_graphs"] = "off", line
        return LogFacts(**found, evidence=ev)

    async def startup(self, client: httpx.AsyncClient, timeout: float) -> LogFacts:
        try:
            r = await client.get("/metrics", timeout=timeout)
        except httpx.HTTPError:
            return LogFacts()
        m = _CACHE_INFO.search(r.text) if r.status_code == 200 else None
        if m is None:
            return LogFacts()
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        found: dict[str, Any] = {}
        ev: dict[str, str] = {}
        with contextlib.suppress(ValueError, KeyError):
            found["memory_fraction"] = float(labels["gpu_memory_utilization"])
            ev["memory_fraction"] = "/metrics vllm:cache_config_info gpu_memory_utilization"
        with contextlib.suppress(ValueError, KeyError):
            found["kv_cache_tokens"] = int(labels["kv_cache_size_tokens"])
            ev["kv_cache_tokens"] = "/metrics vllm:cache_config_info kv_cache_size_tokens"
        dtype = labels.get("cache_dtype")
        if dtype and dtype != "auto":
            found["kv_cache_type"] = dtype
        return LogFacts(**found, evidence=ev)

    def is_mine(self, path: str, r: httpx.Response) -> bool:
        try:
            doc = r.json()
        except ValueError:
            return False
        return isinstance(doc, dict) and "version" in doc

    async def poll(self, client: httpx.AsyncClient, timeout: float) -> Facts:
        card = model_card(await get_json(client, "/v1/models", timeout))
        build = None
        with contextlib.suppress(PollError, httpx.HTTPError):
            v = await get_json(client, "/version", timeout)
            build = as_str(v.get("version")) if isinstance(v, dict) else None
        busy = None
        with contextlib.suppress(httpx.HTTPError):
            r = await client.get("/metrics", timeout=timeout)
            found = _RUNNING.findall(r.text) if r.status_code == 200 else []
            busy = round(sum(float(x) for x in found)) if found else None
        return Facts(
            model=as_str(card.get("id")),
            model_path=as_str(card.get("root")),
            context_length=as_int(card.get("max_model_len")),
            busy_slots=busy,
            build=build,
        )

    async def busy(self, client: httpx.AsyncClient, timeout: float) -> int | None:
        return await metrics_busy(client, ("vllm:num_requests_running", "vllm:num_requests_waiting"), timeout)

    async def count_prompt_tokens(
        self, client: httpx.AsyncClient, model: str | None, messages: Sequence[Message]
    ) -> TokenCount:
        body = {"model": model, "messages": [dict(m) for m in messages], "add_generation_prompt": True}
        try:
            r = await client.post("/tokenize", json=body)
            if r.status_code != 200:
                return TokenCount(None, f"tokenize HTTP {r.status_code}")
            return TokenCount(int(r.json()["count"]), "tokenize")
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            return TokenCount(None, short(exc, 120))

    async def flush_cache(self, client: httpx.AsyncClient) -> str | None:
        try:
            r = await client.post("/reset_prefix_cache", timeout=30)
        except httpx.HTTPError as exc:
            return f"reset_prefix_cache failed: {type(exc).__name__}"
        if r.status_code == 404:
            return "reset_prefix_cache HTTP 404 (needs VLLM_SERVER_DEV_MODE=1)"
        return f"reset_prefix_cache HTTP {r.status_code}"


DIALECT = Vllm()
