"""Send the suite to every engine, one variable at a time, and write every result to JSONL as it finishes.

Protocol (docs/bench.md):

- every engine gets the same request body, built once and mapped per engine kind by ``proxy.normalize`` (the
  proxy's own mapping: top_k "off" 0 vs -1, repeat_penalty vs repetition_penalty); through the proxy the body
  goes as is and the proxy maps it;
- timing is the proxy's: ``SSEFramer`` + ``StreamTimer`` + ``StreamTiming.derive``, token events as in
  ``proxy.server.relay`` — so TTFT/TPOT/decode tok/s mean the same here and in ``/metrics``;
- warm-up requests are sent first and discarded;
- cache-cold: a unique prefix per request (``[<random hex> bench <run id>]``: it differs from its first
  token, so only the chat template's own preamble can be cached; the *same* prefix on every engine, so
  per-request prompt tokens stay comparable), optionally ``cache_prompt: false`` to llama.cpp, and
  ``POST /flush_cache`` to SGLang before the phase; cache-warm: the bare prompts, primed once per engine;
- sweeps change one variable from the base point (concurrency 1, base max_tokens, base prompt length);
- every cell is repeated ``repeats`` times, engines alternating order (ABBA) so drift hits both.

JSONL record types: ``run`` (config and engines), ``prompt_tokens`` (tokenizer counts), ``request`` (one per
request), ``sample`` (one per cell repeat per engine: aggregates and GPU memory peak), ``end``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO, Any, cast

import httpx

from proxy import engines
from proxy.bench import suite as suite_mod
from proxy.bench.suite import Prompt
from proxy.engines import quant_from_name
from proxy.normalize import normalize_request
from proxy.sse import SSEFramer
from proxy.stream import error_text, loads, read_event
from proxy.timing import EngineTimings, StreamTimer, StreamTiming, Usage
from proxy.types import EngineKind

CHAT_PATH = "/v1/chat/completions"
_NEVER_SEEN = "Server disconnected without sending a response"
PIN_HEADER = "x-enginemeter-engine"


@dataclass
class Target:
    name: str
    url: str | None  # the engine's own URL (tokenize, flush_cache, probing); None when only reachable via proxy
    kind: EngineKind | None = None
    model: str | None = None
    quantization: str | None = None
    quantization_source: str | None = None
    slots: int | None = None
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class BenchConfig:
    engines: list[Target]
    through: str | None = None
    suite: str = "builtin"
    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    output_lengths: tuple[int, ...] = (32, 128)
    prompt_lengths: tuple[str, ...] = ("short", "medium", "long")
    repeats: int = 3
    warmup: int = 2
    cache: str = "both"  # cold | warm | both
    out: Path = Path("bench-out")
    model: str | None = None
    seed: int = 1234
    max_tokens: int = 128  # the base point of the output-length sweep
    waves: int = 2  # requests per cell repeat = concurrency * waves
    baseline: str | None = None
    metrics_url: str | None = None
    no_prompt_cache: bool = False  # send cache_prompt:false to llama.cpp in the cold phase
    ignore_eos: bool = True
    timeout_s: float = 600.0
    memory_budget_bytes: int | None = None
    quick: bool = False
    progress: bool = True

    @property
    def base_prompt_len(self) -> str:
        return "medium" if "medium" in self.prompt_lengths else self.prompt_lengths[0]


@dataclass(frozen=True, slots=True)
class CellSpec:
    cache: str
    concurrency: int
    max_tokens: int
    prompt_len: str
    sweeps: tuple[str, ...]


def plan(cfg: BenchConfig) -> list[CellSpec]:
    """Single-variable sweeps around the base point; a cell shared by two sweeps runs once."""
    base_pl = cfg.base_prompt_len
    cells: dict[tuple[str, int, int, str], list[str]] = {}
    caches = ("cold", "warm") if cfg.cache == "both" else (cfg.cache,)
    for cache in caches:
        for c in cfg.concurrency:
            cells.setdefault((cache, c, cfg.max_tokens, base_pl), []).append("concurrency")
        for mt in cfg.output_lengths:
            cells.setdefault((cache, 1, mt, base_pl), []).append("output")
        for pl in cfg.prompt_lengths:
            cells.setdefault((cache, 1, cfg.max_tokens, pl), []).append("prompt")
    return [CellSpec(k[0], k[1], k[2], k[3], tuple(v)) for k, v in cells.items()]


# ---- JSONL --------------------------------------------------------------------------------------


class Writer:
    """Appends one JSON object per line and flushes each: Ctrl-C keeps everything that finished."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f: IO[str] = path.open("w", encoding="utf-8")

    def write(self, rec: Mapping[str, Any]) -> None:
        self._f.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


