"""One attempt on one engine, for the primary and the shadow alike: made by ``Attempts.new``, run by
``run_attempt``, ended by exactly one ``Result`` (``Attempts.record``).

``run_attempt`` is the one place that writes the sequence open -> status -> stream or body:

- ``Failed``: the engine could not be reached, or its body broke off before it was whole. Result emitted; the
  primary may fall back to its next engine (nothing reached the client).
- ``Answered``: an engine error body (normalized, its status kept) or a whole non-stream body. Result emitted.
- ``Streaming``: the stream is open and its first event is in; ``Attempt.relay(output)`` relays it and emits the
  Result at its end (``Attempt.close()`` if it never starts).

The primary turns the outcome into a Response (``Gateway.serve``); the shadow drains it (``drain``).
In flight (``enginemeter_requests_in_flight``) from ``Attempts.new`` until the attempt's one Result.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.config.settings import Settings
from proxy.errors import UpstreamError
from proxy.normalize import ParamChange, normalize_request, param_label
from proxy.server.record.metrics import Metrics, child, observe
from proxy.server.record.result import Result
from proxy.server.request.output import DISCARD
from proxy.server.request.relay import Attempt
from proxy.server.request.upstream import Engine, StreamClient
from proxy.timing import StreamTimer
from proxy.types import Endpoint, Role

log = logging.getLogger("enginemeter")


@dataclass(frozen=True, slots=True)
class Failed:
    """Nothing usable came back (transport error, broken body); the Result is emitted."""

    error: UpstreamError


@dataclass(frozen=True, slots=True)
class Answered:
    """A whole answer: the engine's error body (``engine_error``) or its non-stream body; the Result is emitted."""

    status: int
    body: bytes
    engine_error: bool


@dataclass(frozen=True, slots=True)
class Streaming:
    """The stream is open; ``attempt.relay(output)`` owns the rest and emits the Result."""

    attempt: Attempt


Opened = Failed | Answered | Streaming


async def run_attempt(attempt: Attempt) -> Opened:
    """Open the attempt and take it as far as the caller needs. Raises only what is not an upstream failure
    (cancellation): the caller then ends the attempt (``finish``) with its own outcome."""
    try:
        await attempt.open()
    except UpstreamError as exc:
        attempt.finish(exc.outcome, exc.message)
        return Failed(exc)
    if attempt.failed_status:
        body = await attempt.error_response_body()
        attempt.finish()
        return Answered(attempt.status, body, engine_error=True)
    if attempt.norm.stream:
        return Streaming(attempt)
    try:
        data = await attempt.read_body()
    except UpstreamError as exc:
        attempt.finish(exc.outcome, exc.message)
        return Failed(exc)
    attempt.finish()
    return Answered(attempt.status, data, engine_error=False)


async def drain(attempt: Attempt) -> None:
    """Run an attempt to its end, discarding what the engine sends (a shadow copy)."""
    if isinstance(await run_attempt(attempt), Streaming):
        await attempt.relay(DISCARD)


class Attempts:
    """Makes attempts (normalized for their engine, counted in flight) and records their Results.

    ``observers`` get every Result after the metrics (the mirror's pairing, the request log; tests): a failing
    observer is logged and never touches the traffic. ``on_new`` hooks see every attempt as it is made, before it
    opens (trace headers, spans, the timings flag); they run on the request's path, so they stay O(1).
    """

    def __init__(self, settings: Settings, engines: Mapping[str, Engine], metrics: Metrics) -> None:
        self.settings = settings
        self.engines = engines
        self.metrics = metrics
        self.aliases = {m.alias: m for m in settings.models}
        self.observers: list[Callable[[Result], None]] = []
        self.on_new: list[Callable[[Attempt], None]] = []
        #: whether the event loop stalled since a time (``LoopWatch.stalled_since``), told to every attempt
        self.stalled_since: Callable[[int], bool] | None = None

    def model_label(self, model: str | None) -> str:
        """Bounded metric label: a configured alias or an engine's served name, else ``other``."""
        if model is None:
            return "other"
        if model in self.aliases:
            return model
        if any(e.model == model for e in self.engines.values()):
            return model
        return "other"

    def served_model(self, alias: str | None, engine: Engine) -> str | None:
        a = self.aliases.get(alias or "")
        if a is not None and engine.name in a.engines:
            return a.engines[engine.name]
        return engine.model or alias

    def _count_changes(self, engine: str, changes: tuple[ParamChange, ...]) -> None:
        """What normalization changed in the request (``enginemeter_param_changes_total``). Counted once the
        request is written (``Attempt.deferred``): off the path to the engine's first byte."""
        for ch in changes:
            child(self.metrics, self.metrics.params, engine, param_label(ch.param), ch.action).inc()

    def record(self, result: Result) -> None:
        """Every attempt's one Result: the attempt leaves the in-flight gauge, metrics, then observers."""
        child(self.metrics, self.metrics.in_flight, result.engine, result.role).dec()
        observe(self.metrics, result)
        for observer in self.observers:
            try:
                observer(result)
            except Exception:
                log.exception("result observer failed")

    def new(
        self,
        *,
        request_id: str,
        endpoint: Endpoint,
        engine: Engine,
        role: Role,
        body: dict[str, Any],
        timer: StreamTimer,
        collect_text: bool = False,
        streams: StreamClient | None = None,
        client_request_id: str | None = None,
    ) -> Attempt:
        """An attempt of ``body`` on ``engine``, sent through ``streams`` (default: the engine's own pool)."""
        client_model = body.get("model") if isinstance(body.get("model"), str) else None
        norm = normalize_request(
            body,
            endpoint=endpoint,
            kind=engine.effective_kind,
            served_model=self.served_model(client_model, engine),
            defaults=self.settings.sampling_defaults,
        )
        attempt = Attempt(
            request_id=request_id,
            endpoint=endpoint,
            engine=engine,
            streams=streams if streams is not None else engine.streams,
            role=role,
            model_label=self.model_label(client_model),
            client_model=client_model,
            norm=norm,
            timer=timer,
            on_result=self.record,
            collect_text=collect_text,
            client_request_id=client_request_id,
            deferred=functools.partial(self._count_changes, engine.name, norm.changes) if norm.changes else None,
            stalled_since=self.stalled_since,
        )
        for hook in self.on_new:
            try:
                hook(attempt)
            except Exception:
                log.exception("attempt hook failed")
        # in flight from here until its one Result (record), whichever path ends it
        child(self.metrics, self.metrics.in_flight, engine.name, role).inc()
        return attempt
