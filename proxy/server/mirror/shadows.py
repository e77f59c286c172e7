"""Shadow mirroring: a copy of a routed request goes to each shadow engine, timed like the primary, compared.

Guarantees (each one is tested in tests/server/mirror/test_mirror.py):

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
``dropped_sampled``, ``dropped_full``, ``dropped_endpoint``, ``dropped_header``, ``failed`` (the copy could not even be built —
a bug, logged), ``unpaired`` (the pair never completed within its expiry: a half was lost).

Pairing: Results arrive through ``on_result`` (an ``Attempts`` observer, wired by ``build_app``) and are matched
by request id in the bounded table of ``proxy.server.mirror.pairing`` (expiry ``mirror.timeout + 60 s``; lost halves
counted ``unpaired``).

**Runs.** Each proxy run has an id (``Settings.run_id``, made by ``enginemeter serve`` so every worker shares it;
else one is drawn here). With a log, the run starts it with a ``run`` record (its pairs, engines, listen
address), every pair record carries it, an ``engine`` record follows when the engine-state poller learns an
engine's facts (model path, quantization, context, slots), and an ``end`` record closes it with the mirror's
counts. ``enginemeter report --log`` reads the latest run unless told otherwise.

**Opt-out.** A request with ``x-enginemeter-mirror: off`` (``Dispatch.mirror``) is served and not copied
(``dropped_header``): the bench sends it, so its requests stay out of the shadow and the log.

**Rollouts.** A route's rollout (``proxy.server.switch.rollout``) adds the other engine of its pair to
``Dispatch.shadows``; the entry carries the request's ``Dispatch.rollout`` and ``pair_observers`` get every
comparable pair, so the rollout judges its own pairs with the same figures.

**Live verdict.** Every comparable pair feeds its engine pair's ``proxy.sequential.LiveVerdict`` (anytime-valid
intervals per regime); ``state()["live"]`` (in ``/health`` and ``/admin/mirror``) says what is decided so far.
With ``serve --workers`` each worker's is its own share of the traffic.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

from proxy.config.settings import Settings
from proxy.errors import BadRequest
from proxy.sequential import LiveVerdict, Regime, regime_of
from proxy.server.mirror.compare import (
    ComparisonLog,
    PairComparison,
    compare,
    end_record,
    new_run_id,
    observe_comparison,
    to_record,
)
from proxy.server.mirror.pairing import PairTable, Pending
from proxy.server.mirror.runlog import RunRecords
from proxy.server.record.metrics import Metrics
from proxy.server.record.result import Result
from proxy.server.request.attempts import Attempts, drain
from proxy.server.request.h1 import H1Streams
from proxy.server.request.relay import Attempt
from proxy.server.request.routing import Dispatch
from proxy.server.request.upstream import Engine, StreamClient
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
    "dropped_header",
    "failed",
    "unpaired",
)
PAIR_GRACE_S = 60.0
SWEEP_INTERVAL_S = 1.0


class Mirror:
    def __init__(
        self,
        settings: Settings,
        engines: Mapping[str, Engine],
        attempts: Attempts,
        metrics: Metrics,
        *,
        gpus_of: Callable[[str], Sequence[int]] | None = None,
        facts_of: Callable[[str], Any] | None = None,
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
        self.run_id = settings.run_id or new_run_id()
        self.started = time.time()
        self.min_effect = s.min_effect
        self.in_flight: dict[str, int] = {}
        self.counts: dict[str, int] = dict.fromkeys(RESULTS, 0)
        self.compared = 0
        self.log: ComparisonLog | None = None
        self.live: dict[tuple[str, str], LiveVerdict] = {}
        #: called with every comparable pair (its entry, comparison, regime): the rollouts' statistics
        self.pair_observers: list[Callable[[Pending, PairComparison, Regime | None], None]] = []
        self.pairs = PairTable(self.timeout + PAIR_GRACE_S, self._emit, lambda name: self._count(name, "unpaired"))
        #: the log's run and engine records (``facts_of``: engine -> its latest engine-state poll)
        self.records = RunRecords(settings, engines, self.run_id, self.started, facts_of)
        self._streams: dict[str, StreamClient] = {}
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
            "run": self.run_id,
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
            "pending_pairs": len(self.pairs),
            "compared": self.compared,
            "log": None
            if self.log is None
            else {"path": self.log.path, "written": self.log.written, "dropped": self.log.dropped},
            "live": [v.to_json() for v in self.live.values()],
        }

    # ------------------------------------------------------------------------------------ dispatch

    def _count(self, engine: str, result: str, n: int = 1) -> None:
        self.counts[result] += n
        self.metrics.mirror.labels(engine, result).inc(n)

    def submit(
        self,
        decision: Dispatch,
        body: Mapping[str, Any],
        endpoint: Endpoint,
        request_id: str,
        client_request_id: str | None = None,
        received_ns: int | None = None,
    ) -> bool:
        """Called on the primary's path before its attempt; never awaits, never raises. True = copies sent.
        ``received_ns``: the primary's ``t_received_ns`` (``perf_counter_ns``), the pair's start (``t_start``);
        None: now."""
        try:
            return self._submit(decision, body, endpoint, request_id, client_request_id, received_ns)
        except Exception:
            log.exception("mirroring %s failed", request_id)
            return False

    def _drop(self, shadows: Sequence[str], why: str) -> bool:
        for name in shadows:
            self._count(name, why)
        return False

    def _submit(
        self,
        decision: Dispatch,
        body: Mapping[str, Any],
        endpoint: Endpoint,
        request_id: str,
        client_request_id: str | None,
        received_ns: int | None = None,
    ) -> bool:
        shadows = decision.shadows
        if not shadows:
            return False
        if endpoint not in MIRRORED_ENDPOINTS:
            return self._drop(shadows, "dropped_endpoint")
        if not decision.mirror:
            return self._drop(shadows, "dropped_header")
        if not self.enabled:
            return self._drop(shadows, "dropped_disabled")
        rate = self.rates[decision.route] if decision.route < len(self.rates) else decision.sample_rate
        if rate < 1.0 and self._rng.random() >= rate:
            return self._drop(shadows, "dropped_sampled")
        self.sweep()  # cheap (looks at the oldest entry); the lifespan's sweeper covers idle periods
        sent: list[str] = []
        for name in shadows:
            if self.in_flight.get(name, 0) >= self.max_in_flight:
                self._count(name, "dropped_full")
                continue
            sent.append(name)
        if not sent:
            return False
        # the wall time the primary was received, as its e2e_s counts from: the log's intervals (start, start +
        # e2e_s) are where the requests were, not late by the body read, the routing and a wait for the loop
        waited_ns = max(0, time.perf_counter_ns() - received_ns) if received_ns is not None else 0
        self.pairs.add(
            request_id,
            Pending(
                created=time.monotonic(),
                engines=decision.engines,
                expected=set(sent),
                prompt=(body.get("messages", body.get("prompt")) if self.record_text else None),
                t_start=time.time() - waited_ns / 1e9,
                rollout=decision.rollout,
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

    def on_attempt(self, attempt: Attempt) -> None:
        """An ``Attempts.on_new`` hook: keeps the normalized request of each side of a mirrored request (one dict
        lookup per attempt), so its pair record says what sampling each engine really got."""
        e = self.pairs.get(attempt.request_id)
        if e is not None:
            e.norms[(attempt.role, attempt.engine.name)] = attempt.norm

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
                self.pairs.forget(request_id, name)
            else:
                attempt.finish("upstream_broken", f"{type(exc).__name__}: {exc}")
            log.exception("shadow copy of %s to %s failed", request_id, name)
        finally:
            handle.cancel()
            if attempt is not None:
                attempt.finish()  # idempotent: a copy cut off while opening still yields its one Result
            self.in_flight[name] -= 1

    # ------------------------------------------------------------------------------------- pairing

    def on_result(self, r: Result) -> None:
        self.pairs.on_result(r)

    def sweep(self, now: float | None = None) -> None:
        self.pairs.sweep(now)

    def _emit(self, e: Pending, primary: Result, shadow: Result, concurrency: tuple[int, int]) -> None:
        c = compare(primary, shadow)
        self.compared += 1
        observe_comparison(self.metrics, c)
        if c.comparable:
            key = (primary.engine, shadow.engine)
            live = self.live.get(key)
            if live is None:
                live = self.live[key] = LiveVerdict(*key, min_effect=self.min_effect)
            p, s = c.primary, c.shadow
            regime = regime_of(concurrency[1], p.prompt_tokens)
            live.add(regime, _figures(p), _figures(s))
            for stream, cs in live.streams.items():
                if stream.regime == regime:
                    self.metrics.observe_live(*key, stream, cs.state())
            for observe in self.pair_observers:
                try:
                    observe(e, c, regime)
                except Exception:
                    log.exception("pair observer failed")
        gpus: dict[str, Sequence[int]] | None = None
        if self.gpus_of is not None:
            gpus = {"primary": self.gpus_of(primary.engine), "shadow": self.gpus_of(shadow.engine)}
            if gpus["primary"] or gpus["shadow"]:
                shared = bool(set(gpus["primary"]) & set(gpus["shadow"]))
                self.metrics.contended.labels(primary.engine, shadow.engine).set(1 if shared else 0)
            else:
                gpus = None  # no attribution (no NVML, remote engines): say nothing rather than "not contended"
        if self.log is None:
            return
        for rec in self.records.new_facts(primary.engine, shadow.engine):
            self.log.write(rec)
        text = self.record_text
        norms = {
            role: n
            for role, n in (
                ("primary", e.norms.get(("primary", primary.engine))),
                ("shadow", e.norms.get(("shadow", shadow.engine))),
            )
            if n is not None
        }
        self.log.write(
            to_record(
                c,
                prompt=e.prompt if text else None,
                primary_text=primary.text if text else None,
                shadow_text=shadow.text if text else None,
                gpus=gpus,
                run=self.run_id,
                t_start=e.t_start,
                concurrency=concurrency,
                sampling=norms,
            )
        )

    # ----------------------------------------------------------------------------------- lifecycle

    @asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        """Held for the app's lifetime: opens the log (its run record first), sweeps expired pairs; on exit ends
        the copies still in flight (outcome ``client_disconnect``), closes the mirror's pools, writes the run's
        ``end`` record and flushes the log."""
        s = self.settings.mirror
        if s.log_path:
            mirrored = any(r.shadows for r in self.settings.routes)
            header = self.records.header if mirrored else None
            self.log = ComparisonLog(s.log_path, max_bytes=s.log_max_bytes, backups=s.log_backups, header=header)
            if mirrored:
                self.log.write(self.records.run())
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
                if any(r.shadows for r in self.settings.routes):
                    self.log.write(end_record(self.run_id, self.counts, self.compared))
                await asyncio.to_thread(self.log.close)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)  # a periodic timer, not a synchronisation
            self.sweep()


def _figures(side: Any) -> dict[str, Any]:
    """The figures a live-verdict stream reads, from a ``compare.Side``."""
    return {
        "upstream_ttft_s": side.upstream_ttft_s,
        "ttft_s": side.ttft_s,
        "tpot_s": side.tpot_s,
        "e2e_s": side.e2e_s,
        "completion_tokens": side.completion_tokens,
    }
