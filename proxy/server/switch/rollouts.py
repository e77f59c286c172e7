"""Every route's rollout (``Rollouts``): one ``proxy.server.switch.rollout.Rollout`` per route that has one, and
what the rest of the proxy calls: the router's ``ticket``, the mirror's pair observer, the ``Attempts``
observer, the lifespan (open, tick once a second, close), the admin commands, /health and the metrics collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.core import Metric

from proxy.config.settings import Settings
from proxy.errors import BadRequest, NotFound
from proxy.sequential import Regime
from proxy.server.record.context import current
from proxy.server.record.metrics import rollout_families
from proxy.server.record.result import Result
from proxy.server.record.tasks import held
from proxy.server.switch.rollout import Rollout
from proxy.server.switch.rolloutstate import ACTIONS, TICK_S, StateUnavailable, Ticket, default_state_file

if TYPE_CHECKING:
    from proxy.server.mirror.compare import PairComparison
    from proxy.server.mirror.pairing import Pending

log = logging.getLogger("enginemeter.rollout")


@dataclass(eq=False)
class Rollouts:
    """Every route's rollout: the router's ``ticket``, the mirror's pair observer, the Attempts observer, the
    lifespan (open, tick, close), the admin commands, /health and the metrics collector."""

    settings: Settings
    run: str
    by_route: dict[int, Rollout]

    @classmethod
    def of(cls, settings: Settings, run: str, env: Mapping[str, str] | None = None) -> Rollouts | None:
        by_route = {}
        for i, r in enumerate(settings.routes):
            if r.rollout is None:
                continue
            path = (
                Path(r.rollout.state_file).expanduser()
                if r.rollout.state_file
                else default_state_file(settings.host, settings.port, i, env)
            )
            by_route[i] = Rollout(i, r.primary, r.rollout, path, run=run, min_effect=settings.mirror.min_effect)
        return cls(settings, run, by_route) if by_route else None

    def ticket(self, route: int) -> Ticket | None:
        ro = self.by_route.get(route)
        return ro.ticket() if ro is not None else None

    def on_pair(self, e: Pending, c: PairComparison, regime: Regime | None) -> None:
        """A ``Mirror.pair_observers`` hook: comparable pairs of requests a rollout routed."""
        t = e.rollout
        if isinstance(t, Ticket) and t.counting:
            self.by_route[t.route].on_pair(t, c, regime)

    def on_result(self, r: Result) -> None:
        """An ``Attempts`` observer: the candidate's attempts of requests a rollout routed (in their context)."""
        ctx = current()
        t = ctx.rollout if ctx is not None else None
        if isinstance(t, Ticket) and t.counting and r.engine == t.candidate:
            self.by_route[t.route].on_result(r, t)

    def command(self, route: int | None, action: str) -> dict[str, Any]:
        if action not in ACTIONS:
            raise BadRequest(f"`action` must be one of {list(ACTIONS)}, got {str(action)[:40]!r}", param="action")
        if route is None:
            if len(self.by_route) != 1:
                raise BadRequest(f"`route` is required: rollouts on routes {sorted(self.by_route)}", param="route")
            route = next(iter(self.by_route))
        ro = self.by_route.get(route)
        if ro is None:
            raise BadRequest(
                f"route {route} has no rollout (rollouts on routes {sorted(self.by_route)})", param="route"
            )
        if ro.file is None:
            raise NotFound("the rollout is not open yet (the proxy is starting)")
        try:
            ro.command(action, "admin")
        except (OSError, ValueError) as exc:
            raise StateUnavailable(f"cannot update the rollout's state in {ro.path}: {exc}") from None
        return ro.state()

    def state(self) -> list[dict[str, Any]]:
        return [ro.state() for ro in self.by_route.values()]

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        for i, ro in self.by_route.items():
            r = self.settings.routes[i].rollout
            assert r is not None
            try:
                ro.open(r.state)
            except OSError as exc:  # the proxy does not start: a rollout it cannot keep must not run unguarded
                log.error("rollout of route %d: cannot open its state at %s: %s", i, ro.path, exc)
                raise
        try:
            async with held(self._tick_forever):
                yield
        finally:
            for ro in self.by_route.values():
                ro.close()

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)  # a periodic timer, not a synchronisation
            for ro in self.by_route.values():
                try:
                    ro.tick()
                except Exception:
                    log.exception("rollout of route %d: tick failed", ro.route)

    # a prometheus_client collector: every scrape reads the shared file (any worker answers the same)
    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        return rollout_families([s for ro in self.by_route.values() if (s := ro.sample()) is not None])
