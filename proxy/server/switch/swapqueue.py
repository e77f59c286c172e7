"""One route's swap as one serving process sees it (``RouteSwap``): the phase, the hold queue, the probe of the
engine that starts serving, the requests in flight per engine, the watch's figures and this process's report.

The phase lives in the swap's shared state (``proxy.server.switch.swapstate``; the owner,
``proxy.server.switch.swapper``, writes it). A request reads the 8-byte generation and parses the document only
after it changed (``RouteSwap.ticket``): once per request, never per chunk. A request that arrives while no engine
can take it waits in this process's queue (``queue_max_requests`` at most, ``queue_max_wait_s`` each) and is served,
in arrival order, by whichever engine the phase ends with; past either bound, or at once while the swap is
``failed`` (no engine), it gets the proxy's 503 with ``Retry-After``. A client that hangs up while held leaves the
queue. Every request ends in one count: ``served``, ``rejected`` or ``hung_up`` (``held``: those that waited).

The first request of a phase in which an engine serves waits for that engine's probe (``probe``: its served model
name and kind, as ``serve`` probes a URL engine at start; started by the tick as the phase is seen, so usually done
before): a launched candidate is then sent the name it serves, never the client's (vLLM refuses any other).

Every ``REPORT_S`` (``FAST_REPORT_S`` while requests are held, ``WATCH_REPORT_S`` while watching) each process
writes its report into the document: its requests in flight per engine (the owner waits for the baseline's to reach
0 before stopping it), the end of the last answer per engine, the candidate's first answer, the baseline's window
and the candidate's sums for the watch (``proxy.server.switch.swapwatch``), and its counts. The document is read
defensively: a phase, plan or epoch that does not check out is logged and ignored (the last good state stays;
without one, the baseline serves).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from proxy.config.switching import SwapSettings
from proxy.errors import ProxyError
from proxy.server.record.result import Result
from proxy.server.record.sharedstate import StateFile
from proxy.server.switch.swapstate import PHASES, SERVING, SwapTicket, plan_, serving
from proxy.server.switch.swapwatch import Running, Window, figures_of, regime_of

log = logging.getLogger("enginemeter.swap")

REPORT_S = 1.0
WATCH_REPORT_S = 0.25
FAST_REPORT_S = 0.05
#: ``Retry-After`` when no engine will take the request soon: the swap ``failed``, or a pin to the engine it stopped
RETRY_LATER_S = 30.0
#: outcomes that are the engine's failure
FAILED = frozenset({"connect_error", "timeout", "upstream_broken"})


class SwapUnavailable(ProxyError):
    """No engine of a swapping route can take the request: the proxy's 503 with ``Retry-After``."""

    status = 503
    type = "enginemeter_error"

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.headers = {"retry-after": str(max(1, math.ceil(retry_after_s)))}


class SwapQueueFull(SwapUnavailable):
    """No engine can take the request now and the hold queue is full, or the request waited its longest."""


class SwapFailed(SwapUnavailable):
    """The route's swap is ``failed``: the baseline did not start again; no engine serves until an admin retry."""


@dataclass(slots=True)
class Mark:
    """What a request on a swap route carries (``RequestContext.swap``): the request log's ``swap`` field, and
    where the watch counts it."""

    route: int
    epoch: int
    phase: str
    engine: str
    side: str
    regime: str
    held_s: float = 0.0

    def record(self) -> dict[str, Any]:
        return {"phase": self.phase, "held_s": round(self.held_s, 4), "engine": self.engine, "regime": self.regime}


