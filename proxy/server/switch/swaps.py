"""Every route's swap in one serving process (``Swaps``): the router's ``gate``, the admission of a request
(``proxy.server.switch.swapqueue.RouteSwap``: the hold queue), the watch's observer, /health, metrics (read from the
shared state at scrape time) and the admin commands; ``probe_served``: an engine's served model name as it starts
serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client.core import Metric

from proxy import engines as dialects
from proxy.config.settings import Settings
from proxy.errors import BadRequest, NotFound
from proxy.server.record.context import current
from proxy.server.record.metrics import Metrics, SwapSample, swap_families
from proxy.server.record.result import Result
from proxy.server.record.tasks import held
from proxy.server.request.upstream import Engine
from proxy.server.switch.swapqueue import FAST_REPORT_S, Mark, RouteSwap
from proxy.server.switch.swapstate import ACTIONS, PHASES, SwapTicket, default_state_file

log = logging.getLogger("enginemeter.swap")

#: the state document's fields ``GET /admin/rollout`` shows as they are
STATE_KEYS = (
    "phase",
    "serving",
    "epoch",
    "cause",
    "detail",
    "outage_s",
    "back_outage_s",
    "phase_s",
    "rollbacks",
    "watch",
)

#: the bound of one probe of an engine that starts serving
PROBE_S = 3.0


@dataclass(eq=False)
class Swaps:
    """Every route's swap in this process (module docstring)."""

    settings: Settings
    by_route: dict[int, RouteSwap]

    @classmethod
    def of(
        cls,
        settings: Settings,
        slot: int = 0,
        metrics: Metrics | None = None,
        engines: Mapping[str, Engine] | None = None,
    ) -> Swaps | None:
        """``engines``: the app's, whose served model name and kind each swap probes as one starts serving."""
        by_route = {}
        for i, r in enumerate(settings.routes):
            if r.swap is not None:
                rs = by_route[i] = RouteSwap(i, r.primary, r.swap, state_path(settings, i), str(slot))
                if metrics is not None:
                    rs.observe_wait = metrics.swap_wait.labels(str(i)).observe
                if engines is not None:
                    rs.probe = functools.partial(probe_served, engines)
        return cls(settings, by_route) if by_route else None

    def gate(self, route: int) -> SwapTicket | None:
        rs = self.by_route.get(route)
        return rs.ticket() if rs is not None else None

    async def admit(self, route: int, pinned: str | None = None) -> Mark:
        mark = await self.by_route[route].admit(pinned)
        if (ctx := current()) is not None:
            ctx.swap = mark
        return mark

    def done(self, mark: Mark) -> None:
        self.by_route[mark.route].done(mark)

    def standby(self) -> set[str]:
        """The engines a swap keeps stopped now: the one not serving (both, mid-swap; once ``failed`` the
        candidate only: the baseline should serve and does not, /health says degraded)."""
        out: set[str] = set()
        for rs in self.by_route.values():
            t = rs.ticket()
            out |= (
                {rs.settings.candidate} if t.phase == "failed" else {rs.baseline, rs.settings.candidate} - {t.serving}
            )
        return out

    def on_result(self, r: Result) -> None:
        """An ``Attempts`` observer: the answered request's figures for the watch (in its context)."""
        ctx = current()
        mark = ctx.swap if ctx is not None else None
        if isinstance(mark, Mark) and r.role == "primary":
            self.by_route[mark.route].on_result(mark, r)

    def command(self, route: int | None, action: str) -> dict[str, Any]:
        """An admin command, written for the owner of the engines to carry out; the route's state."""
        if action not in ACTIONS:
            why = f"`action` must be one of {list(ACTIONS)} on a swap, got {str(action)[:40]!r}"
            raise BadRequest(why, param="action")
        if route is None:
            if len(self.by_route) != 1:
                raise BadRequest(f"`route` is required: swaps on routes {sorted(self.by_route)}", param="route")
            route = next(iter(self.by_route))
        rs = self.by_route.get(route)
        if rs is None or rs.file is None:
            raise NotFound(f"route {route} has no swap (swaps on routes {sorted(self.by_route)})")
        with rs.file.locked():
            doc = rs.file.read()[1]
            if doc is None or doc.get("plan") != rs.plan:
                raise NotFound("the swap's state is not there yet (the proxy is starting)")
            doc["command"] = {"action": action, "who": "admin"}
            rs.file.write(doc)
        log.info("swap of route %d: %s requested by admin", route, action)
        return {**self.state_of(rs), "command": action}

    def state_of(self, rs: RouteSwap) -> dict[str, Any]:
        rs.ticket()
        doc = rs.doc
        out: dict[str, Any] = {"route": rs.route, "baseline": rs.baseline, "candidate": rs.settings.candidate}
        out |= {k: doc.get(k) for k in STATE_KEYS}
        out["phase_seconds"] = round(time.time() - float(doc["since"]), 3) if "since" in doc else None
        out["held"] = sum(int(r.get("held_now", 0)) for r in (doc.get("reports") or {}).values())
        out["counts"] = totals(doc)
        out["events"] = (doc.get("events") or [])[-10:]
        out["state_file"] = str(rs.path)
        return out

    def state(self) -> list[dict[str, Any]]:
        return [self.state_of(rs) for rs in self.by_route.values()]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        for rs in self.by_route.values():
            rs._open = asyncio.Event()  # this event loop's
            rs.open()
        try:
            async with held(self._tick_forever):
                yield
        finally:
            for rs in self.by_route.values():
                if rs.io is not None:  # a report being written: the file stays open until it is
                    await asyncio.wait([rs.io])
                rs.close()

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(FAST_REPORT_S)  # a periodic timer, not a synchronisation
            for rs in self.by_route.values():
                try:
                    await rs.tick()
                except Exception:
                    log.exception("swap of route %d: tick failed", rs.route)

    # a prometheus_client collector: every scrape reads the shared file (any worker answers the same)
    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        return swap_families([s for rs in self.by_route.values() if (s := sample(rs)) is not None])


