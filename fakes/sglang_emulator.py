"""An SGLang 0.5.23 HTTP front end whose tokens come from a real llama.cpp ``llama-server``.

SGLang needs CUDA torch, so tests and benchmarks here talk to this emulator instead: SGLang's wire behaviour
(engines.md §2, checked against the 0.5.23 wheel's ``serving_chat.py``, ``serving_completions.py``,
``sse_utils.py``, ``protocol.py``, ``http_server.py``, ``tokenizer_manager.py``, ``scheduler.py`` and
``metrics_collector.py``) on top of real generation by the backend's native ``/completion`` stream, which
reports why generation stopped (EOS, stop word, limit) so ``matched_stop`` can be filled in.

Invariants kept from SGLang:
- HTTP headers go out only once the first token exists (the "kick-start"); validation failures, a too-long
  prompt and a ``:`` model name that is not the served name are therefore plain 400s even for streams.
- Chat stream: role chunk ``{"reasoning_content":null,"role":"assistant","content":""}`` right before the first
  content chunk, content chunks ``{"reasoning_content":null,"content":...}``, every choice carries
  ``logprobs``, ``finish_reason`` and ``matched_stop``, then a separate finish chunk, a usage chunk with
  ``choices:[]`` when asked for, and ``data: [DONE]`` always, also after an error chunk. No
  ``system_fingerprint``; ``id`` is a uuid4 hex; ``model`` echoes the request's.
- Errors are flat ``{"object":"error","message","type","param","code"}``. A full queue
  (``--max-queued-requests``) is a 503 for non-stream requests, and for streams an HTTP 200 whose first event
  is the error.
- Requests are not queued here; a request counts as waiting while more than ``max_running_requests`` (the
  backend's slot count by default) are in flight, and SGLang's rule ``waiting + 1 > max_queued_requests``
  rejects it. In-flight requests end when generation ends or the client goes away (which also stops the
  backend request).

Test hook: an ``x-fault`` request header is passed on to the backend, so a ``fakes.fault_engine``
backend can shape timing and failures.

    python -m fakes.sglang_emulator --port 30000 --backend http://127.0.0.1:8080 --served-model-name m
    app = create_app(EmulatorConfig(backend=...))                  # Starlette, lifespan probes the backend
    with run_in_thread(EmulatorConfig(backend=...)) as url: ...    # uvicorn on a free port in a thread
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import signal
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import Any, Final, TypeVar

import httpx
import uvicorn
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector, CollectorRegistry
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

__all__ = ["EmulatorConfig", "SGLangEmulator", "create_app", "main", "run_in_thread"]

_T = TypeVar("_T")

SGLANG_VERSION: Final = "0.5.23"
DEFAULT_MODEL_NAME: Final = "default"  # protocol.py: the request's `model` when it sends none
QUEUE_FULL: Final = "The request queue is full."
FLUSHED: Final = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)

# metrics_collector.py defaults
TTFT_BUCKETS: Final = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS: Final = (*TTFT_BUCKETS, 600, 1200, 1800, 2400)
ITL_BUCKETS: Final = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
    0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
THROUGHPUT_WINDOW_S: Final = 5.0


@dataclass(frozen=True, slots=True)
class EmulatorConfig:
    backend: str  # base URL of a llama-server (or a fault engine)
    served_model_name: str | None = None  # None: the model path, as SGLang does
    model_path: str | None = None  # None: the backend's /props model_path
    context_length: int | None = None  # None: the backend's per-slot n_ctx
    max_running_requests: int | None = None  # None: the backend's total_slots
    max_queued_requests: int | None = None  # None: no limit (SGLang's default)
    enable_metrics: bool = False
    enable_cache_report: bool = False
    stream_response_default_include_usage: bool = False
    ready_endpoint: bool = True  # False: no /ready (404), as SGLang 0.5.17, whose readiness is /health
    host: str = "127.0.0.1"  # reported by /server_info; run_in_thread binds it
    port: int = 30000
    backend_wait_s: float = 60.0  # how long startup waits for the backend's /health


# ----------------------------------------------------------------------------------------------------------
# errors


class _APIError(Exception):
    """An error answered before any stream starts, in SGLang's flat shape."""

    def __init__(self, message: str, type_: str = "BadRequestError", code: int = 400) -> None:
        super().__init__(message)
        self.message, self.type, self.code = message, type_, code

    def response(self) -> JSONResponse:
        return _error_response(self.message, self.type, self.code)


def _error_response(message: str, type_: str, code: int) -> JSONResponse:
    body = {"object": "error", "message": message, "type": type_, "param": None, "code": code}
    return JSONResponse(body, status_code=code)


def _validation_error(errors: list[dict[str, Any]]) -> _APIError:
    # http_server.py remaps FastAPI's 422 to 400 with type "Bad Request"
    return _APIError(str(errors), HTTPStatus.BAD_REQUEST.phrase, 400)


def _streaming_error(message: str, type_: str, code: int) -> str:
    # serving_base.create_streaming_error_response uses json.dumps (with its default spaces)
    error = {"object": "error", "message": message, "type": type_, "param": None, "code": code}
    return f"data: {json.dumps({'error': error})}\n\n"