# ---- one request --------------------------------------------------------------------------------


@dataclass
class RequestOutcome:
    ok: bool
    status: int
    error: str | None
    timing: StreamTiming
    usage: Usage | None
    engine: EngineTimings | None
    finish_reason: str | None
    n_token_events: int
    t_start_ns: int
    t_done_ns: int
    retried: bool = False


async def send_one(client: httpx.AsyncClient, body: bytes, headers: Mapping[str, str]) -> RequestOutcome:
    """POST one streaming chat request and time it exactly as the proxy times its upstream.

    A kept-alive connection the server closed before answering (llama-server's cpp-httplib closes idle
    keep-alive connections after 5 s and every connection after a fixed number of requests; a client can win
    that race) is retried once with a fresh clock: the engine never saw that request. Through the proxy the
    same event comes back as its 502 "closed the connection: Server disconnected without sending a response".
    """
    o = await _send_once(client, body, headers)
    if not o.ok and o.error and _NEVER_SEEN in o.error and o.status in (0, 502):  # 502: the proxy relaying it
        o = await _send_once(client, body, headers)
        o.retried = True
    return o


async def _send_once(client: httpx.AsyncClient, body: bytes, headers: Mapping[str, str]) -> RequestOutcome:
    timer = StreamTimer()
    framer = SSEFramer()
    usage: Usage | None = None
    engine_t: EngineTimings | None = None
    finish: str | None = None
    status = 0
    error: str | None = None
    try:
        timer.sent()
        async with client.stream("POST", CHAT_PATH, content=body, headers=headers) as resp:
            timer.headers()
            status = resp.status_code
            if status != 200:
                raw = await resp.aread()
                error = f"HTTP {status}: {error_text(raw)}"
            else:
                async for chunk in resp.aiter_raw():
                    t_ns = time.perf_counter_ns()
                    for ev in framer.feed(chunk):
                        if ev.is_comment or not ev.data or ev.is_done:
                            continue
                        try:
                            info = read_event(loads(ev.data))
                        except ValueError:
                            error = "malformed SSE event"
                            continue
                        if info.error is not None:
                            error = f"in-stream error: {info.error[:200]}"
                            continue
                        if info.token:
                            timer.token(t_ns)
                        finish = info.finish_reason or finish
                        usage = info.usage or usage
                        engine_t = info.timings or engine_t
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:200]
    timer.done()
    if error is None and timer.t_first_token_ns == 0:
        error = "no token received"
    if usage is None or usage.completion_tokens is None:
        # no usage from the engine: fall back to token events (chunks; may undercount)
        usage = Usage(
            prompt_tokens=usage.prompt_tokens if usage else None,
            completion_tokens=timer.n_token_events or None,
            cached_tokens=usage.cached_tokens if usage else None,
        )
    timing = StreamTiming.derive(timer, usage, engine_t)
    return RequestOutcome(
        ok=error is None,
        status=status,
        error=error,
        timing=timing,
        usage=usage,
        engine=engine_t,
        finish_reason=finish,
        n_token_events=timer.n_token_events,
        t_start_ns=timer.t_received_ns,
        t_done_ns=timer.t_done_ns,
    )


# ---- request bodies -----------------------------------------------------------------------------


