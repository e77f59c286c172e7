"""The event loop's own health, so that a saturated proxy shows itself (docs/metrics.md, "The event loop"), and the
garbage collector and the GIL set up for a long-running server (``settle_process``).

Every stream the proxy relays waits whenever its one event loop is busy with something else: a request start, a
garbage collection, a large body, a neighbour's process on the same core. Those waits reach no request's timer
(the chunk's timestamp is taken when the loop gets to the read), so they are measured here:

- **lag**: a timer every ``PROBE_INTERVAL_S`` on the loop; how late it fires is how long the loop was busy
  (``enginemeter_event_loop_lag_seconds``). One timer handle a probe; nothing per request or chunk. libuv's
  timers are millisecond-grained: an idle loop shows 0-1 ms.
- **queued**: the server's protocol calls ``accepted(scope)`` when it has parsed a request's head (and stamps the
  scope with the time: the request's ``t_received_ns``); the app calls ``started(scope)`` when its handler runs.
  ``enginemeter_requests_queued`` is the number in between, ``enginemeter_request_queue_seconds`` the wait.
- **stalls**: a probe ``STALL_S`` late or more is a stall; ``stalled_since(t_ns)`` tells whether one ended after
  ``t_ns`` or is under way now. Each request's Result carries it (``loop_stalled``): a request timed across a stall
  holds the proxy's wait in its figures, which the swap's watch states beside its decision
  (``proxy.server.switch.swapwatch``). A stall shorter than ``PROBE_INTERVAL_S`` is seen only when it spans a probe;
  a starved host's (seconds) always is.
- **garbage collection**: a ``gc.callbacks`` hook times every collection; the probe moves the pauses into
  ``enginemeter_gc_pause_seconds``. The hook only appends to a list: a collection can start inside any
  allocation, even one made under prometheus-client's (non-reentrant) lock.

``settle_process()`` (``enginemeter serve``, once the server has started) sets the process up for a long run:

- ``gc.freeze()`` moves every object made at start-up (modules, settings, the app, ~70,000 objects) into the
  permanent generation, so that a full collection scans only what was made since (of that heap unfrozen it took
  11.6-13.1 ms on the 2-core VM, frozen ~0: docs/performance.md). The thresholds stay CPython's (700, 10, 10): with no reference
  cycle left per request, collections are rare at either (at 32 streams, 9 young ones and 1 middle one in 15 s
  of 0.4 ms and 1.0 ms at most; none at 7,000), and a higher threshold only makes each one scan more.
- the GIL's switch interval goes from 5 ms to ``SWITCH_INTERVAL_S``: the work the proxy keeps off the loop in
  threads (the ``/metrics`` exposition, the request log's writer) still takes the GIL, and the loop got it back
  only every 5 ms (a scrape of 1 MB of series held the loop 5.7 ms at a time; 1.2 ms at 0.5 ms: ``perf/loopcost.py``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from starlette.types import Scope

from proxy.server.record.metrics import Metrics, observe_one

log = logging.getLogger("enginemeter")

#: seconds between two lag probes
PROBE_INTERVAL_S = 0.1
#: a probe this late or more: the loop stalled (its host's CPU, a collection, a large body); an idle loop is 0-1 ms
#: late, a request's first token on a GPU engine tens of ms
STALL_S = 0.02
#: the scope key the server's protocol stamps with the request head's ``perf_counter_ns``
T_RECEIVED = "enginemeter.t_received_ns"
#: the scope key ``started`` stamps with the handler's start
T_HANDLER = "enginemeter.t_handler_ns"
#: the GIL's switch interval under ``enginemeter serve`` (CPython's default: 5 ms)
SWITCH_INTERVAL_S = 0.0005
#: GC pauses kept between two probes at most (a flood of collections must not grow the list without bound)
MAX_PENDING_PAUSES = 10_000


def settle_process() -> int:
    """Freeze what start-up made, shorten the GIL's switch interval (module docstring); returns the number of
    objects frozen. Call once the server serves (after the app's start-up), in the process that runs it."""
    gc.collect()  # what start-up left as garbage goes now, not into the permanent generation
    gc.freeze()
    frozen = gc.get_freeze_count()
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    log.info("gc: %d start-up objects frozen (gc.freeze); GIL switch interval %g ms", frozen, SWITCH_INTERVAL_S * 1e3)
    return frozen


class LoopWatch:
    """The lag probe, the queued-request count and the GC pauses of one event loop (module docstring)."""

    def __init__(self, metrics: Metrics, interval: float = PROBE_INTERVAL_S) -> None:
        self.interval = interval
        self._lag = metrics.loop_lag
        self._queued = metrics.queued
        self._wait = metrics.handler_wait
        self._gc = tuple(metrics.gc_pause.labels(str(g)) for g in range(3))
        #: the loop being watched (set while ``running``; a test may schedule work on it)
        self.loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._gc_t0 = 0
        self._pauses: list[tuple[int, int]] = []
        #: ``perf_counter_ns`` when the last stall's probe fired (its end)
        self._stall_end_ns = 0

    # ---- per request (the server's protocol, then the app)

    def accepted(self, scope: Scope) -> None:
        """The server has parsed a request head (its protocol's ``on_headers_complete``)."""
        scope[T_RECEIVED] = time.perf_counter_ns()
        self._queued.inc()

    def started(self, scope: Scope) -> int:
        """The app's handler runs: the request leaves the queue. Returns its handler's start (``perf_counter_ns``,
        also stamped in the scope), or 0 when the server did not stamp the head (another server, a test's app)."""
        t_received = scope.get(T_RECEIVED)
        if t_received is None:
            return 0
        now = scope[T_HANDLER] = time.perf_counter_ns()
        self._queued.dec()
        observe_one(self._wait, (now - t_received) / 1e9)
        return now

    def stalled_since(self, t_ns: int) -> bool:
        """Whether the loop stalled after ``t_ns`` (``perf_counter_ns``): a stall's probe fired since, or one is
        under way now (due ``STALL_S`` ago or more, its probe not run yet). O(1): once per request, at its end."""
        if self._stall_end_ns > t_ns:
            return True
        loop = self.loop
        return loop is not None and loop.time() - self._due >= STALL_S

    # ---- the probe

    def _probe(self) -> None:
        loop = self.loop
        if loop is None:
            return
        now = loop.time()
        late = now - self._due
        observe_one(self._lag, late if late > 0.0 else 0.0)
        if late >= STALL_S:
            self._stall_end_ns = time.perf_counter_ns()
        if self._pauses:
            pauses, self._pauses = self._pauses, []
            for generation, ns in pauses:
                observe_one(self._gc[generation], ns / 1e9)
        self._due = now + self.interval
        self._handle = loop.call_at(self._due, self._probe)

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_t0 = time.perf_counter_ns()
        elif self._gc_t0 and len(self._pauses) < MAX_PENDING_PAUSES:
            self._pauses.append((info["generation"], time.perf_counter_ns() - self._gc_t0))

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Held for the app's lifetime: the probe on the running loop, the GC hook on the process."""
        loop = self.loop = asyncio.get_running_loop()
        self._due = loop.time() + self.interval
        self._handle = loop.call_at(self._due, self._probe)
        gc.callbacks.append(self._on_gc)
        try:
            yield
        finally:
            gc.callbacks.remove(self._on_gc)
            if self._handle is not None:
                self._handle.cancel()
            self.loop = None
