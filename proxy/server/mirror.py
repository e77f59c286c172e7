"""Shadow mirroring: a copy of a routed request goes to each shadow engine, timed like the primary, compared.

Guarantees (each one is tested in tests/test_mirror.py):

- **The primary never waits.** ``submit()`` is synchronous and O(shadows): it draws the sample, checks the
  bounds and spawns one referenced task per shadow copy (held in ``Mirror._tasks``). Nothing on the primary's path
  awaits the shadow; the shadow's failures are recorded as its Result's outcome, never raised.
- **Own pool.** Every shadow engine gets its own stream client (``H1Streams``; pool size
  ``mirror.max_in_flight``), so a slow or hanging shadow cannot hold connections the primary needs, even when
  the same engine is a primary on another route.
- **Bounded.** At most ``mirror.max_in_flight`` copies per shadow engine are in flight; when full the copy is
  dropped (``enginemeter_mirror_requests_total{result="dropped_full"}``), never queued.
- **Timed the same way.** The copy is an ``Attempt`` from ``Attempts.new`` (normalized for the shadow's
  kind) with ``role="shadow"``, run by the primary's ``run_attempt`` and drained to the end (``drain``); its one
  Result feeds the same metrics.
- **Bounded in time, independent of the client.** Each copy has ``mirror.timeout`` seconds in all (outcome
  ``timeout`` after that); it lives in its own task, so the client hanging up does not cancel it.
- **Only generation endpoints** (chat, completions) are mirrored.
- **Switchable at run time:** ``enabled`` and per-route ``sample_rate`` (``set()``, used by /admin/mirror).

``result`` label of ``enginemeter_mirror_requests_total`` (a closed set): ``sent``, ``dropped_disabled``,
``dropped_sampled``, ``dropped_full``, ``dropped_endpoint``, ``failed`` (the copy could not even be built —
a bug, logged), ``unpaired`` (the pair never completed within its expiry: a half was lost).

Pairing: Results arrive through ``on_result`` (an ``Attempts`` observer, wired by ``build_app``) and are matched by request id in a bounded table.
The primary half is the *last* primary Result of the request: a primary that failed before any token on an
engine with fallbacks after it is held as tentative, since the next engine may still serve. A pair is
compared as soon as the final primary and a shadow are both in; entries expire ``mirror.timeout + 60 s``
after the request (tentative halves are compared then), and the table holds at most ``MAX_PENDING`` entries
(the oldest is evicted). Lost halves are counted ``unpaired``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from proxy.errors import BadRequest
from proxy.server.attempt import Attempts, drain
from proxy.server.compare import ComparisonLog, compare, observe_comparison, to_record
from proxy.server.h1 import H1Streams
from proxy.server.metrics import Metrics
from proxy.server.relay import Attempt
from proxy.server.result import Result
from proxy.server.routing import Decision
from proxy.server.upstream import Engine, StreamClient
from proxy.settings import Settings
from proxy.timing import StreamTimer
from proxy.types import Endpoint

log = logging.getLogger("enginemeter.mirror")

MIRRORED_ENDPOINTS: frozenset[str] = frozenset({"chat", "completions"})
RESULTS = (
    "sent",
    "dropped_disabled",
    "dropped_sampled",
    "dropped_full",
    "dropped_endpoint",
    "failed",
    "unpaired",
)
PAIR_GRACE_S = 60.0
MAX_PENDING = 10_000
SWEEP_INTERVAL_S = 1.0
#: a primary with one of these outcomes and no token may be followed by a fallback attempt
_FALLBACK_OUTCOMES = frozenset({"connect_error", "timeout", "upstream_broken", "engine_error"})


@dataclass
class _Pending:
    created: float  # time.monotonic()
    engines: tuple[str, ...]  # the decision's serving engine + fallbacks
    expected: set[str]  # shadow engines whose Result is still to be compared
    shadows: dict[str, Result] = field(default_factory=dict)
    primary: Result | None = None
    primary_final: bool = False
    prompt: Any = None


def _primary_is_final(r: Result, engines: tuple[str, ...]) -> bool:
    if r.outcome not in _FALLBACK_OUTCOMES or r.n_token_events > 0:
        return True
    if r.outcome == "engine_error" and 0 < r.status < 500:
        return True  # 4xx: the proxy does not fall back
    return not engines or r.engine == engines[-1]


class Mirror:
    def __init__(
        self,
        settings: Settings,
        engines: Mapping[str, Engine],
        attempts: Attempts,
        metrics: Metrics,
        *,
        gpus_of: Callable[[str], Sequence[int]] | None = None,
    ) -> None:
        s = settings.mirror
        #: engine -> GPU indices it holds memory on (the GPU monitor's cached attribution; None: no GPU data)
        self.gpus_of = gpus_of
        self.settings = settings
        self.engines = engines
        self.attempts = attempts
        self.metrics = metrics
        self.enabled = s.enabled
        self.rates: list[float] = [r.sample_rate for r in settings.routes]
        self.max_in_flight = s.max_in_flight
        self.timeout = s.timeout
        self.record_text = s.record_text
        self.in_flight: dict[str, int] = {}
        self.counts: dict[str, int] = dict.fromkeys(RESULTS, 0)
        self.compared = 0
        self.log: ComparisonLog | None = None
        self._streams: dict[str, StreamClient] = {}
        self._pending: dict[str, _Pending] = {}
        self._rng = random.Random()
        self._tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------------------------ control

    def set(self, *, enabled: bool | None = None, sample_rate: float | None = None, route: int | None = None) -> None:
        """Change mirroring at run time. ``sample_rate`` applies to ``route`` (an index), or to all routes."""
        if sample_rate is not None:
            if not 0.0 <= sample_rate <= 1.0:
                raise BadRequest("`sample_rate` must be within [0, 1]", param="sample_rate")
            if route is not None and not 0 <= route < len(self.rates):
                raise BadRequest(f"`route` must index the {len(self.rates)} configured routes", param="route")
        elif route is not None:
            raise BadRequest("`route` needs `sample_rate`", param="route")
        if enabled is not None:
            self.enabled = enabled
        if sample_rate is not None:
            for i in range(len(self.rates)) if route is None else (route,):
                self.rates[i] = sample_rate
        log.info("mirroring: enabled=%s rates=%s", self.enabled, self.rates)

    def state(self) -> dict[str, Any]:
        routes = self.settings.routes
        return {
            "enabled": self.enabled,
            "max_in_flight": self.max_in_flight,
            "timeout_s": self.timeout,
            "routes": [
                {"route": i, "models": list(r.models), "shadows": list(r.shadows), "sample_rate": self.rates[i]}
                for i, r in enumerate(routes)
            ],
            "in_flight": {name: n for name, n in self.in_flight.items()},
            "sent": self.counts["sent"],
            "dropped": {k: v for k, v in self.counts.items() if k.startswith("dropped_")},
            "failed": self.counts["failed"],
            "unpaired": self.counts["unpaired"],
            "pending_pairs": len(self._pending),
            "compared": self.compared,
            "log": None
            if self.log is None
            else {"path": self.log.path, "written": self.log.written, "dropped": self.log.dropped},
        }

    # ------------------------------------------------------------------------------------ dispatch

    def _count(self, engine: str, result: str, n: int = 1) -> None:
        self.counts[result] += n
        self.metrics.mirror.labels(engine, result).inc(n)

    def submit(
        self,
        decision: Decision,
        body: Mapping[str, Any],
        endpoint: Endpoint,
        request_id: str,
        client_request_id: str | None = None,
    ) -> bool:
        """Called on the primary's path before its attempt; never awaits, never raises. True = copies sent."""
        try:
            return self._submit(decision, body, endpoint, request_id, client_request_id)
        except Exception:
            log.exception("mirroring %s failed", request_id)
            return False

    def _submit(
        self,
        decision: Decision,
        body: Mapping[str, Any],
        endpoint: Endpoint,
        request_id: str,
        client_request_id: str | None,
    ) -> bool:
        shadows = decision.shadows
        if not shadows:
            return False
        if endpoint not in MIRRORED_ENDPOINTS:
            for name in shadows:
                self._count(name, "dropped_endpoint")
            return False
        if not self.enabled:
            for name in shadows:
                self._count(name, "dropped_disabled")
            return False
        rate = self.rates[decision.route] if decision.route < len(self.rates) else decision.sample_rate
        if rate < 1.0 and self._rng.random() >= rate:
            for name in shadows:
                self._count(name, "dropped_sampled")
            return False
        self.sweep()  # cheap (looks at the oldest entry); the lifespan's sweeper covers idle periods
        sent: list[str] = []
        for name in shadows:
            if self.in_flight.get(name, 0) >= self.max_in_flight:
                self._count(name, "dropped_full")
                continue
            sent.append(name)
        if not sent:
            return False
        self._add_pending(
            request_id,
            _Pending(
                created=time.monotonic(),
                engines=decision.engines,
                expected=set(sent),
                prompt=(body.get("messages", body.get("prompt")) if self.record_text else None),
            ),
        )
        for name in sent:
            self.in_flight[name] = self.in_flight.get(name, 0) + 1
            self._count(name, "sent")
            # the copy's clock starts now, when it is made, as the primary's started on receipt; the task is
            # referenced until done (a bare create_task can be garbage-collected)
            task = asyncio.ensure_future(
                self._shadow(name, dict(body), endpoint, request_id, StreamTimer(), client_request_id)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return True

    def _pool(self, engine: Engine) -> StreamClient:
        streams = self._streams.get(engine.name)
        if streams is None:
            streams = self._streams[engine.name] = H1Streams(
                engine.settings, self.max_in_flight, keep_alive=engine.keeps_alive
            )
        return streams

    async def _shadow(
        self,
        name: str,
        body: dict[str, Any],
        endpoint: Endpoint,
        request_id: str,
        timer: StreamTimer,
        client_request_id: str | None = None,
    ) -> None:
        attempt: Attempt | None = None
        task = asyncio.current_task()
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            if attempt is not None and attempt.outcome is None:
                attempt.outcome = "timeout"
                attempt.error = f"shadow copy exceeded mirror.timeout ({self.timeout:g} s)"
            if task is not None:
                task.cancel()

        handle = asyncio.get_running_loop().call_later(self.timeout, expire)
        try:
            engine = self.engines[name]
            # what probing learned about the engine, through the mirror's own pool
            attempt = self.attempts.new(
                request_id=request_id,
                client_request_id=client_request_id,
                endpoint=endpoint,
                engine=engine,
                role="shadow",
                body=body,
                timer=timer,
                collect_text=True,
                streams=self._pool(engine),
            )
            await drain(attempt)
        except asyncio.CancelledError:
            if not expired:
                if attempt is not None and attempt.outcome is None:
                    attempt.outcome = "client_disconnect"  # shut down with the proxy
                raise
            if task is not None:
                task.uncancel()  # our own deadline, not a shutdown: end quietly
        except Exception as exc:
            if attempt is None:
                self._count(name, "failed")
                self._forget(request_id, name)
            else:
                attempt.finish("upstream_broken", f"{type(exc).__name__}: {exc}")
            log.exception("shadow copy of %s to %s failed", request_id, name)
        finally:
            handle.cancel()
            if attempt is not None:
                attempt.finish()  # idempotent: a copy cut off while opening still yields its one Result
            self.in_flight[name] -= 1

    # ------------------------------------------------------------------------------------- pairing

    def _add_pending(self, request_id: str, entry: _Pending) -> None:
        old = self._pending.pop(request_id, None)
        if old is not None:  # a client reused its x-request-id while the first was pending
            self._expire(request_id, old)
        while len(self._pending) >= MAX_PENDING:
            key = next(iter(self._pending))
            self._expire(key, self._pending.pop(key))
        self._pending[request_id] = entry

    def _forget(self, request_id: str, shadow: str) -> None:
        e = self._pending.get(request_id)
        if e is not None:
            e.expected.discard(shadow)
            if not e.expected:
                del self._pending[request_id]

    def on_result(self, r: Result) -> None:
        e = self._pending.get(r.request_id)
        if e is None:
            return
        if r.role == "primary":
            e.primary = r
            e.primary_final = _primary_is_final(r, e.engines)
        elif r.role == "shadow" and r.engine in e.expected:
            e.shadows[r.engine] = r
        else:
            return
        if e.primary is not None and e.primary_final:
            self._pair(e)
            if not e.expected:
                self._pending.pop(r.request_id, None)

    def _pair(self, e: _Pending) -> None:
        assert e.primary is not None
        for name, shadow in list(e.shadows.items()):
            del e.shadows[name]
            e.expected.discard(name)
            self._emit(e, e.primary, shadow)

    def _emit(self, e: _Pending, primary: Result, shadow: Result) -> None:
        c = compare(primary, shadow)
        self.compared += 1
        observe_comparison(self.metrics, c)
        gpus: dict[str, Sequence[int]] | None = None
        if self.gpus_of is not None:
            gpus = {"primary": self.gpus_of(primary.engine), "shadow": self.gpus_of(shadow.engine)}
            if gpus["primary"] or gpus["shadow"]:
                shared = bool(set(gpus["primary"]) & set(gpus["shadow"]))
                self.metrics.contended.labels(primary.engine, shadow.engine).set(1 if shared else 0)
            else:
                gpus = None  # no attribution (no NVML, remote engines): say nothing rather than "not contended"
        if self.log is not None:
            text = self.record_text
            self.log.write(
                to_record(
                    c,
                    prompt=e.prompt if text else None,
                    primary_text=primary.text if text else None,
                    shadow_text=shadow.text if text else None,
                    gpus=gpus,
                )
            )

    def _expire(self, key: str, e: _Pending) -> None:
        if e.primary is not None:
            self._pair(e)  # a tentative primary: nothing better came
        for name in e.expected:
            self._count(name, "unpaired")
        e.expected.clear()

    def sweep(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        ttl = self.timeout + PAIR_GRACE_S
        while self._pending:
            key, e = next(iter(self._pending.items()))
            if now - e.created < ttl:
                break  # insertion order is creation order
            del self._pending[key]
            self._expire(key, e)

    # ----------------------------------------------------------------------------------- lifecycle

    @asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """Held for the app's lifetime: opens the log, sweeps expired pairs; on exit ends the copies still
        in flight (outcome ``client_disconnect``), then closes the mirror's pools and flushes the log."""
        s = self.settings.mirror
        if s.log_path:
            self.log = ComparisonLog(s.log_path, max_bytes=s.log_max_bytes, backups=s.log_backups)
        sweeper = asyncio.ensure_future(self._sweep_forever())
        try:
            yield
        finally:
            sweeper.cancel()
            tasks = list(self._tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(sweeper, *tasks, return_exceptions=True)
            pools, self._streams = list(self._streams.values()), {}
            await asyncio.gather(*(p.aclose() for p in pools), return_exceptions=True)
            if self.log is not None:
                await asyncio.to_thread(self.log.close)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)  # a periodic timer, not a synchronisation
            self.sweep()