def totals(doc: dict[str, Any]) -> dict[str, float]:
    """Every process's counts added up (a process restarted starts its own from 0)."""
    out: dict[str, float] = {}
    for r in (doc.get("reports") or {}).values():
        for k, v in (r.get("counts") or {}).items():
            if isinstance(v, int | float):
                out[k] = out.get(k, 0) + v
    return out


def sample(rs: RouteSwap) -> SwapSample | None:
    """What a scrape shows; runs in a scrape's thread: its own read of the map."""
    f = rs.file
    try:
        doc = f.read()[1] if f is not None else None
    except ValueError:
        return None
    if doc is None or doc.get("plan") != rs.plan or doc.get("phase") not in PHASES:
        return None
    c = totals(doc)
    return SwapSample(
        route=str(rs.route),
        phase=str(doc["phase"]),
        phase_seconds=max(0.0, time.time() - float(doc["since"])),
        held=sum(int(r.get("held_now", 0)) for r in doc["reports"].values()),
        outage_seconds=doc.get("outage_s"),
        back_outage_seconds=doc.get("back_outage_s"),
        rollbacks=dict(doc.get("rollbacks") or {}),
        transitions=dict(doc.get("transitions") or {}),
        rejected=c.get("rejected", 0),
        hung_up=c.get("hung_up", 0),
    )


async def probe_served(engines: Mapping[str, Engine], name: str) -> None:
    """A launched engine that now serves a swap route, probed as ``serve`` probes a URL engine at start: its kind
    and the model name it serves (``GET /v1/models``), so a request carries that name (``Attempts.served_model``;
    vLLM and SGLang refuse any other) and the answer the client's. A name the config sets stays. Never raises."""
    e = engines[name]
    p = await dialects.probe(e.client, PROBE_S, kind=e.settings.kind or e.kind, model=e.settings.model)
    e.kind = p.kind or e.kind
    if p.model is not None:
        e.model = p.model
        log.info("engine %s serves the model `%s`: requests are sent under that name", name, p.model)
    if p.context_length is not None:
        e.info["context_length"] = p.context_length
    if p.error:
        log.warning("swap: probing %s failed: %s (its last known model name stays: %s)", name, p.error, e.model)


def state_path(settings: Settings, route: int) -> Path:
    s = settings.routes[route].swap
    assert s is not None
    if s.state_file:
        return Path(s.state_file).expanduser()
    return default_state_file(settings.host, settings.port, route)