# ----------------------------------------------------------------------------------------------------------
# request validation (a small stand-in for SGLang's pydantic models)

_INT = (int,)
_NUM = (int, float)
_FIELD_TYPES: Final[dict[str, tuple[type, ...]]] = {
    "model": (str,),
    "stream": (bool,),
    "temperature": _NUM,
    "top_p": _NUM,
    "top_k": _INT,
    "min_p": _NUM,
    "max_tokens": _INT,
    "max_completion_tokens": _INT,
    "n": _INT,
    "seed": _INT,
    "presence_penalty": _NUM,
    "frequency_penalty": _NUM,
    "repetition_penalty": _NUM,
    "ignore_eos": (bool,),
    "stream_options": (dict,),
    "stop": (str, list),
}


async def _read_body(request: Request, required: str | None) -> dict[str, Any]:
    content_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type != "application/json":
        raise _validation_error(
            [
                {
                    "loc": ["header", "content-type"],
                    "msg": "Unsupported Media Type: Only 'application/json' is allowed",
                    "type": "value_error",
                }
            ]
        )
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:
        raise _validation_error([{"type": "json_invalid", "loc": ("body", 0), "msg": "JSON decode error"}]) from None
    if not isinstance(body, dict):
        raise _validation_error(
            [{"type": "model_attributes_type", "loc": ("body",), "msg": "Input should be a valid dictionary"}]
        )
    errors: list[dict[str, Any]] = []
    if required is not None and required not in body:
        errors.append({"type": "missing", "loc": ("body", required), "msg": "Field required", "input": body})
    for key, types in _FIELD_TYPES.items():
        value = body.get(key)
        if value is None:
            continue
        bad_bool = isinstance(value, bool) and bool not in types
        if bad_bool or not isinstance(value, types):
            errors.append(
                {
                    "type": "type_error",
                    "loc": ("body", key),
                    "msg": f"Input should be {types[0].__name__}",
                    "input": value,
                }
            )
    if errors:
        raise _validation_error(errors)
    return body


# ----------------------------------------------------------------------------------------------------------
# metrics


class _Hist:
    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, labels: tuple[str, ...], value: float, count: int = 1) -> None:
        buckets, total = self.series.setdefault(labels, ([0] * (len(self.bounds) + 1), [0.0]))
        buckets[bisect.bisect_left(self.bounds, value)] += count
        total[0] += value * count

    def family(self, name: str, doc: str, labelnames: list[str]) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=labelnames)
        for labels, (buckets, total) in self.series.items():
            cumulative, acc = [], 0
            for bound, n in zip((*self.bounds, float("inf")), buckets, strict=True):
                acc += n
                cumulative.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(acc)))
            fam.add_metric(list(labels), cumulative, total[0])
        return fam