def sampling(cfg: BenchConfig, max_tokens: int) -> dict[str, Any]:
    """The explicit sampling every engine gets (before the per-kind mapping)."""
    s: dict[str, Any] = {
        "temperature": 0,
        "top_p": 1.0,
        "top_k": 0,  # off; mapped to -1 for SGLang/vLLM by proxy.normalize
        "min_p": 0.0,
        "repetition_penalty": 1.0,  # off; the one value both penalty semantics share
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "seed": cfg.seed,
        "max_tokens": max_tokens,
    }
    if cfg.ignore_eos:
        s["ignore_eos"] = True
    return s


def canonical_sampling(body: Mapping[str, Any]) -> dict[str, Any]:
    """The sampling an engine actually got, spelled the same for every kind (for the parity check)."""
    out: dict[str, Any] = {}
    for k in ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "ignore_eos"):
        if k in body:
            out[k] = body[k]
    if isinstance(out.get("top_k"), int | float) and out["top_k"] <= 0:
        out["top_k"] = "off"
    pen = body.get("repetition_penalty", body.get("repeat_penalty"))
    if pen is not None:
        out["repetition_penalty"] = pen
    for k, v in list(out.items()):
        if isinstance(v, float) and v.is_integer():
            out[k] = int(v)
    return out


def build_body(
    cfg: BenchConfig, t: Target, messages: Sequence[Mapping[str, str]], max_tokens: int, *, cold: bool
) -> dict[str, Any]:
    client: dict[str, Any] = {
        "model": cfg.model or t.model or "default",
        "messages": [dict(m) for m in messages],
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling(cfg, max_tokens),
    }
    if cold and cfg.no_prompt_cache and (t.kind == "llamacpp" or cfg.through):
        client["cache_prompt"] = False
    if cfg.through:
        return client  # the proxy maps it per kind (and drops what the engine cannot take)
    kind: EngineKind = t.kind or "openai"
    return normalize_request(client, endpoint="chat", kind=kind, served_model=cfg.model or t.model, defaults={}).body


# ---- engine probing, tokenization, cache ---------------------------------------------------------


async def probe(t: Target, timeout: float = 5.0) -> None:
    """Kind, served model, slots, context length and quantization from the engine's dialect (``proxy.engines``);
    a declared quantization wins, the model's file or served name is the last resort."""
    if not t.url:
        return
    async with httpx.AsyncClient(base_url=t.url, timeout=timeout, trust_env=False) as c:
        p = await engines.probe(c, timeout, kind=t.kind, model=t.model, full=True)
    t.kind, t.model = p.kind, p.model
    if p.error:
        t.info["probe_error"] = p.error
    f = p.facts
    if f is None:
        return
    t.slots = t.slots or f.slots
    t.info.update({k: v for k, v in (("model_path", f.model_path), ("context_length", f.context_length),
                                     ("build", f.build)) if v is not None})  # fmt: skip
    if not t.quantization and f.quantization:
        t.quantization, t.quantization_source = f.quantization, f"{t.kind} report"
    if not t.quantization:
        q = quant_from_name(PurePosixPath(f.model_path or "").name, t.model)
        if q:
            t.quantization, t.quantization_source = q, "model name"


async def count_prompt_tokens(
    t: Target, model: str | None, messages: Sequence[Mapping[str, str]]
) -> tuple[int | None, str]:
    """Prompt tokens as the engine would count them for a chat completion, without generating."""
    if not t.url:
        return None, "no engine URL"
    async with httpx.AsyncClient(base_url=t.url, timeout=30, trust_env=False) as c:
        n = await engines.dialect(t.kind).count_prompt_tokens(c, model, messages)
    return n.tokens, n.method


async def flush_cache(t: Target) -> str | None:
    """Empty the engine's prompt cache where its kind can (llama.cpp slot erase, SGLang ``/flush_cache``, vLLM
    ``/reset_prefix_cache``); a note saying what happened."""
    if not t.url:
        return None
    async with httpx.AsyncClient(base_url=t.url, timeout=30, trust_env=False) as c:
        return await engines.dialect(t.kind).flush_cache(c)


