"""SGLang (sources read: 0.5.23; run on the H200: 0.5.17, captured in tests/fixtures/engines/sglang-0.5.17/; the
emulator in ``fakes/sglang_emulator/``).

- detect: ``GET /server_info`` (older builds: ``/get_server_info``) answers a JSON object of server args (vLLM's
  dev-mode ``/server_info`` answers ``{"vllm_config": ..}`` instead and is not SGLang).
- health: ``GET /ready`` (cheap, 200/503) where it exists. SGLang 0.5.17 has no ``/ready`` (404; it came in a
  later release): then ``GET /health``, which answers 503 while the server starts and warms up and otherwise
  runs a 1-token generation, answering 200 at its first scheduler output (at least 1 s: it polls each second),
  so it gets a longer timeout. A 404 from ``/ready`` never makes the engine "down".
- state: ``/server_info`` — every server argument at the top level as given on the command line
  (``max_running_requests`` is ``null`` unless set), ``context_length``, ``quantization``, ``dtype``,
  ``model_path``, ``served_model_name``, plus ``status``, ``max_total_num_tokens`` (KV pool),
  ``max_req_input_len`` and ``version``; ``internal_states`` (one per DP rank: the scheduler's copy of the args
  plus ``memory_usage``, ``last_gen_throughput`` and, in 0.5.17, ``effective_max_running_requests_per_dp`` —
  4096 on the H200; newer releases add load such as ``running_batch_size``); ``/model_info`` (older:
  ``/get_model_info``); ``/v1/models`` (``max_model_len``). Slots: the effective value summed over the DP
  ranks, else ``max_running_requests`` of the internal states or of the top level (set on the command line).
  Busy: from the internal states, else ``sglang:num_running_reqs`` on ``/metrics`` (``--enable-metrics``;
  0.5.17 refreshes it with the scheduler's periodic stats, so it lags). ``/version`` is 404 in 0.5.17.
- tokens: ``POST /v1/tokenize`` with ``{"model","messages"}`` (0.5.17 and 0.5.23 accept ``messages``;
  older builds only ``prompt``) -> ``{"tokens","count","max_model_len"}``.
- cache: ``POST /flush_cache``: 200 flushed; 400 when requests are running or waiting (nothing done).
- errors: flat ``{"object":"error","message","type","param","code"}`` on chat/completions (stream and
  non-stream; a context overflow is HTTP 400 ``BadRequestError``) -> nested the OpenAI way.
- launch: ``python -m sglang.launch_server`` or ``sglang serve``; ``--host`` (default 127.0.0.1), ``--port``
  (default 30000); ready when ``/health`` answers 200 — 503 until its warm-up generation is done.
- log (0.5.17, docs/gpu-results/three-engines/logs/engines/sglang.log): ``server_args=ServerArgs(...,
  mem_fraction_static=0.192, ..., disable_cuda_graph=True, ...)``, ``Load weight end. elapsed=0.34 s, ...,
  mem usage=13.51 GB.``, ``KV Cache is allocated. dtype: torch.float16, #tokens: 107716, K size: 6.57 GB, V
  size: 6.57 GB``, ``max_total_num_tokens=107716, ..., max_running_requests=4096, context_len=8192, ...``,
  ``Capture cuda graph end. Time elapsed: 3.70 s. mem usage=0.55 GB. ...`` (one per captured phase), and
  ``Engine startup timings (s): load_weight=.., cuda_graph={prefill=.., decode=.., ...}``. GB here is GiB
  (SGLang divides by 1 << 30).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Sequence
from pathlib import PurePath
from typing import Any

import httpx

from proxy.engines.base import (
    Dialect,
    Facts,
    Health,
    Message,
    PollError,
    TokenCount,
    as_dict,
    as_int,
    as_str,
    first_json,
    get_health,
    get_json,
    health_of,
    metrics_busy,
    model_card,
    short,
)
from proxy.engines.quant import quant_from_name
from proxy.engines.startup import LogFacts, clean_lines, python_module, size_bytes, subcommand

#: SGLang's /health waits for a scheduler output, checking once a second (SGLANG_HEALTH_CHECK_TIMEOUT: 20 s)
HEALTH_GENERATE_TIMEOUT_S = 5.0
_RUNNING = re.compile(r"^sglang:num_running_reqs(?:\{[^}]*\})?\s+([0-9.eE+-]+)", re.M)
_ARG = r"[(,] ?{}=([^,)]*)"
_WEIGHTS = re.compile(r"Load weight end\. elapsed=([0-9.]+) s.*mem usage=([0-9.]+) (GB|MB)")
_KV = re.compile(
    r"KV Cache is allocated\. dtype: (\S+), #tokens: (\d+), K size: ([0-9.]+) (GB|MB), V size: ([0-9.]+) (GB|MB)"
)
_POOL = re.compile(r"max_total_num_tokens=(\d+).*?max_running_requests=(\d+), context_len=(\d+)")
_CAPTURE = re.compile(
    r"Capture (?:\w+ )?(?:cuda|CUDA) graph.*? end\. Time elapsed: ([0-9.]+) s.*?mem usage=([0-9.]+) (GB|MB)"
)
_TIMINGS = re.compile(r"Engine startup timings \(s\):.*cuda_graph=\{([^}]*)\}")


def _server_arg(line: str, name: str) -> str | None:
    m = re.search(_ARG.format(re.escape(name)), line)
    return m.group(1).strip("'\"") if m else None


def _dtype(v: object) -> str | None:
    s = as_str(v)
    return None if s is None or s == "auto" else s


def _quantization(info: dict[str, Any], model_path: str | None) -> str | None:
    """SGLang's ``quantization``, else its ``dtype``. A GGUF model path sets ``quantization`` (and
    ``load_format``) to ``gguf``: that names the file format, not the precision, so the precision is the one
    the file's name carries (``…-Q4_K_M.gguf``), or unknown (never ``gguf``, which matches no other engine)."""
    q = as_str(info.get("quantization"))
    if q is not None and q.lower() == "gguf":
        return quant_from_name(PurePath(model_path or "").name)
    return q or _dtype(info.get("dtype"))