@dataclass(slots=True)
class _Counters:
    values: dict[tuple[str, ...], float] = field(default_factory=dict)

    def inc(self, labels: tuple[str, ...], value: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + value

    def family(self, name: str, doc: str, labelnames: list[str]) -> CounterMetricFamily:
        fam = CounterMetricFamily(name, doc, labels=labelnames)
        for labels, value in self.values.items():
            fam.add_metric(list(labels), value)
        return fam


class _Metrics(Collector):
    """SGLang's metric names, fed by the emulator's requests; rendered without ``_created`` series,
    as SGLang's multiprocess registry does."""

    def __init__(self, engine: SGLangEmulator) -> None:
        self.engine = engine
        self.ttft = _Hist(TTFT_BUCKETS)
        self.itl = _Hist(ITL_BUCKETS)
        self.tpot = _Hist(ITL_BUCKETS)
        self.e2e = _Hist(E2E_BUCKETS)
        self.prompt_tokens = _Counters()
        self.generation_tokens = _Counters()
        self.cached_tokens = _Counters()
        self.num_requests = _Counters()
        self.num_aborted = _Counters()
        self.recent_tokens: deque[tuple[float, int]] = deque()  # (monotonic s, new tokens)
        self.recent_finished: deque[tuple[float, int, int]] = deque()  # (monotonic s, prompt, cached)

    @property
    def base(self) -> tuple[str, str]:
        return (self.engine.served_model_name, "unified")

    def _trim(self, now: float) -> None:
        for q in (self.recent_tokens, self.recent_finished):
            while q and q[0][0] < now - THROUGHPUT_WINDOW_S:
                q.popleft()

    def on_tokens(self, n: int) -> None:
        now = time.monotonic()
        self.recent_tokens.append((now, n))
        self._trim(now)

    def on_finished(self, stream: bool, prompt: int, generated: int, cached: int, e2e_s: float) -> None:
        labels = (*self.base, "true" if stream else "false")
        self.prompt_tokens.inc(labels, prompt)
        self.generation_tokens.inc(labels, generated)
        self.num_requests.inc(labels)
        if cached > 0:
            self.cached_tokens.inc((*self.base, "total"), cached)
        self.e2e.observe(labels, e2e_s)
        self.recent_finished.append((time.monotonic(), prompt, cached))

    def collect(self) -> Iterator[Metric]:
        base = ["model_name", "engine_type"]
        stream = [*base, "is_streaming"]
        yield self.ttft.family(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", stream
        )
        yield self.itl.family(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", base
        )
        yield self.tpot.family(
            "sglang:request_time_per_output_token_seconds",
            "Per-request TPOT in seconds: (finished_time - first_token_time) / (completion_tokens - 1).",
            stream,
        )
        yield self.e2e.family(
            "sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds", stream
        )
        yield self.prompt_tokens.family("sglang:prompt_tokens", "Number of prefill tokens processed.", stream)
        yield self.generation_tokens.family(
            "sglang:generation_tokens", "Number of generation tokens processed.", stream
        )
        yield self.cached_tokens.family(
            "sglang:cached_tokens",
            "Number of cached prompt tokens by source (device/host/storage).",
            [*base, "cache_source"],
        )
        yield self.num_requests.family("sglang:num_requests", "Number of requests processed.", stream)
        yield self.num_aborted.family("sglang:num_aborted_requests", "Number of requests aborted.", base)
        yield from self._scheduler_gauges()

    def _scheduler_gauges(self) -> Iterator[Metric]:
        engine = self.engine
        now = time.monotonic()
        self._trim(now)
        labelnames = ["model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank"]
        labels = [*self.base, "0", "0", "0"]
        running = min(engine.inflight, engine.max_running_requests)
        prompt = sum(p for _, p, _ in self.recent_finished)
        cached = sum(c for _, _, c in self.recent_finished)
        max_total = engine.context_length * engine.max_running_requests
        values = {
            "num_running_reqs": ("The number of running requests.", running),
            "num_queue_reqs": ("The number of requests in the waiting queue.", engine.inflight - running),
            "gen_throughput": (
                "The generation throughput (token/s).",
                sum(n for _, n in self.recent_tokens) / THROUGHPUT_WINDOW_S,
            ),
            "cache_hit_rate": ("The prefix cache hit rate.", cached / prompt if prompt else 0.0),
            "token_usage": ("The token usage.", engine.live_tokens / max_total if max_total else 0.0),
            "num_used_tokens": ("The number of used tokens.", engine.live_tokens),
            "max_total_num_tokens": ("Maximum total number of tokens in the KV cache pool.", max_total),
            "context_len": ("The context length.", engine.context_length),
        }
        for name, (doc, value) in values.items():
            gauge = GaugeMetricFamily(f"sglang:{name}", doc, labels=labelnames)
            gauge.add_metric(labels, float(value))
            yield gauge


# ----------------------------------------------------------------------------------------------------------
# generation


@dataclass(slots=True)
class _Output:
    """One engine output, like the dicts SGLang's tokenizer manager yields."""

    text: str  # new text since the previous output
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int = 0
    finish: dict[str, Any] | None = None  # {"type": "stop"|"length"|"abort", "matched"?, "status_code"?, "message"?}

    @property
    def aborted_with_status(self) -> bool:
        return self.finish is not None and self.finish["type"] == "abort" and "status_code" in self.finish


@dataclass(slots=True)
class _Job:
    input_ids: list[int]
    backend_body: dict[str, Any]
    max_new_tokens: int | None
    stream: bool
    fault: str | None
    t_received: float = field(default_factory=time.perf_counter)
    t_first: float | None = None
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)


def _abort(code: HTTPStatus, message: str, prompt_tokens: int, completion_tokens: int = 0) -> _Output:
    finish = {"type": "abort", "status_code": code, "message": message}
    return _Output("", completion_tokens, prompt_tokens, finish=finish)


class _ShardedTransport(httpx.AsyncBaseTransport):
    """Round-robin over small connection pools: httpcore scans its whole pool for every request, which
    costs seconds of TTFT at a few hundred concurrent streams in one pool."""

    def __init__(self, shards: int = 16, per_shard: int = 64) -> None:
        limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        self._shards = [httpx.AsyncHTTPTransport(limits=limits) for _ in range(shards)]
        self._next = itertools.count()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        shard = self._shards[next(self._next) % len(self._shards)]
        return await shard.handle_async_request(request)

    async def aclose(self) -> None:
        for shard in self._shards:
            await shard.aclose()