# ---- GPU memory -----------------------------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+|NaN|[+-]Inf)")


def parse_metrics(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        with contextlib.suppress(ValueError):
            yield m.group(1), labels, float(m.group(3))


def memory_from_metrics(text: str, engine: str) -> tuple[int | None, str]:
    """The engine's GPU memory now (or its peak, or the device's) from the proxy's /metrics."""
    used: float = 0
    peak: float = 0
    device: float = 0
    seen = set()
    for name, labels, v in parse_metrics(text):
        if name == "enginemeter_engine_gpu_memory_used_bytes" and labels.get("engine") == engine:
            used += v
            seen.add("engine")
        elif name == "enginemeter_engine_gpu_memory_peak_bytes" and labels.get("engine") == engine:
            peak += v
            seen.add("peak")
        elif name == "enginemeter_gpu_memory_used_bytes":
            device += v
            seen.add("device")
    if "engine" in seen:
        return int(used), "proxy engine gauge"
    if "peak" in seen:
        return int(peak), "proxy engine peak"
    if "device" in seen:
        return int(device), "proxy device gauge"
    return None, "unknown"


class MemoryProbe:
    """Polls GPU memory while a cell repeat runs; ``peak`` is the highest reading (None: unknown)."""

    def __init__(self, metrics_url: str | None) -> None:
        self.metrics_url = metrics_url
        self.source = "unknown"
        self._nvml: Any = None
        if metrics_url is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                if pynvml.nvmlDeviceGetCount() > 0:
                    self._nvml = pynvml
                    self.source = "NVML (whole device)"
            except Exception:  # no driver, no GPU: memory stays unknown
                self._nvml = None

    def _nvml_used(self) -> int:
        nv = self._nvml
        total = 0
        for i in range(nv.nvmlDeviceGetCount()):
            total += int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i)).used)
        return total

    async def read(self, client: httpx.AsyncClient | None, engine: str) -> int | None:
        if self.metrics_url and client is not None:
            try:
                r = await client.get(self.metrics_url, timeout=5)
            except httpx.HTTPError:
                return None
            v, self.source = memory_from_metrics(r.text, engine)
            return v
        if self._nvml is not None:
            try:
                return await asyncio.to_thread(self._nvml_used)
            except Exception:
                return None
        return None

    @contextlib.asynccontextmanager
    async def watch(self, client: httpx.AsyncClient | None, engine: str, period_s: float = 0.5) -> Any:
        box: dict[str, int | None] = {"peak": None}

        async def loop() -> None:
            while True:
                v = await self.read(client, engine)
                if v is not None:
                    box["peak"] = max(v, box["peak"] or 0)
                await asyncio.sleep(period_s)  # sampling period, not synchronisation

        if self.metrics_url is None and self._nvml is None:
            yield box
            return
        task = asyncio.create_task(loop())
        try:
            yield box
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            v = await self.read(client, engine)
            if v is not None:
                box["peak"] = max(v, box["peak"] or 0)


# ---- progress -------------------------------------------------------------------------------------


class Progress:
    def __init__(self, total: int, enabled: bool = True, stream: IO[str] | None = None) -> None:
        self.total = max(1, total)
        self.done = 0
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self._last_pct = -1
        self.label = ""

    def step(self, n: int = 1) -> None:
        self.done += n
        self.show()

    def show(self) -> None:
        if not self.enabled:
            return
        frac = min(1.0, self.done / self.total)
        pct = int(frac * 100)
        el = time.monotonic() - self.t0
        eta = el / frac - el if frac > 0 else 0
        bar = "#" * int(frac * 30) + "." * (30 - int(frac * 30))
        line = f"[{bar}] {self.done}/{self.total} {pct:3d}% {el:5.0f}s eta {eta:4.0f}s {self.label}"
        if self.tty:
            self.stream.write("\r" + line[:150].ljust(150))
            self.stream.flush()
        elif pct // 10 != self._last_pct // 10 or self.done == self.total:
            self.stream.write(line + "\n")
            self.stream.flush()
        self._last_pct = pct

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()


