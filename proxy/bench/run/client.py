"""One streamed chat request, timed exactly as the proxy times its upstream, and the JSONL writer.

Timing is the proxy's: ``SSEFramer`` + ``StreamTimer`` + ``StreamTiming.derive``, events read by
``proxy.stream.read_event`` (the one reader shared with the relay and the perf harness) — so TTFT/TPOT/decode
tok/s mean the same here and in ``/metrics``.

The client measures itself too (``LoopLag``, as the proxy's ``proxy.server.record.loopwatch`` does): a timer every
``LAG_PROBE_S`` on the bench's event loop; how late it fires is how long the client could not read (its loop busy,
its process descheduled on a loaded box). Each request gets the longest such stall while it ran
(``client_lag_s``), and a burst — token events read together, ``proxy.timing.is_burst`` — is the *client's*
(``client_burst``) when a stall of the client ended where the events piled up and lasted long enough to have held
them (most of the time the engine took to make them, at the engine's cadence). A burst
with no such stall is the engine's (or a buffering hop's): nothing the bench did explains it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from proxy.config.settings import MIRROR_HEADER
from proxy.redact import private_file, redact_command
from proxy.sse import SSEFramer
from proxy.stream import error_text, loads, read_event
from proxy.timing import BURST_GAP_S, EngineTimings, StreamTimer, StreamTiming, Usage

CHAT_PATH = "/v1/chat/completions"
#: every bench request says so: through a mirroring proxy it is then never copied to a shadow (a copy would
#: pre-warm the shadow's cache with the "cold" prompts and land in the comparison log); engines ignore it
NO_MIRROR = {MIRROR_HEADER: "off"}
_NEVER_SEEN = "Server disconnected without sending a response"
#: the client's lag probe: its period, the shortest lateness kept (an idle loop is 0-1 ms late), how many kept
LAG_PROBE_S = 0.005
LAG_KEPT_S = 0.001
LAG_KEEP = 100_000
#: how much of the time the piled events took to make a client's stall must cover for the burst to be its own
HELD_SHARE = 0.75
NS = 1_000_000_000


class Writer:
    """Appends one JSON object per line and flushes each: Ctrl-C keeps everything that finished. The file is
    0600 (it holds engine errors and the run's commands)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f: IO[str] = private_file(path).open("w", encoding="utf-8")  # engine errors, commands: 0600

    def write(self, rec: Mapping[str, Any]) -> None:
        self._f.write(json.dumps(rec, ensure_ascii=False, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


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
    #: the generated text (choice 0's content, reasoning first): greedy outputs are compared across engines
    text: str = ""
    #: when the first token event was read (perf_counter ns; 0: none)
    t_first_token_ns: int = 0
    #: the client's longest stall while this request ran (``LoopLag``; None: not watched)
    client_lag_s: float | None = None
    #: the burst (``timing.burst``) is the client's: it stalled where the events piled up (module docstring)
    client_burst: bool = False

    @property
    def cached_tokens(self) -> int | None:
        return cached_tokens(self.usage, self.engine)


def cached_tokens(usage: Usage | None, engine: EngineTimings | None) -> int | None:
    """Cached prompt tokens: the usage field (OpenAI ``prompt_tokens_details.cached_tokens``, SGLang's
    top-level ``cached_tokens``), else llama.cpp's ``timings.cache_n``."""
    if usage is not None and usage.cached_tokens is not None:
        return usage.cached_tokens
    return engine.cache_n if engine is not None else None


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
    parts: list[str] = []
    try:
        timer.sent()
        async with client.stream("POST", CHAT_PATH, content=body, headers={**headers, **NO_MIRROR}) as resp:
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
                            info = read_event(loads(ev.data), with_text=True)
                        except ValueError:
                            error = "malformed SSE event"
                            continue
                        if info.error is not None:
                            error = f"in-stream error: {info.error[:200]}"
                            continue
                        if info.token:
                            timer.token(t_ns)
                        if info.text:
                            parts.append(info.text)
                        finish = info.finish_reason or finish
                        usage = info.usage or usage
                        engine_t = info.timings or engine_t
    except httpx.HTTPError as exc:
        error = redact_command(f"{type(exc).__name__}: {exc}")[:200]
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
        text="".join(parts),
        t_first_token_ns=timer.t_first_token_ns,
    )


class LoopLag:
    """The bench client's own scheduling delay (module docstring): ``watching`` runs the probe on the running
    loop; ``annotate`` gives a finished request its ``client_lag_s`` and ``client_burst``."""

    def __init__(self, probe_s: float = LAG_PROBE_S) -> None:
        self.probe_s = probe_s
        #: (end, lateness) of each stall: the loop could not run from ``end - lateness`` to ``end`` (perf ns)
        self.stalls: deque[tuple[int, int]] = deque(maxlen=LAG_KEEP)

    async def _probe(self) -> None:
        step = int(self.probe_s * NS)
        while True:
            due = time.perf_counter_ns() + step
            await asyncio.sleep(self.probe_s)
            now = time.perf_counter_ns()
            if now - due >= LAG_KEPT_S * NS:
                self.stalls.append((now, now - due))

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[LoopLag]:
        task = asyncio.get_running_loop().create_task(self._probe())
        try:
            yield self
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def worst(self, t_a_ns: int, t_b_ns: int) -> float:
        """The longest stall that overlapped ``[t_a_ns, t_b_ns]``, in seconds (0: none)."""
        return max((lag for end, lag in self.stalls if end > t_a_ns and end - lag < t_b_ns), default=0) / NS

    def annotate(self, o: RequestOutcome) -> RequestOutcome:
        o.client_lag_s = self.worst(o.t_start_ns, o.t_done_ns or time.perf_counter_ns())
        o.client_burst = bool(o.timing.burst and o.client_lag_s and self._held(o))
        return o

    def _held(self, o: RequestOutcome) -> bool:
        """Whether stalls of the client explain the burst: most of its piled events (those read under
        ``BURST_GAP_S`` after the one before) are in runs that a stall of the client ended (within two probes)
        after covering three quarters of the time the engine took to make the run, at its cadence (its own
        per-token time where it reports one, else the stream's gaps between events not piled, two at least). A
        stream with no cadence to read (every event in one read, no engine timings) is the engine's."""
        gaps = [int(g * NS) for g in o.timing.gaps_s]
        made = [g for g in gaps if g >= BURST_GAP_S * NS]
        own = o.engine.predicted_per_second if o.engine is not None else None
        cadence = NS / own if own else (statistics.median(made) if len(made) >= 2 else None)
        if cadence is None or not o.t_first_token_ns:
            return False
        runs: list[list[int]] = []  # the read times of each run of piled events
        t, short = o.t_first_token_ns, False
        for g in gaps:
            t += g
            if g < BURST_GAP_S * NS:
                if not short:
                    runs.append([])
                runs[-1].append(t)
            short = g < BURST_GAP_S * NS
        near = 2 * int(self.probe_s * NS)
        stalls = [(end, lag) for end, lag in self.stalls if end > o.t_start_ns]
        held = sum(
            len(run)
            for run in runs
            if any(
                lag >= HELD_SHARE * len(run) * cadence and run[0] - near <= end <= run[-1] + near for end, lag in stalls
            )
        )
        return 2 * held >= sum(len(run) for run in runs) > 0