class SGLangEmulator:
    """Backend connection and live state; one per app, built in the lifespan."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.client: httpx.AsyncClient | None = None
        self.served_model_name = config.served_model_name or config.model_path or DEFAULT_MODEL_NAME
        self.model_path = config.model_path or self.served_model_name
        self.context_length = config.context_length or 0
        self.max_running_requests = config.max_running_requests or 1
        self.eos_token_id: int | None = None
        self.inflight = 0
        self.live_tokens = 0
        self.startup_time = time.time()
        self.metrics = _Metrics(self) if config.enable_metrics else None
        self.registry: CollectorRegistry | None = None
        if self.metrics is not None:
            self.registry = CollectorRegistry(auto_describe=False)
            self.registry.register(self.metrics)

    @property
    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            raise RuntimeError("the emulator's lifespan has not started")
        return self.client

    async def start(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.client = httpx.AsyncClient(
            base_url=self.config.backend,
            transport=transport if transport is not None else _ShardedTransport(),
            timeout=httpx.Timeout(connect=10.0, read=None, write=30.0, pool=None),
        )
        deadline = time.monotonic() + self.config.backend_wait_s
        while True:
            try:
                if (await self.http.get("/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"backend {self.config.backend} not healthy within {self.config.backend_wait_s}s")
            await asyncio.sleep(0.1)
        props = (await self.http.get("/props")).json()
        backend_path = str(props.get("model_path") or "")
        if self.config.model_path is None and backend_path:
            self.model_path = backend_path
            if self.config.served_model_name is None:
                self.served_model_name = backend_path
        settings = props.get("default_generation_settings") or {}
        self.context_length = self.config.context_length or int(settings.get("n_ctx") or 4096)
        self.max_running_requests = self.config.max_running_requests or int(props.get("total_slots") or 1)
        eos = props.get("eos_token")
        if isinstance(eos, str) and eos:
            tokens = (await self.http.post("/tokenize", json={"content": eos, "parse_special": True})).json()
            ids = tokens.get("tokens") or []
            self.eos_token_id = ids[0] if len(ids) == 1 and isinstance(ids[0], int) else None

    async def stop(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    # -- tokenization ------------------------------------------------------------------------------------

    async def render_chat(self, body: Mapping[str, Any]) -> str:
        payload: dict[str, Any] = {"messages": body["messages"]}
        for key in ("tools", "chat_template_kwargs", "add_generation_prompt", "continue_final_message"):
            if body.get(key) is not None:
                payload[key] = body[key]
        resp = await self.http.post("/apply-template", json=payload)
        if resp.status_code != 200:
            raise _APIError(_backend_message(resp), "BadRequest", 400)
        return str(resp.json()["prompt"])

    async def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        body = {"content": text, "add_special": add_special, "parse_special": True}
        resp = await self.http.post("/tokenize", json=body)
        if resp.status_code != 200:
            raise _APIError(_backend_message(resp), "BadRequest", 400)
        return [int(t) for t in resp.json()["tokens"]]

    # -- validation (tokenizer_manager._validate_one_request, serving_base._parse_model_parameter) -------

    def check_model(self, model: str) -> None:
        if ":" not in model or model == self.served_model_name:
            return
        if model.startswith(f"{self.served_model_name}:"):
            adapter = model[len(self.served_model_name) + 1 :].strip()
        else:
            adapter = model.split(":", 1)[1].strip()
        if adapter:
            raise _APIError(
                f"LoRA adapter '{adapter}' was requested, but LoRA is not enabled. "
                "Please launch the server with --enable-lora flag and preload adapters "
                "using --lora-paths or /load_lora_adapter endpoint."
            )

    def check_length(self, input_ids: list[int]) -> None:
        if len(input_ids) >= self.context_length:
            raise _APIError(
                f"The input ({len(input_ids)} tokens) is longer than the "
                f"model's context length ({self.context_length} tokens)."
            )

    def job(self, body: Mapping[str, Any], input_ids: list[int], fault: str | None) -> _Job:
        max_new = body.get("max_completion_tokens") or body.get("max_tokens")
        room = self.context_length - len(input_ids)  # the scheduler caps max_new_tokens to the context
        n_predict = room if max_new is None else min(int(max_new), room)
        top_k = body.get("top_k")
        stop = body.get("stop")
        backend: dict[str, Any] = {
            "prompt": input_ids,
            "stream": True,
            "n_predict": n_predict,
            # SGLang's defaults (protocol.py _DEFAULT_SAMPLING_PARAMS), sent explicitly: llama.cpp's differ
            "temperature": _or(body.get("temperature"), 1.0),
            "top_p": _or(body.get("top_p"), 1.0),
            "top_k": 0 if top_k is None or top_k < 0 else top_k,
            "min_p": _or(body.get("min_p"), 0.0),
            "presence_penalty": _or(body.get("presence_penalty"), 0.0),
            "frequency_penalty": _or(body.get("frequency_penalty"), 0.0),
            "cache_prompt": True,
        }
        rep = body.get("repetition_penalty")
        if rep is not None and rep != 1.0:
            # closest llama.cpp analogue; SGLang's penalty spans prompt and output, so use the whole context
            backend.update(repeat_penalty=rep, repeat_last_n=-1)
        if body.get("seed") is not None:
            backend["seed"] = body["seed"]
        if stop:
            backend["stop"] = [stop] if isinstance(stop, str) else list(stop)
        if body.get("ignore_eos"):
            backend["ignore_eos"] = True
        return _Job(input_ids, backend, None if max_new is None else int(max_new), bool(body.get("stream")), fault)

    def admit(self) -> bool:
        """SGLang's _abort_on_queued_limit: reject when the waiting queue would exceed the limit."""
        limit = self.config.max_queued_requests
        if limit is None:
            return True
        waiting = max(0, self.inflight - self.max_running_requests)
        return waiting + 1 <= limit

    # -- the engine loop ---------------------------------------------------------------------------------

    async def iter_outputs(self, job: _Job) -> AsyncGenerator[_Output, None]:
        """Engine outputs for one request; ends with an output that has ``finish`` set."""
        prompt_n = len(job.input_ids)
        if not self.admit():
            if self.metrics is not None:
                self.metrics.num_aborted.inc(self.metrics.base)
            yield _abort(HTTPStatus.SERVICE_UNAVAILABLE, QUEUE_FULL, prompt_n)
            return
        self.inflight += 1
        self.live_tokens += prompt_n
        generated = 0
        t_last: float | None = None
        headers = {"x-fault": job.fault} if job.fault else None
        try:
            async with self.http.stream("POST", "/completion", json=job.backend_body, headers=headers) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    yield self._failed(_backend_message(resp), prompt_n, generated)
                    return
                pending: _Output | None = None  # a last-token output waiting for the final event
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    try:
                        data = json.loads(line[6:])
                    except ValueError:
                        yield self._failed(f"malformed backend event: {line[:80]!r}", prompt_n, generated)
                        return
                    if "error" in data:
                        yield self._failed(str(data["error"].get("message", data["error"])), prompt_n, generated)
                        return
                    n = int(data.get("tokens_predicted", generated))
                    new_tokens, generated = max(n - generated, 0), max(n, generated)
                    self.live_tokens += new_tokens
                    now = time.perf_counter()
                    self._observe_tokens(job, new_tokens, t_last, now)
                    t_last = now if new_tokens else t_last
                    if not data.get("stop"):
                        out = _Output(str(data.get("content", "")), generated, prompt_n)
                        if job.max_new_tokens is not None and generated >= job.max_new_tokens:
                            pending = out  # SGLang puts finish_reason "length" on the last token's output
                            continue
                        yield out
                        continue
                    cached = int((data.get("timings") or {}).get("cache_n", 0))
                    finish = self._finish(data, generated)
                    self._observe_finished(job, prompt_n, generated, cached)
                    if pending is not None and not data.get("content") and finish["type"] == "length":
                        pending.finish, pending.cached_tokens = finish, cached
                        yield pending
                    else:
                        if pending is not None:
                            yield pending
                        yield _Output(str(data.get("content", "")), generated, prompt_n, cached, finish)
                    return
                yield self._failed("backend stream ended before the final event", prompt_n, generated)
        except httpx.HTTPError as exc:
            yield self._failed(f"backend error: {exc!r}", prompt_n, generated)
        finally:
            self.inflight -= 1
            self.live_tokens -= prompt_n + generated

    def _finish(self, final: Mapping[str, Any], generated: int) -> dict[str, Any]:
        stop_type = final.get("stop_type")
        if stop_type == "word":
            return {"type": "stop", "matched": str(final.get("stopping_word", ""))}
        if stop_type == "eos":
            return {"type": "stop", "matched": self.eos_token_id}
        return {"type": "length", "length": generated}

    def _failed(self, message: str, prompt_n: int, generated: int) -> _Output:
        if self.metrics is not None:
            self.metrics.num_aborted.inc(self.metrics.base)
        return _abort(HTTPStatus.INTERNAL_SERVER_ERROR, message, prompt_n, generated)

    def _observe_tokens(self, job: _Job, new_tokens: int, t_last: float | None, now: float) -> None:
        m = self.metrics
        if m is None or new_tokens <= 0:
            return
        m.on_tokens(new_tokens)
        if t_last is None:
            m.ttft.observe((*m.base, "true" if job.stream else "false"), now - job.t_received)
            job.t_first = now
        else:
            # SGLang spreads a batch interval over its tokens, one observation per token
            m.itl.observe(m.base, (now - t_last) / new_tokens, new_tokens)

    def _observe_finished(self, job: _Job, prompt_n: int, generated: int, cached: int) -> None:
        m = self.metrics
        if m is None:
            return
        now = time.perf_counter()
        m.on_finished(job.stream, prompt_n, generated, cached, now - job.t_received)
        if job.t_first is not None and generated > 1:
            m.tpot.observe((*m.base, "true" if job.stream else "false"), (now - job.t_first) / (generated - 1))