# ---- the run ---------------------------------------------------------------------------------------


def _prompts_for(prompts: Sequence[Prompt], length: str) -> list[Prompt]:
    return [p for p in prompts if p.length == length] or list(prompts)


def _with_prefix(p: Prompt, prefix: str) -> tuple[dict[str, str], ...]:
    if not prefix:
        return p.messages
    msgs = [dict(m) for m in p.messages]
    for m in msgs:
        if m["role"] == "user":
            m["content"] = prefix + m["content"]
            break
    return tuple(msgs)


def _median(vals: Sequence[float]) -> float | None:
    s = sorted(vals)
    if not s:
        return None
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


async def run_bench(cfg: BenchConfig, log: Callable[[str], None] | None = None) -> Path:
    """Run the whole bench; returns the JSONL path. Cancellation (Ctrl-C) keeps what was written."""
    say = log or (lambda m: print(m, file=sys.stderr, flush=True))
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.jsonl"
    w = Writer(path)
    t_start = time.time()
    # a new id per run: engines keep prompt caches across runs (llama.cpp slots and its RAM prompt cache), so a
    # prefix that repeats from one run to the next would turn the next run's "cold" requests into cache hits
    run_id = secrets.token_hex(4)
    interrupted = False
    try:
        await asyncio.gather(*(probe(t) for t in cfg.engines))
        prompts = suite_mod.load(cfg.suite, cfg.prompt_lengths)
        lengths_present = [pl for pl in cfg.prompt_lengths if any(p.length == pl for p in prompts)]
        if lengths_present != list(cfg.prompt_lengths):
            cfg.prompt_lengths = tuple(lengths_present) or tuple(sorted({p.length for p in prompts}))
        cells = plan(cfg)
        max_tokens_all = sorted({c.max_tokens for c in cells})
        engines_rec = []
        for t in cfg.engines:
            body = build_body(cfg, t, ({"role": "user", "content": "x"},), cfg.max_tokens, cold=False)
            engines_rec.append(
                {
                    "name": t.name,
                    "url": t.url,
                    "kind": t.kind,
                    "model": t.model,
                    "quantization": t.quantization,
                    "quantization_source": t.quantization_source,
                    "slots": t.slots,
                    "info": t.info,
                    "sampling": canonical_sampling(body),
                    "body_example": {k: v for k, v in body.items() if k != "messages"},
                    "max_tokens": max_tokens_all,
                }
            )
        cfg_rec = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items() if k != "engines"}
        w.write(
            {
                "type": "run",
                "version": 1,
                "run_id": run_id,
                "started": t_start,
                "config": cfg_rec,
                "engines": engines_rec,
                "baseline": cfg.baseline or cfg.engines[0].name,
                "through": cfg.through,
                "base": {"concurrency": 1, "max_tokens": cfg.max_tokens, "prompt_len": cfg.base_prompt_len},
                "cells": [asdict(c) for c in cells],
                "prompts": [{"id": p.id, "lang": p.lang, "length": p.length} for p in prompts],
                "memory_budget_bytes": cfg.memory_budget_bytes,
                "python": sys.version.split()[0],
            }
        )

        # prompt tokens with each engine's tokenizer, before anything is generated
        for p in prompts:
            counts = await asyncio.gather(
                *(count_prompt_tokens(t, cfg.model or t.model, p.messages) for t in cfg.engines)
            )
            for t, (n, method) in zip(cfg.engines, counts, strict=True):
                w.write(
                    {
                        "type": "prompt_tokens",
                        "engine": t.name,
                        "prompt": p.id,
                        "length": p.length,
                        "lang": p.lang,
                        "tokens": n,
                        "method": method,
                    }
                )

        total = len(cfg.engines) * (cfg.warmup + sum(c.concurrency * cfg.waves * cfg.repeats for c in cells))
        if cfg.cache in ("warm", "both"):
            total += len(cfg.engines) * len({p.id for p in prompts if p.length in cfg.prompt_lengths})
        prog = Progress(total, cfg.progress)
        max_conc = max(cfg.concurrency)
        clients: dict[str, httpx.AsyncClient] = {}
        metrics_client = httpx.AsyncClient(timeout=10, trust_env=False) if cfg.metrics_url else None
        mem = MemoryProbe(cfg.metrics_url)
        try:
            for t in cfg.engines:
                base = cfg.through or t.url
                if not base:
                    raise ValueError(f"engine {t.name}: no URL and no --through")
                clients[t.name] = httpx.AsyncClient(
                    base_url=base,
                    timeout=httpx.Timeout(cfg.timeout_s, connect=10),
                    limits=httpx.Limits(max_connections=max_conc + 2, max_keepalive_connections=max_conc + 2),
                    trust_env=False,
                )
            headers = {t.name: ({PIN_HEADER: t.name} if cfg.through else {}) for t in cfg.engines}
            headers = {k: {"content-type": "application/json", **v} for k, v in headers.items()}

            async def fire(t: Target, prompt: Prompt, prefix: str, max_tokens: int, cold: bool) -> RequestOutcome:
                msgs = _with_prefix(prompt, prefix)
                body = json.dumps(build_body(cfg, t, msgs, max_tokens, cold=cold)).encode()
                return await send_one(clients[t.name], body, headers[t.name])

            def request_record(t: Target, o: RequestOutcome, **extra: Any) -> dict[str, Any]:
                tm, u, e = o.timing, o.usage, o.engine
                return {
                    "type": "request",
                    "engine": t.name,
                    **extra,
                    "ok": o.ok,
                    "status": o.status,
                    "error": o.error,
                    "ttft_s": tm.ttft_s,
                    "headers_s": tm.headers_s,
                    "tpot_s": tm.tpot_s,
                    "decode_tps": tm.decode_tps,
                    "e2e_s": tm.e2e_s,
                    "prompt_tokens": u.prompt_tokens if u else None,
                    "completion_tokens": u.completion_tokens if u else None,
                    "cached_tokens": u.cached_tokens if u else (e.cache_n if e else None),
                    "token_events": o.n_token_events,
                    "retried": o.retried,
                    "finish_reason": o.finish_reason,
                    "engine_timings": asdict(e) if e else None,
                    "t_s": (o.t_start_ns - t0_ns) / 1e9,
                }

            t0_ns = time.perf_counter_ns()
            # warm-up: discarded from every figure
            for t in cfg.engines:
                prog.label = f"warm-up {t.name}"
                for i in range(cfg.warmup):
                    p = prompts[i % len(prompts)]
                    o = await fire(t, p, f"[{secrets.token_hex(4)} warmup {run_id}] ", cfg.max_tokens, True)
                    w.write(request_record(t, o, phase="warmup", prompt=p.id))
                    prog.step()

            for cache in ("cold", "warm"):
                phase_cells = [c for c in cells if c.cache == cache]
                if not phase_cells:
                    continue
                for t in cfg.engines:
                    note = await flush_cache(t)
                    if note:
                        w.write({"type": "note", "engine": t.name, "phase": cache, "text": note})
                if cache == "warm":
                    # prime every engine's prompt cache with each bare prompt once (discarded)
                    for t in cfg.engines:
                        prog.label = f"priming {t.name}"
                        for p in prompts:
                            if p.length in cfg.prompt_lengths:
                                o = await fire(t, p, "", cfg.max_tokens, False)
                                w.write(request_record(t, o, phase="prime", prompt=p.id))
                                prog.step()
                for ci, cell in enumerate(phase_cells):
                    pool = _prompts_for(prompts, cell.prompt_len)
                    for rep in range(cfg.repeats):
                        order = cfg.engines if rep % 2 == 0 else list(reversed(cfg.engines))
                        n = cell.concurrency * cfg.waves
                        # the same prompts and prefixes on every engine in this repeat
                        jobs = []
                        for i in range(n):
                            p = pool[i % len(pool)]
                            prefix = f"[{secrets.token_hex(4)} bench {run_id}] " if cache == "cold" else ""
                            jobs.append((p, prefix))
                        for t in order:
                            prog.label = (
                                f"{cache} c={cell.concurrency} max_tokens={cell.max_tokens} "
                                f"prompt={cell.prompt_len} rep {rep + 1}/{cfg.repeats} {t.name}"
                            )
                            prog.show()
                            sem = asyncio.Semaphore(cell.concurrency)
                            cell_key = {
                                "cache": cache,
                                "concurrency": cell.concurrency,
                                "max_tokens": cell.max_tokens,
                                "prompt_len": cell.prompt_len,
                            }

                            async def job(
                                p: Prompt,
                                prefix: str,
                                i: int,
                                t: Target = t,
                                sem: asyncio.Semaphore = sem,
                                cell_key: dict[str, Any] = cell_key,
                                rep: int = rep,
                                cell: CellSpec = cell,
                                cold: bool = cache == "cold",
                            ) -> RequestOutcome:
                                async with sem:
                                    o = await fire(t, p, prefix, cell.max_tokens, cold)
                                w.write(
                                    request_record(
                                        t,
                                        o,
                                        phase="measure",
                                        **cell_key,
                                        repeat=rep,
                                        index=i,
                                        prompt=p.id,
                                        key=f"{p.id}#{prefix.strip()}",
                                    )
                                )
                                prog.step()
                                return o

                            async with mem.watch(metrics_client, t.name) as box:
                                t_a = time.perf_counter_ns()
                                outs = await asyncio.gather(*(job(p, pre, i) for i, (p, pre) in enumerate(jobs)))
                                t_b = time.perf_counter_ns()
                            w.write(
                                _sample_record(
                                    t.name, cell_key, rep, cell.sweeps, outs, t_a, t_b, box["peak"], mem.source
                                )
                            )
                    del ci
        finally:
            prog.close()
            for c in clients.values():
                await c.aclose()
            if metrics_client is not None:
                await metrics_client.aclose()
    except (asyncio.CancelledError, KeyboardInterrupt):
        interrupted = True
        raise
    finally:
        w.write({"type": "end", "interrupted": interrupted, "duration_s": time.time() - t_start})
        w.close()
        say(f"enginemeter bench: {'interrupted; ' if interrupted else ''}results in {path}")
    return path