@dataclass
class RouteSwap:
    """One route's swap in this process: a view of its state file, the queue, and this process's report."""

    route: int
    baseline: str
    settings: SwapSettings
    path: Path
    slot: str
    file: StateFile | None = None
    _gen: bytes = b""
    _ticket: SwapTicket | None = None
    doc: dict[str, Any] = field(default_factory=dict)
    _open: asyncio.Event = field(default_factory=asyncio.Event)
    in_flight: dict[str, int] = field(default_factory=dict)
    client_in_flight: int = 0
    held: int = 0
    last_end: dict[str, float] = field(default_factory=dict)
    first_answer: float | None = None
    watch_epoch: int = -1
    #: the baseline's first answer once it serves again after a swap back (the ``rolled_back`` epoch's)
    back_first: float | None = None
    back_epoch: int = -1
    window: Window = field(default_factory=lambda: Window(200))
    cand: Running = field(default_factory=Running)
    counts: dict[str, float] = field(default_factory=dict)
    _reported: float = 0.0
    #: where a held request's wait goes (``enginemeter_swap_wait_seconds``)
    observe_wait: Callable[[float], None] | None = None
    #: learns an engine's served model name and kind (``probe_served``): once per phase, before it serves
    probe: Callable[[str], Awaitable[None]] | None = None
    _ready_epoch: int = -1
    _probing: tuple[int, asyncio.Future[None]] | None = None
    #: the report's write in its thread (the file is closed only once it is done)
    io: asyncio.Future[tuple[bytes, dict[str, Any]] | None] | None = None

    def __post_init__(self) -> None:
        self.plan = plan_(self.route, self.baseline, self.settings.candidate)
        self.window = Window(self.settings.baseline_window)
        self.counts = {"attempts": 0, "errors": 0, "served": 0, "held": 0, "held_seconds": 0.0, "rejected": 0}
        self.counts["hung_up"] = 0

    # ------------------------------------------------------------------------------- the request path

    def ticket(self) -> SwapTicket:
        """The phase to route this request under: an 8-byte compare; the file is read only after a change."""
        f = self.file
        if f is not None and (gen := f.gen()) != self._gen:
            self._gen = gen
            try:
                doc = f.read()[1]
                self._seen(doc)
            except (ValueError, TypeError, KeyError) as exc:
                log.error("swap of route %d: unreadable state (%s): keeping the last one", self.route, exc)
        return self._ticket or SwapTicket(self.route, -1, "baseline", self.baseline)

    def _seen(self, doc: dict[str, Any] | None) -> None:
        if doc is None or doc.get("plan") != self.plan:
            raise ValueError("another plan, or none")
        phase, epoch = doc.get("phase"), doc.get("epoch")
        if phase not in PHASES or not isinstance(epoch, int) or isinstance(epoch, bool):
            raise ValueError(f"phase {str(phase)[:20]!r}, epoch {str(epoch)[:20]!r}")
        self.doc = doc
        t = SwapTicket(self.route, epoch, str(phase), serving(doc))  # who serves follows the phase, never a field
        if self._ticket is None or t.epoch != self._ticket.epoch:
            if t.phase == "watching" and t.epoch != self.watch_epoch:
                self.watch_epoch, self.cand, self.first_answer = t.epoch, Running(), None
                self.counts.update(attempts=0, errors=0)
            if t.phase == "rolled_back" and t.epoch != self.back_epoch:
                self.back_epoch, self.back_first = t.epoch, None
            self._reported = 0.0  # report at the next tick: the owner waits on it
        self._ticket = t
        if t.serving is None:
            self._open.clear()
        else:
            self._open.set()

    async def admit(self, pinned: str | None = None) -> Mark:
        """Wait while no engine can take the request (bounded); the engine to send it to, marked. Every request
        ends in one count: ``served`` (sent to an engine), ``rejected`` (the proxy's 503) or ``hung_up``.
        ``pinned``: the engine the request's pin header names; refused when the swap has the other serving."""
        started = time.monotonic()
        t = self.ticket()
        arrived = t.phase
        try:
            if t.serving is None:
                t = await self._hold(t, started)
            if t.epoch != self._ready_epoch:  # once per phase: the engine now serving, probed (its model name)
                await self._ready(t)
        except asyncio.CancelledError:
            self.counts["hung_up"] += 1
            raise
        assert t.serving is not None
        if pinned is not None and pinned != t.serving:
            why = f"engine {pinned!r} is stopped: the route's swap has {t.serving!r} serving ({t.phase})"
            raise self._refused(SwapUnavailable(why, RETRY_LATER_S))
        self.counts["served"] += 1
        self.client_in_flight += 1
        self.in_flight[t.serving] = self.in_flight.get(t.serving, 0) + 1
        side = "baseline" if t.serving == self.baseline else "candidate"
        regime = regime_of(self.client_in_flight)
        return Mark(self.route, t.epoch, arrived, t.serving, side, regime, time.monotonic() - started)

    async def _hold(self, t: SwapTicket, started: float) -> SwapTicket:
        """Held until the phase says who serves; ``SwapUnavailable`` past the queue's bounds or once ``failed``."""
        s = self.settings
        if t.phase == "failed":
            raise self._refused(self._failed())
        if self.held >= s.queue_max_requests:
            why = f"the route is swapping engines ({t.phase}) and {self.held} requests are already held"
            raise self._refused(SwapQueueFull(why, self._retry_after()))
        self.held += 1
        self.counts["held"] += 1
        try:
            while (t := self.ticket()).serving is None:
                left = s.queue_max_wait_s - (time.monotonic() - started)
                if t.phase == "failed":
                    raise self._refused(self._failed())
                if left <= 0:
                    why = f"the route is swapping engines ({t.phase}): held the longest a request may wait"
                    raise self._refused(SwapQueueFull(f"{why} ({s.queue_max_wait_s:g} s)", self._retry_after()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._open.wait(), min(left, 1.0))
        finally:
            self.held -= 1
            waited = time.monotonic() - started
            self.counts["held_seconds"] += waited
            if self.observe_wait is not None:
                self.observe_wait(waited)
        return t

    def _failed(self) -> SwapFailed:
        detail = str(self.doc.get("detail") or "")[:300]
        why = f"the route has no engine: the baseline did not start again ({detail}); an admin start or abort retries"
        return SwapFailed(why, RETRY_LATER_S)

    def _refused(self, exc: SwapUnavailable) -> SwapUnavailable:
        self.counts["rejected"] += 1
        return exc

    async def _ready(self, t: SwapTicket) -> None:
        """The serving engine probed once per epoch (``probe``), shared by the requests that arrive meanwhile."""
        await asyncio.shield(self._probe_started(t))

    def _probe_started(self, t: SwapTicket) -> asyncio.Future[None]:
        if self._probing is None or self._probing[0] != t.epoch:
            self._probing = (t.epoch, asyncio.ensure_future(self._probe_once(t)))
        return self._probing[1]

    async def _probe_once(self, t: SwapTicket) -> None:
        try:
            if self.probe is not None and t.serving is not None:
                await self.probe(t.serving)
        except Exception:
            log.exception("swap of route %d: probing %s failed", self.route, t.serving)
        self._ready_epoch = max(self._ready_epoch, t.epoch)

    def _retry_after(self) -> float:
        started = self.doc.get("swap_started")
        waited = time.time() - float(started) if isinstance(started, int | float) else 0.0
        return max(1.0, self.settings.queue_max_wait_s - waited)

    def done(self, mark: Mark) -> None:
        self.client_in_flight -= 1
        self.in_flight[mark.engine] -= 1
        self.last_end[mark.engine] = time.time()
        if self._ticket is not None and self._ticket.serving is None:
            self._reported = 0.0  # draining: say so at once

    def on_result(self, mark: Mark, r: Result) -> None:
        """One answered request's share of the watch. A request that was held (it arrived in a phase without a
        serving engine) counts as a success or failure, never with its figures: its TTFT holds its wait."""
        failed = r.outcome in FAILED or (r.outcome == "engine_error" and r.status >= 500)
        if r.outcome in ("client_disconnect", "rejected"):
            return
        timed = not failed and mark.phase in SERVING
        if mark.side == "baseline":
            if timed:
                self.window.add(mark.regime, figures_of(r.timing, r.loop_stalled))
            if not failed and mark.epoch == self.back_epoch:
                self.back_first = _earliest(self.back_first, r)
            return
        if mark.epoch != self.watch_epoch:
            return
        self.counts["attempts"] += 1
        self.counts["errors"] += failed
        if timed:
            self.cand.add(mark.regime, figures_of(r.timing, r.loop_stalled))
        if not failed:
            self.first_answer = _earliest(self.first_answer, r)

    # ------------------------------------------------------------------------------- reports

    def report(self) -> dict[str, Any]:
        t = self._ticket
        return {
            "epoch": t.epoch if t is not None else -1,
            "ts": time.time(),
            "in_flight": dict(self.in_flight),
            "held_now": self.held,
            "last_end": dict(self.last_end),
            "first_answer": self.first_answer,
            "watch_epoch": self.watch_epoch,
            "back_first": self.back_first,
            "back_epoch": self.back_epoch,
            "base": self.window.sums() if t is not None and t.phase == "draining" else {},
            "cand": self.cand.sums,
            "counts": dict(self.counts),
        }

    async def tick(self) -> None:
        """Refresh the phase; write this process's report when due. The write (the lock, which the owner holds
        through its durable writes, and the file) runs in a thread: the event loop never waits on the disk."""
        f = self.file
        if f is None:
            return
        t = self.ticket()
        if t.serving is not None and t.epoch != self._ready_epoch:
            self._probe_started(t)  # as the engine becomes the one serving, before a request needs it
        now = time.monotonic()
        every = FAST_REPORT_S if t.serving is None else WATCH_REPORT_S if t.phase == "watching" else REPORT_S
        if now - self._reported < every:
            return
        self._reported = now
        self.io = asyncio.ensure_future(asyncio.to_thread(self._write_report, f, self.report()))
        done = await asyncio.shield(self.io)
        if done is not None and f.gen() == done[0]:  # nobody wrote since: the document as written is current
            self._gen = done[0]
            self._seen(done[1])
        else:
            self.ticket()

    def _write_report(self, f: StateFile, report: dict[str, Any]) -> tuple[bytes, dict[str, Any]] | None:
        """In a thread: this process's report into the document under the lock; the generation written, and it."""
        with f.locked():
            try:
                doc = f.read()[1]
            except ValueError:
                return None
            if doc is None or doc.get("plan") != self.plan or not isinstance(doc.get("reports"), dict):
                return None
            doc["reports"][self.slot] = report
            return f.write(doc), doc

    def open(self) -> None:
        self.file = StateFile(self.path)
        self.ticket()

    def close(self) -> None:
        if self._probing is not None:
            self._probing[1].cancel()
        if self.file is not None:
            self.file.close()
            self.file = None


def _earliest(known: float | None, r: Result) -> float:
    """The earlier of ``known`` and the wall time of ``r``'s first answer byte (its end less its e2e plus its TTFT;
    the end for an answer without one)."""
    t = r.timing
    first = time.time() - (t.e2e_s or 0.0) + (t.ttft_s if t.ttft_s is not None else (t.e2e_s or 0.0))
    return first if known is None else min(known, first)
