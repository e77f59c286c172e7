"""The per-request log: one JSON line per attempt (primary, fallback, shadow, pass-through), opt-in
(``request_log.path``). It answers "why was this request slow?" for any request, not only mirrored pairs.

An ``Attempts`` observer: it turns each ``Result`` into a dict and hands it to a ``ComparisonLog`` writer (the
comparison log's bounded queue, daemon thread and size rotation: ``path`` -> ``path.1`` ... ``path.<backups>``),
so nothing is serialized or written on the event loop, and a writer that cannot keep up drops lines (counted
in ``dropped``) instead of slowing a stream. The file is created with mode 0600.

Never the prompt or the output, unless ``request_log.record_text``: then every attempt collects its output text
(as a mirrored one does) and the line carries ``prompt`` (the client's ``messages`` / ``prompt``) and ``text``.

Record (``v`` bumps when a field changes meaning or disappears; fields may be added; docs/requests.md)::

    {"v":1, "ts":1764700000.12, "request_id":"...", "client_request_id":null, "endpoint":"chat", "model":"qwen-7b",
     "route":0,
     "engine":"llama", "kind":"llamacpp", "role":"primary", "stream":true, "outcome":"ok", "status":200,
     "ttft_s":0.081, "upstream_ttft_s":0.080, "tpot_s":0.0041, "decode_tps":243.9, "e2e_s":0.61,
     "overhead_s":0.0002, "queue_wait_s":0.00001, "proxy_delay_s":0.0003, "prompt_tokens":31,
     "completion_tokens":128, "cached_tokens":0,
     "finish_reason":"length", "error":null, "rollout":null, "swap":null}

``rollout``: on a route with a rollout, the state that routed the request: ``{"step", "share", "state"}``.
``swap``: on a route with a swap, the phase the request arrived in, the seconds it was held, the engine and regime
that served it: ``{"phase", "held_s", "engine", "regime"}`` (docs/routing.md#swap).
"""

from __future__ import annotations

import time
from typing import Any

from proxy.config.settings import RequestLogSettings
from proxy.errors import NotFound
from proxy.server.mirror.compare import ComparisonLog
from proxy.server.record.context import current
from proxy.server.record.result import Result
from proxy.server.request.relay import Attempt
from proxy.server.request.routing import Router

RECORD_VERSION = 1
#: engine error messages are cut to this many characters (they are the engine's text, not the client's)
MAX_ERROR_CHARS = 300


def to_record(r: Result, *, route: int | None, ts: float | None = None) -> dict[str, Any]:
    """The JSONL record of one attempt (no text; ``RequestLog`` adds it when asked)."""
    t, u = r.timing, r.usage
    cached = u.cached_tokens if u is not None else None
    if cached is None and r.engine_timings is not None:
        cached = r.engine_timings.cache_n
    return {
        "v": RECORD_VERSION,
        "ts": time.time() if ts is None else ts,
        "request_id": r.request_id,
        "client_request_id": r.client_request_id,
        "endpoint": r.endpoint,
        "model": r.model,
        "route": route,
        "engine": r.engine,
        "kind": r.engine_kind,
        "role": r.role,
        "stream": r.stream,
        "outcome": r.outcome,
        "status": r.status,
        "ttft_s": t.ttft_s,
        "upstream_ttft_s": t.upstream_ttft_s,
        "tpot_s": t.tpot_s,
        "decode_tps": t.decode_tps,
        "e2e_s": t.e2e_s,
        "overhead_s": t.overhead_s,
        "queue_wait_s": t.handler_wait_s,
        "proxy_delay_s": t.proxy_delay_s,
        "loop_stalled": r.loop_stalled,
        "prompt_tokens": u.prompt_tokens if u is not None else None,
        "completion_tokens": u.completion_tokens if u is not None else None,
        "cached_tokens": cached,
        "finish_reason": r.finish_reason,
        "error": r.error[:MAX_ERROR_CHARS] if r.error else None,
    }


class RequestLog:
    """Observer of every Result; ``on_attempt`` (registered only with ``record_text``) makes attempts keep text."""

    def __init__(self, settings: RequestLogSettings, router: Router) -> None:
        assert settings.path is not None
        self.settings = settings
        self.router = router
        self.writer = ComparisonLog(
            settings.path,
            max_bytes=settings.max_bytes,
            backups=settings.backups,
            mode=0o600,
            name="enginemeter-request-log",
        )
        self._routes: dict[str, int | None] = {}

    def route_of(self, model: str) -> int | None:
        """The route index a model label maps to (labels are a bounded set: cached)."""
        if model not in self._routes:
            try:
                self._routes[model] = self.router.route_for(None if model == "other" else model)[0]
            except NotFound:
                self._routes[model] = None
        return self._routes[model]

    def on_attempt(self, attempt: Attempt) -> None:
        """``Attempts.on_new`` hook (record_text only): keep the output text and the client's prompt."""
        attempt.collect_text = True
        ctx = current()
        if ctx is not None and ctx.prompt is None:
            body = attempt.norm.body
            ctx.prompt = body.get("messages", body.get("prompt"))

    def on_result(self, r: Result) -> None:
        rec = to_record(r, route=self.route_of(r.model))
        ctx = current()
        ticket = ctx.rollout if ctx is not None else None
        rec["rollout"] = ticket.record() if ticket is not None else None
        mark = ctx.swap if ctx is not None else None
        rec["swap"] = mark.record() if mark is not None else None
        if self.settings.record_text:
            rec["prompt"] = ctx.prompt if ctx is not None else None
            rec["text"] = r.text
        self.writer.write(rec)

    def state(self) -> dict[str, Any]:
        w = self.writer
        return {"path": w.path, "written": w.written, "dropped": w.dropped, "errors": w.errors}

    def close(self) -> None:
        """Flush and stop the writer (blocking; at app shutdown)."""
        self.writer.close()