def _sample_record(
    engine: str,
    cell_key: Mapping[str, Any],
    rep: int,
    sweeps: Sequence[str],
    outs: Sequence[RequestOutcome],
    t_a: int,
    t_b: int,
    mem_peak: int | None,
    mem_source: str,
) -> dict[str, Any]:
    ok = [o for o in outs if o.ok]
    wall = (t_b - t_a) / 1e9
    tokens = sum((o.usage.completion_tokens or 0) for o in ok if o.usage)

    def med(attr: str) -> float | None:
        return _median([cast(float, getattr(o.timing, attr)) for o in ok if getattr(o.timing, attr) is not None])

    comp = [float(o.usage.completion_tokens) for o in ok if o.usage and o.usage.completion_tokens]
    prompt = [float(o.usage.prompt_tokens) for o in ok if o.usage and o.usage.prompt_tokens]
    return {
        "type": "sample",
        "engine": engine,
        **cell_key,
        "repeat": rep,
        "sweeps": list(sweeps),
        "n_ok": len(ok),
        "n_err": len(outs) - len(ok),
        "errors": sorted({o.error for o in outs if o.error})[:5],
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tps": tokens / wall if wall > 0 and ok else None,
        "ttft_s": med("ttft_s"),
        "tpot_s": med("tpot_s"),
        "decode_tps": med("decode_tps"),
        "e2e_s": med("e2e_s"),
        "completion_tokens": sum(comp) / len(comp) if comp else None,
        "prompt_tokens": sum(prompt) / len(prompt) if prompt else None,
        "engine_decode_tps": _median(
            [o.engine.predicted_per_second for o in ok if o.engine and o.engine.predicted_per_second is not None]
        ),
        "gpu_mem_peak_bytes": mem_peak,
        "gpu_mem_source": mem_source,
    }
