"""Foreign load: requests an engine runs that the bench did not send. A cell repeat measured while another client
loads the engine measures that client too, so it is flagged and cannot decide (``Results.flags``).

What each engine kind says it is running comes from its dialect (``Dialect.busy``: llama.cpp ``/slots``
``is_processing`` or ``/metrics`` processing + deferred, SGLang ``num_running_reqs`` + ``num_queue_reqs``, vLLM
``num_requests_running`` + ``waiting``). The bench counts what it has in flight per engine server (an A/A twin
shares its server). Two readings:

- **before** each repeat: the engine must be idle. Requests of the previous repeat may still be leaving it (and
  SGLang's gauges lag by its stats interval), so it is polled until idle for up to ``settle_s``; still busy
  then means someone else is using it;
- **during** the repeat, every ``interval_s``: the engine's count against the most the bench had in flight
  while the reading was taken; an excess in two readings in a row flags the repeat (one reading can catch a
  request that just ended on the bench's side and not yet on the engine's).

An engine that does not say (no kind, no endpoint) is not watched; the report says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx

from proxy.engines import dialect
from proxy.types import EngineKind


@dataclass
class InFlight:
    """Requests the bench has in flight per engine server, with the most seen since the last ``take_max``."""

    now: dict[str, int] = field(default_factory=dict)
    peak: dict[str, int] = field(default_factory=dict)

    def up(self, server: str) -> None:
        n = self.now.get(server, 0) + 1
        self.now[server] = n
        self.peak[server] = max(self.peak.get(server, 0), n)

    def down(self, server: str) -> None:
        self.now[server] = self.now.get(server, 0) - 1

    def take_max(self, server: str) -> int:
        """The most in flight since the last call (then restarts from what is in flight now)."""
        m = self.peak.get(server, 0)
        self.peak[server] = self.now.get(server, 0)
        return m


@dataclass
class ForeignLoad:
    """What one repeat saw: the record's ``foreign`` field."""

    before: int | None = None
    readings: int = 0
    max_excess: int = 0
    flagged: bool = False
    when: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "before": self.before,
            "readings": self.readings,
            "max_excess": self.max_excess,
            "flagged": self.flagged,
            "when": self.when,
        }


class BusyWatch:
    def __init__(
        self,
        servers: Mapping[str, EngineKind | None],
        inflight: InFlight,
        *,
        interval_s: float = 0.25,
        settle_s: float = 3.0,
        timeout_s: float = 2.0,
    ) -> None:
        self._kinds = dict(servers)
        self._inflight = inflight
        self._interval, self._settle = interval_s, settle_s
        self._timeout = timeout_s
        self._clients = {
            s: httpx.AsyncClient(base_url=s, timeout=timeout_s, trust_env=False)
            for s, k in self._kinds.items()
            if k is not None
        }
        #: servers that did not say what they run (not watched; the report says so)
        self.unwatched: set[str] = set()

    async def aclose(self) -> None:
        for c in self._clients.values():
            await c.aclose()

    async def _read(self, server: str) -> int | None:
        kind, client = self._kinds.get(server), self._clients.get(server)
        if kind is None or client is None or server in self.unwatched:
            return None
        try:
            n = await dialect(kind).busy(client, self._timeout)
        except (httpx.HTTPError, ValueError):
            n = None
        if n is None:
            self.unwatched.add(server)
        return n

    @contextlib.asynccontextmanager
    async def repeat(self, server: str | None) -> AsyncIterator[ForeignLoad]:
        """Watch one cell repeat on ``server``: idle before it, no excess while it runs."""
        w = ForeignLoad()
        if server is None or self._kinds.get(server) is None:
            yield w
            return
        deadline = time.monotonic() + self._settle
        while True:
            n = await self._read(server)
            if n is None or n <= self._inflight.now.get(server, 0):
                break
            if time.monotonic() >= deadline:
                w.before, w.flagged, w.max_excess, w.when = n, True, n, "busy before the repeat started"
                break
            await asyncio.sleep(self._interval)
        if w.before is None:
            w.before = n
        task = asyncio.create_task(self._during(server, w))
        try:
            yield w
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _during(self, server: str, w: ForeignLoad) -> None:
        streak = 0
        while True:
            await asyncio.sleep(self._interval)
            self._inflight.take_max(server)
            n = await self._read(server)
            ours = self._inflight.take_max(server)
            if n is None:
                return
            w.readings += 1
            excess = n - ours
            streak = streak + 1 if excess > 0 else 0
            if streak >= 2:
                w.max_excess = max(w.max_excess, excess)
                if not w.flagged:
                    w.flagged, w.when = True, "during the repeat"