class SGLang(Dialect):
    kind = "sglang"
    health_path = "/ready"
    detect_paths = ("/server_info", "/get_server_info")
    ready_paths = ("/health",)
    default_port = 30000
    # static memory: weights, KV pool and CUDA graphs; without the flag SGLang picks it from the GPU's size
    memory_share_flag = "--mem-fraction-static"
    # outside the static share: the CUDA context, graph buffers and activations. Measured on the H200 (27B bf16
    # and FP8, CUDA graphs to batch 64): 4.2 GiB over 0.484 x 140.4 GiB; a 7B at 0.192 stayed under its share
    memory_reserve = (2 << 30, 0.06)

    def launched_by(self, argv: Sequence[str]) -> bool:
        return python_module(argv) == "sglang.launch_server" or subcommand(argv) == ("sglang", "serve")

    def parse_log(self, text: str) -> LogFacts:
        ev: dict[str, str] = {}
        found: dict[str, Any] = {}
        capture_s = 0.0
        capture_b = 0
        captured = False
        for line in clean_lines(text):
            if "server_args=ServerArgs(" in line:
                frac = _server_arg(line, "mem_fraction_static")
                if frac not in (None, "None"):
                    found["memory_fraction"], ev["memory_fraction"] = (
                        float(frac),
                        f"server_args: mem_fraction_static={frac}",
                    )
                if _server_arg(line, "disable_cuda_graph") == "True":
                    found["cuda_graphs"], ev["cuda_graphs"] = "off", "server_args: disable_cuda_graph=True"
            elif m := _WEIGHTS.search(line):
                found["load_s"], found["weights_bytes"] = float(m[1]), size_bytes(m[2], m[3])
                ev["load_s"] = ev["weights_bytes"] = line
            elif m := _KV.search(line):
                found["kv_cache_type"] = m[1].removeprefix("torch.")
                found["kv_cache_tokens"] = int(m[2])
                found["kv_cache_bytes"] = size_bytes(m[3], m[4]) + size_bytes(m[5], m[6])
                ev["kv_cache_bytes"] = line
            elif m := _POOL.search(line):
                found["kv_cache_tokens"], found["slots"], found["context_per_slot"] = int(m[1]), int(m[2]), int(m[3])
                ev["kv_cache_tokens"] = ev["slots"] = line
            elif m := _CAPTURE.search(line):
                captured = True
                capture_s += float(m[1])
                capture_b += size_bytes(m[2], m[3])
                ev["cuda_graphs"] = (ev["cuda_graphs"] + "\n" if "cuda_graphs" in ev else "") + line
            elif (m := _TIMINGS.search(line)) and not captured:
                phases = {k.strip(): float(v) for k, _, v in (p.partition("=") for p in m[1].split(",")) if v}
                if any(v > 0 for v in phases.values()):
                    captured, capture_s = True, sum(phases.values())
                    ev["cuda_graphs"] = line
        if captured:
            found.update(cuda_graphs="on", graph_capture_s=round(capture_s, 3))
            if capture_b:
                found["graph_bytes"] = capture_b
        return LogFacts(**found, evidence=ev)

    async def startup(self, client: httpx.AsyncClient, timeout: float) -> LogFacts:
        try:
            info = await first_json(client, self.detect_paths, timeout)
        except (PollError, httpx.HTTPError):
            return LogFacts()
        if not isinstance(info, dict):
            return LogFacts()
        states = [s for s in info.get("internal_states") or () if isinstance(s, dict)]
        first = states[0] if states else {}
        usage = as_dict(first.get("memory_usage"))
        timings = as_dict(first.get("startup_time")) or as_dict(info.get("startup_time"))
        graph_s = as_dict(timings.get("cuda_graph"))
        graph_gb = as_dict(usage.get("graph"))
        found: dict[str, Any] = {}
        ev: dict[str, str] = {}

        def gib(v: object) -> int | None:  # SGLang's "GB" is 1 << 30 bytes
            return round(float(v) * 2**30) if isinstance(v, int | float) and not isinstance(v, bool) else None

        for key, value, where in (
            ("memory_fraction", info.get("mem_fraction_static"), "/server_info mem_fraction_static"),
            ("kv_cache_tokens", as_int(info.get("max_total_num_tokens")), "/server_info max_total_num_tokens"),
            ("kv_cache_bytes", gib(usage.get("kvcache")), "/server_info internal_states[0].memory_usage.kvcache"),
            ("weights_bytes", gib(usage.get("weight")), "/server_info internal_states[0].memory_usage.weight"),
            ("load_s", timings.get("load_weight"), "/server_info startup_time.load_weight"),
            ("slots", self._slots(info, states), "/server_info effective max running requests"),
            ("context_per_slot", as_int(info.get("context_length")), "/server_info context_length"),
        ):
            if value is not None:
                found[key], ev[key] = value, where
        kv_dtype = as_str(info.get("kv_cache_dtype"))
        if kv_dtype and kv_dtype != "auto":
            found["kv_cache_type"] = kv_dtype
        if info.get("disable_cuda_graph") is True:
            found["cuda_graphs"], ev["cuda_graphs"] = "off", "/server_info disable_cuda_graph: true"
        elif graph_s:
            found["cuda_graphs"], ev["cuda_graphs"] = "on", "/server_info startup_time.cuda_graph"
            found["graph_capture_s"] = round(sum(v for v in graph_s.values() if isinstance(v, int | float)), 3)
            graph_bytes = sum(gib(v) or 0 for v in graph_gb.values())
            if graph_bytes:
                found["graph_bytes"] = graph_bytes
        return LogFacts(**found, evidence=ev)

    def is_mine(self, path: str, r: httpx.Response) -> bool:
        try:
            doc = r.json()
        except ValueError:
            return False
        return isinstance(doc, dict) and "vllm_config" not in doc

    async def health(self, client: httpx.AsyncClient, timeout: float) -> Health:
        got = await get_health(client, "/ready", timeout)
        if isinstance(got, Health):
            return got
        if got.status_code != 404:
            return health_of(got, "/ready")
        # no /ready in this version: /health is its readiness (503 while starting and warming up)
        got = await get_health(client, "/health", max(timeout, HEALTH_GENERATE_TIMEOUT_S))
        return got if isinstance(got, Health) else health_of(got, "/health")

    async def poll(self, client: httpx.AsyncClient, timeout: float) -> Facts:
        info = await first_json(client, self.detect_paths, timeout)
        if not isinstance(info, dict):
            raise PollError("/server_info is not an object")
        minfo: dict[str, Any] = {}
        with contextlib.suppress(PollError, httpx.HTTPError):
            minfo = as_dict(await first_json(client, ("/model_info", "/get_model_info"), timeout))
        card: dict[str, Any] = {}
        with contextlib.suppress(PollError, httpx.HTTPError):
            card = model_card(await get_json(client, "/v1/models", timeout))
        states = [s for s in info.get("internal_states") or () if isinstance(s, dict)]
        served = info.get("served_model_name")
        if isinstance(served, list):
            served = served[0] if served else None
        busy = self._busy(states)
        if busy is None:
            busy = await self._busy_from_metrics(client, timeout)
        path = as_str(minfo.get("model_path")) or as_str(info.get("model_path"))
        return Facts(
            model=as_str(card.get("id")) or as_str(minfo.get("served_model_name")) or as_str(served),
            model_path=path,
            context_length=as_int(card.get("max_model_len")) or as_int(info.get("context_length")),
            slots=self._slots(info, states),
            busy_slots=busy,
            quantization=_quantization(info, path),
            build=as_str(info.get("version")),
            weights_format="gguf"
            if "gguf" in {str(info.get(k) or "").lower() for k in ("quantization", "load_format")}
            else "dummy"
            if str(info.get("load_format") or "").lower() == "dummy"
            else None,
            memory_share=float(info["mem_fraction_static"])
            if isinstance(info.get("mem_fraction_static"), int | float)
            else None,
            kv_pool_tokens=as_int(info.get("max_total_num_tokens"))
            or as_int(as_dict((states[:1] or [{}])[0].get("memory_usage")).get("token_capacity")),
        )

    @staticmethod
    def _slots(info: dict[str, Any], states: list[dict[str, Any]]) -> int | None:
        # the scheduler's effective value first (per DP rank: one internal state each), then a resolved or
        # command-line max_running_requests (0.5.17 reports the command line's, null when not given)
        effective = [as_int(s.get("effective_max_running_requests_per_dp")) for s in states]
        if effective and all(effective):
            return sum(n for n in effective if n)
        for src in (*states[:1], info, as_dict(info.get("server_args"))):
            n = as_int(src.get("max_running_requests"))
            if n:
                return n
        return None

    @staticmethod
    def _busy(states: list[dict[str, Any]]) -> int | None:
        counts = [as_int(s.get("num_running_reqs", s.get("running_batch_size"))) for s in states]
        known = [n for n in counts if n is not None]
        return sum(known) if known else None

    @staticmethod
    async def _busy_from_metrics(client: httpx.AsyncClient, timeout: float) -> int | None:
        with contextlib.suppress(httpx.HTTPError):
            r = await client.get("/metrics", timeout=timeout)
            found = _RUNNING.findall(r.text) if r.status_code == 200 else []
            return round(sum(float(x) for x in found)) if found else None
        return None

    async def busy(self, client: httpx.AsyncClient, timeout: float) -> int | None:
        # the scheduler's periodic stats (0.5.17: refreshed every few seconds, so it lags the truth)
        return await metrics_busy(client, ("sglang:num_running_reqs", "sglang:num_queue_reqs"), timeout)

    async def count_prompt_tokens(
        self, client: httpx.AsyncClient, model: str | None, messages: Sequence[Message]
    ) -> TokenCount:
        try:
            r = await client.post("/v1/tokenize", json={"model": model, "messages": [dict(m) for m in messages]})
            if r.status_code != 200:
                return TokenCount(None, f"v1/tokenize HTTP {r.status_code}")
            doc = r.json()
            n = as_int(doc.get("count"))
            return TokenCount(n if n is not None else len(doc["tokens"]), "v1/tokenize")
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            return TokenCount(None, short(exc, 120))

    async def flush_cache(self, client: httpx.AsyncClient) -> str | None:
        try:
            r = await client.post("/flush_cache", timeout=30)
        except httpx.HTTPError as exc:
            return f"flush_cache failed: {type(exc).__name__}"
        return f"flush_cache HTTP {r.status_code}"


DIALECT = SGLang()