async def _unless_disconnected(request: Request, awaitable: Awaitable[_T]) -> _T | None:
    """The awaitable's result, or None (having cancelled it) if the client goes away first."""

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watch):
            if not task.done():
                task.cancel()
        await asyncio.gather(work, watch, return_exceptions=True)
    if work.cancelled() or not work.done():
        return None
    return work.result()


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


def _backend_message(resp: httpx.Response) -> str:
    try:
        body = resp.json()
    except ValueError:
        return f"backend HTTP {resp.status_code}"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return f"backend HTTP {resp.status_code}: {body}"


# ----------------------------------------------------------------------------------------------------------
# response shapes


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _usage(prompt: int, completion: int, cached: int | None, *, drop_none: bool = False) -> dict[str, Any]:
    usage: dict[str, Any] = {
        "prompt_tokens": prompt,
        "total_tokens": prompt + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None if cached is None else {"cached_tokens": cached},
        "reasoning_tokens": 0,
        "completion_tokens_details": None,
    }
    return {k: v for k, v in usage.items() if v is not None} if drop_none else usage


def _chat_chunk(
    rid: str,
    created: int,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    matched_stop: int | str | None = None,
    usage: dict[str, Any] | None = None,
) -> str:
    # sse_utils.build_sse_content: msgspec structs, StreamDelta/StreamChunk omit defaults, StreamChoice does not
    chunk: dict[str, Any] = {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason, "matched_stop": matched_stop}
        ],
    }
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {_dumps(chunk)}\n\n"


