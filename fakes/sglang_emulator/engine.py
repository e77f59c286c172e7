"""Generation: one backend ``/completion`` stream per request, turned into SGLang engine outputs, plus the
live state (in flight, tokens in use) that admission reads, the scheduler stats that ``/metrics`` shows as SGLang
publishes them (at each prefill and every ``decode_log_interval`` decode steps, when idle every
``idle_metrics_s``), and a radix-cache stand-in for ``cached_tokens``."""

from __future__ import annotations

import asyncio
import itertools
import json
import ssl
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import httpx
from prometheus_client.registry import CollectorRegistry

from fakes.sglang_emulator.config import DEFAULT_MODEL_NAME, QUEUE_FULL, WARMUP_TEXT, EmulatorConfig
from fakes.sglang_emulator.metrics import _Metrics
from fakes.sglang_emulator.protocol import _APIError


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


class _PrefixCache:
    """SGLang's radix cache as ``cached_tokens`` shows it: the longest prefix a new prompt shares with any prompt
    still held, never the whole prompt (the last token is always computed). A template prefix earlier requests
    shared counts on a never-seen prompt (real 0.5.17: 1-6 tokens), a repeat counts all but its last token
    (900 of 901). Prompts are held least-recently-used first out, within the KV pool's token budget.

    Every held prefix is one chained hash (``hash((previous, token))``) with a count of the prompts holding it,
    so a lookup walks the new prompt once, whatever is held."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = max(1, capacity_tokens)
        self._held: OrderedDict[tuple[int, ...], list[int]] = OrderedDict()  # prompt -> its prefix hashes
        self._prefixes: dict[int, int] = {}  # prefix hash -> prompts holding it
        self._tokens = 0

    def match_and_insert(self, ids: Sequence[int]) -> int:
        """Cached tokens for a prompt of ``ids``; the prompt is held from now on."""
        key = tuple(ids)
        hashes = self._held.get(key)
        if hashes is None:
            hashes, h = [], 0
            for t in key:
                h = hash((h, t))
                hashes.append(h)
        shared = 0
        for h in hashes:
            if h not in self._prefixes:
                break
            shared += 1
        if key in self._held:
            self._held.move_to_end(key)
        else:
            self._held[key] = hashes
            self._tokens += len(key)
            for h in hashes:
                self._prefixes[h] = self._prefixes.get(h, 0) + 1
            while self._tokens > self.capacity_tokens and len(self._held) > 1:
                self._evict()
        return min(shared, max(len(key) - 1, 0))

    def _evict(self) -> None:
        old, hashes = self._held.popitem(last=False)
        self._tokens -= len(old)
        for h in hashes:
            n = self._prefixes[h] - 1
            if n:
                self._prefixes[h] = n
            else:
                del self._prefixes[h]

    def clear(self) -> None:
        self._held.clear()
        self._prefixes.clear()
        self._tokens = 0


@dataclass(frozen=True, slots=True)
class _Published:
    """The scheduler's gauges as last published (SGLang sets them when it logs stats, not per request)."""

    running: int = 0
    queued: int = 0
    used_tokens: int = 0
    gen_throughput: float = 0.0
    at: float = field(default_factory=time.monotonic)


class _ShardedTransport(httpx.AsyncBaseTransport):
    """Round-robin over small connection pools: httpcore scans its whole pool for every request, which
    costs seconds of TTFT at a few hundred concurrent streams in one pool."""

    def __init__(self, shards: int = 16, per_shard: int = 64) -> None:
        limits = httpx.Limits(max_connections=per_shard, max_keepalive_connections=per_shard)
        tls = ssl.create_default_context()  # one for all: building one takes ~50 ms (16 made start-up 1.2 s)
        self._shards = [httpx.AsyncHTTPTransport(limits=limits, verify=tls) for _ in range(shards)]
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
        self.prefix_cache = _PrefixCache(0)
        self.published = _Published()
        self._decode_steps = 0.0
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
        self.prefix_cache = _PrefixCache(self.max_total_num_tokens)
        self.prefix_cache.match_and_insert(await self.tokenize(WARMUP_TEXT))  # SGLang warms up before it serves

    @property
    def max_total_num_tokens(self) -> int:
        """The KV pool in tokens: the backend's whole context (llama.cpp ``-c``)."""
        return self.context_length * self.max_running_requests

    @property
    def max_req_input_len(self) -> int:
        # scheduler.py: max_req_len = min(context_len - 1, max_total_num_tokens - 1); input 5 short of it
        return min(self.context_length - 1, self.max_total_num_tokens - 1) - 5

    # -- scheduler stats, published as SGLang does ----------------------------------------------------------

    def publish(self, *, running_before: int | None = None) -> None:
        running = min(self.inflight, self.max_running_requests) if running_before is None else running_before
        throughput = 0.0
        if self.metrics is not None:
            throughput = self.metrics.recent_throughput()
        self.published = _Published(running, max(0, self.inflight - running), self.live_tokens, throughput)

    def published_now(self) -> _Published:
        """The published gauges; an idle scheduler republishes at most every ``idle_metrics_s``, and at once when
        the running gauge still shows requests that have ended (SGLang 0.5.17
        ``metrics_reporter._maybe_log_idle_metrics``: ``gauge_stale`` skips the 30 s window)."""
        if self.inflight == 0 and (
            self.published.running != 0 or time.monotonic() - self.published.at >= self.config.idle_metrics_s
        ):
            self.publish()
        return self.published

    def _on_decode(self, new_tokens: int) -> None:
        # one decode step gives every running request a token: steps ~ tokens / running
        before = int(self._decode_steps) // self.config.decode_log_interval
        self._decode_steps += new_tokens / max(1, min(self.inflight, self.max_running_requests))
        if int(self._decode_steps) // self.config.decode_log_interval != before:
            self.publish()

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

    def check_length(self, input_ids: list[int], max_new_tokens: int | None) -> None:
        n, ctx = len(input_ids), self.context_length
        if n >= ctx:
            raise _APIError(f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).")
        if max_new_tokens is not None and n + max_new_tokens > ctx:
            # real 0.5.17 (captured): prompt + max_tokens over the context is refused, not cut short
            raise _APIError(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {n + max_new_tokens} tokens: {n} tokens from the input messages and "
                f"{max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit."
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
        self.publish(running_before=min(self.inflight, self.max_running_requests))  # log_prefill_stats
        cached = self.prefix_cache.match_and_insert(job.input_ids)
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
                    self._on_decode(new_tokens)
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