def _matched(finish: Mapping[str, Any] | None) -> int | str | None:
    return None if finish is None else finish.get("matched")


class _Serving:
    """The OpenAI-compatible endpoints (serving_chat.py / serving_completions.py)."""

    def __init__(self, engine: SGLangEmulator) -> None:
        self.engine = engine

    def _include_usage(self, body: Mapping[str, Any]) -> tuple[bool, bool]:
        default = self.engine.config.stream_response_default_include_usage
        options = body.get("stream_options")
        if options:
            return bool(options.get("include_usage")) or default, bool(options.get("continuous_usage_stats"))
        return default, False

    def _cached(self, cached: int) -> int | None:
        return cached if self.engine.config.enable_cache_report else None

    async def _kick_start(self, request: Request, stream: AsyncGenerator[str, None]) -> Response:
        """Headers only once the first chunk exists (serving_chat._handle_streaming_request)."""
        first = await _unless_disconnected(request, anext(stream))
        if first is None:
            await stream.aclose()
            return Response(status_code=499)

        async def body() -> AsyncIterator[str]:
            yield first
            async for chunk in stream:
                yield chunk

        # on a client disconnect Starlette cancels the body; closing the generator ends the backend request
        return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(stream.aclose))

    async def _prepare(self, request: Request, chat: bool) -> tuple[dict[str, Any], _Job]:
        engine = self.engine
        body = await _read_body(request, "messages" if chat else "prompt")
        if int(body.get("n") or 1) != 1:
            raise _APIError("n > 1 is not supported by the SGLang emulator", "BadRequest", 400)
        if chat:
            if not body["messages"]:
                raise _APIError("Messages cannot be empty.")
            input_ids = await engine.tokenize(await engine.render_chat(body), add_special=True)
        else:
            input_ids = await self._prompt_ids(body["prompt"])
        engine.check_model(str(body.get("model") or DEFAULT_MODEL_NAME))
        engine.check_length(input_ids)
        return body, engine.job(body, input_ids, request.headers.get("x-fault"))

    async def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return await self.engine.tokenize(prompt, add_special=True)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return [int(t) for t in prompt]
        raise _APIError("prompt must be a string, one string, or a list of token ids (batches are not emulated)")

    # -- chat --------------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        try:
            body, job = await self._prepare(request, chat=True)
        except _APIError as exc:
            return exc.response()
        model = str(body.get("model") or DEFAULT_MODEL_NAME)
        if job.stream:
            return await self._kick_start(request, self._iter_chat(body, job, model))
        return await self._chat_whole(request, job, model)

    async def _iter_chat(self, body: Mapping[str, Any], job: _Job, model: str) -> AsyncGenerator[str, None]:
        include_usage, continuous = self._include_usage(body)
        created = int(time.time())
        first = True
        finish: dict[str, Any] | None = None
        out = _Output("", 0, len(job.input_ids))
        outputs = self.engine.iter_outputs(job)
        try:
            async for out in outputs:
                if out.aborted_with_status:
                    assert out.finish is not None
                    code: HTTPStatus = out.finish["status_code"]
                    yield _streaming_error(out.finish["message"], code.name, code.value)
                    break
                finish = out.finish or finish
                if first:
                    first = False
                    yield _chat_chunk(
                        job.rid, created, model, {"reasoning_content": None, "role": "assistant", "content": ""}
                    )
                if out.text:
                    usage = _usage(out.prompt_tokens, out.completion_tokens, None) if continuous else None
                    yield _chat_chunk(
                        job.rid, created, model, {"reasoning_content": None, "content": out.text}, usage=usage
                    )
            if finish is not None:
                yield _chat_chunk(
                    job.rid, created, model, {"reasoning_content": None}, finish["type"], _matched(finish)
                )
            if include_usage:
                usage_chunk = {
                    "id": job.rid,
                    "object": "chat.completion.chunk",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": _usage(out.prompt_tokens, out.completion_tokens, self._cached(out.cached_tokens)),
                }
                yield f"data: {_dumps(usage_chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await outputs.aclose()

    async def _collect(self, job: _Job) -> tuple[str, _Output]:
        parts: list[str] = []
        last = _Output("", 0, len(job.input_ids))
        async for last in self.engine.iter_outputs(job):
            if last.aborted_with_status:
                assert last.finish is not None
                code: HTTPStatus = last.finish["status_code"]
                # non-stream aborts are HTTPException(status) -> type str(status), no param key change
                raise _APIError(last.finish["message"], str(code.value), code.value)
            parts.append(last.text)
        return "".join(parts), last

    async def _chat_whole(self, request: Request, job: _Job, model: str) -> Response:
        try:
            collected = await _unless_disconnected(request, self._collect(job))
        except _APIError as exc:
            return exc.response()
        if collected is None:
            return Response(status_code=499)
        text, last = collected
        return JSONResponse(
            {
                "id": job.rid,
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text, "reasoning_content": None},
                        "logprobs": None,
                        "finish_reason": None if last.finish is None else last.finish["type"],
                        "matched_stop": _matched(last.finish),
                    }
                ],
                "usage": _usage(last.prompt_tokens, last.completion_tokens, self._cached(last.cached_tokens)),
                "metadata": {"weight_version": "default"},
            }
        )

    # -- completions -------------------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        try:
            body, job = await self._prepare(request, chat=False)
        except _APIError as exc:
            return exc.response()
        model = str(body.get("model") or DEFAULT_MODEL_NAME)
        if body.get("echo"):
            return _APIError("echo is not supported by the SGLang emulator").response()
        if job.stream:
            return await self._kick_start(request, self._iter_completion(body, job, model))
        return await self._completion_whole(request, job, model)

    async def _iter_completion(self, body: Mapping[str, Any], job: _Job, model: str) -> AsyncGenerator[str, None]:
        include_usage, continuous = self._include_usage(body)
        created = int(time.time())
        out = _Output("", 0, len(job.input_ids))
        outputs = self.engine.iter_outputs(job)
        try:
            async for out in outputs:
                if out.aborted_with_status:
                    assert out.finish is not None
                    code: HTTPStatus = out.finish["status_code"]
                    yield _streaming_error(out.finish["message"], code.name, code.value)
                    break
                chunk = {
                    "id": job.rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "text": out.text,
                            "logprobs": None,
                            "finish_reason": None if out.finish is None else out.finish["type"],
                            "matched_stop": _matched(out.finish),
                        }
                    ],
                    # pydantic model_dump_json keeps usage: null on every chunk
                    "usage": _usage(out.prompt_tokens, out.completion_tokens, None) if continuous else None,
                }
                yield f"data: {_dumps(chunk)}\n\n"
            if include_usage:
                usage = _usage(
                    out.prompt_tokens, out.completion_tokens, self._cached(out.cached_tokens), drop_none=True
                )
                final = {
                    "id": job.rid,
                    "object": "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [],
                    "usage": usage,
                }
                yield f"data: {_dumps(final)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await outputs.aclose()

    async def _completion_whole(self, request: Request, job: _Job, model: str) -> Response:
        try:
            collected = await _unless_disconnected(request, self._collect(job))
        except _APIError as exc:
            return exc.response()
        if collected is None:
            return Response(status_code=499)
        text, last = collected
        return JSONResponse(
            {
                "id": job.rid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": None if last.finish is None else last.finish["type"],
                        "matched_stop": _matched(last.finish),
                    }
                ],
                "usage": _usage(last.prompt_tokens, last.completion_tokens, self._cached(last.cached_tokens)),
                "metadata": {"weight_version": "default"},
            }
        )

    # -- tokenize ----------------------------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        engine = self.engine
        try:
            body = await _read_body(request, None)
            prompt, messages = body.get("prompt"), body.get("messages")
            if (prompt is None) == (messages is None):
                raise _APIError("Exactly one of 'prompt' or 'messages' must be provided.")
            max_len = engine.context_length
            if messages is not None:
                ids = await engine.tokenize(await engine.render_chat(body), add_special=True)
                return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": max_len})
            add_special = bool(body.get("add_special_tokens", True))
            if isinstance(prompt, list):
                batches = [await engine.tokenize(str(p), add_special=add_special) for p in prompt]
                return JSONResponse({"tokens": batches, "count": [len(b) for b in batches], "max_model_len": max_len})
            ids = await engine.tokenize(str(prompt), add_special=add_special)
            return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": max_len})
        except _APIError as exc:
            return exc.response()


# ----------------------------------------------------------------------------------------------------------
# the app


def create_app(config: EmulatorConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> Starlette:
    """The emulator as an ASGI app; its lifespan waits for the backend and reads its /props."""
    engine = SGLangEmulator(config)
    serving = _Serving(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await engine.start(transport)
        try:
            yield
        finally:
            await engine.stop()

    async def health(request: Request) -> Response:
        # http_server.health_generate: a real 1-token generation; answered at once when busy
        if engine.inflight > 0:
            return Response(status_code=200)
        body = {"prompt": [0], "n_predict": 1, "temperature": 0.0, "cache_prompt": False}
        try:
            resp = await asyncio.wait_for(engine.http.post("/completion", json=body), timeout=20.0)
        except (httpx.HTTPError, TimeoutError):
            return Response(status_code=503)
        return Response(status_code=200 if resp.status_code == 200 else 503)

    async def ready(request: Request) -> Response:
        return Response(status_code=200)

    async def model_info(request: Request) -> Response:
        return JSONResponse(
            {
                "model_path": engine.model_path,
                "served_model_name": engine.served_model_name,
                "tokenizer_path": engine.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
                "load_format": "auto",
                "reasoning_parser": None,
                "tool_call_parser": None,
                "disaggregation_mode": "null",
                "has_image_understanding": False,
                "has_audio_understanding": False,
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
            }
        )

    async def server_info(request: Request) -> Response:
        m = engine.metrics
        throughput = 0.0
        if m is not None:
            m._trim(time.monotonic())
            throughput = sum(n for _, n in m.recent_tokens) / THROUGHPUT_WINDOW_S
        return JSONResponse(
            {
                "model_path": engine.model_path,
                "tokenizer_path": engine.model_path,
                "served_model_name": engine.served_model_name,
                "host": config.host,
                "port": config.port,
                "context_length": engine.context_length,
                "max_running_requests": engine.max_running_requests,
                "max_queued_requests": config.max_queued_requests,
                "max_total_tokens": engine.context_length * engine.max_running_requests,
                "tp_size": 1,
                "dp_size": 1,
                "pp_size": 1,
                "stream_interval": 1,
                "stream_output": False,
                "schedule_policy": "fcfs",
                "sampling_defaults": "model",
                "enable_metrics": config.enable_metrics,
                "enable_cache_report": config.enable_cache_report,
                "stream_response_default_include_usage": config.stream_response_default_include_usage,
                "allow_auto_truncate": False,
                "enable_lora": False,
                "skip_server_warmup": True,
                "backend": config.backend,  # emulator only: where tokens come from
                "launch_command": "python -m fakes.sglang_emulator",
                "startup_time": engine.startup_time,
                "internal_states": [
                    {
                        "last_gen_throughput": throughput,
                        "num_running_reqs": min(engine.inflight, engine.max_running_requests),
                        "num_queue_reqs": max(0, engine.inflight - engine.max_running_requests),
                        "avg_spec_accept_length": None,
                    }
                ],
                "version": SGLANG_VERSION,
                "frontend": "python",
            }
        )

    async def models(request: Request) -> Response:
        card = {
            "id": engine.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": engine.served_model_name,
            "parent": None,
            "max_model_len": engine.context_length,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def model_card(request: Request) -> Response:
        name = request.path_params["model"]
        if name != engine.served_model_name:
            error = {
                "message": f"The model '{name}' does not exist",
                "type": "invalid_request_error",
                "param": "model",
                "code": "model_not_found",
            }
            return JSONResponse({"error": error}, status_code=404)
        card = {
            "id": name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": name,
            "parent": None,
            "max_model_len": engine.context_length,
        }
        return JSONResponse(card)

    async def flush_cache(request: Request) -> Response:
        if engine.inflight > 0:
            return Response("Flush cache failed.\n", status_code=400)
        return Response(FLUSHED, status_code=200)

    async def metrics(request: Request) -> Response:
        assert engine.registry is not None
        return Response(generate_latest(engine.registry), media_type=CONTENT_TYPE_LATEST)

    async def not_found(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 404
        return JSONResponse({"detail": HTTPStatus(status).phrase}, status_code=status)

    routes = [
        Route("/v1/chat/completions", serving.chat, methods=["POST"]),
        Route("/v1/completions", serving.completions, methods=["POST"]),
        Route("/v1/tokenize", serving.tokenize, methods=["POST"]),
        Route("/tokenize", serving.tokenize, methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/health_generate", health, methods=["GET"]),
        Route("/model_info", model_info, methods=["GET"]),
        Route("/get_model_info", model_info, methods=["GET"]),
        Route("/server_info", server_info, methods=["GET"]),
        Route("/get_server_info", server_info, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{model:path}", model_card, methods=["GET"]),
        Route("/flush_cache", flush_cache, methods=["GET", "POST"]),
    ]
    if config.ready_endpoint:
        routes.append(Route("/ready", ready, methods=["GET"]))
    if config.enable_metrics:
        routes.append(Route("/metrics", metrics, methods=["GET"]))
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={404: not_found, 405: not_found})
    app.state.emulator = engine
    return app


# ----------------------------------------------------------------------------------------------------------
# entry points


@contextlib.contextmanager
def run_in_thread(config: EmulatorConfig, *, port: int = 0, startup_timeout_s: float = 60.0) -> Iterator[str]:
    """Serve the emulator with uvicorn in a thread, on ``port`` (0: a free one); yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, port))
    host, port = sock.getsockname()[:2]
    app = create_app(replace(config, port=port))
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2, access_log=False)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="sglang-emulator", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + startup_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the SGLang emulator did not start (is the backend up?)")
            time.sleep(0.02)
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()


def _parse_args(argv: list[str] | None) -> EmulatorConfig:
    p = argparse.ArgumentParser(prog="python -m fakes.sglang_emulator", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--backend", required=True, help="llama-server base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--model-path", default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--max-queued-requests", type=int, default=None)
    p.add_argument("--enable-metrics", action="store_true")
    p.add_argument("--enable-cache-report", action="store_true")
    p.add_argument("--stream-response-default-include-usage", action="store_true")
    p.add_argument("--no-ready", action="store_true", help="no /ready endpoint (404), as SGLang 0.5.17")
    a = p.parse_args(argv)
    return EmulatorConfig(
        backend=a.backend,
        served_model_name=a.served_model_name,
        model_path=a.model_path,
        context_length=a.context_length,
        max_running_requests=a.max_running_requests,
        max_queued_requests=a.max_queued_requests,
        enable_metrics=a.enable_metrics,
        enable_cache_report=a.enable_cache_report,
        stream_response_default_include_usage=a.stream_response_default_include_usage,
        ready_endpoint=not a.no_ready,
        host=a.host,
        port=a.port,
    )


def main(argv: list[str] | None = None) -> None:
    config = _parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    with run_in_thread(config, port=config.port) as url:
        print(f"READY {url}", flush=True)
        stop.wait()


if __name__ == "__main__":
    main()
